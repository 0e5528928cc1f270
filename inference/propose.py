"""Drafters: one fixed interface that turns the last accepted hidden state into tree tokens."""
from __future__ import annotations

from typing import Protocol

import torch

from ..heads import MedusaHeads
from ..tree.buffers import TreeBuffers


class Drafter(Protocol):
    def draft(self, hidden: torch.Tensor, sequence: torch.Tensor, buffers: TreeBuffers) -> torch.Tensor:
        """hidden: (H,) the LM head's input at the last accepted token; sequence: (L,) every token so far,
        the root (the target's next token, not yet verified) last. Returns (N,) tokens for nodes 1..N."""
        ...


class HeadsDrafter:
    """Each node takes rank `rank` of head `depth` from the heads' top-k. Unconditioned and root-conditioned heads
    draft the whole tree in one product; path-conditioned heads draft level by level, each parent's children
    from head `depth` given the tokens on the parent's path."""

    def __init__(self, heads: MedusaHeads) -> None:
        self.heads = heads

    @torch.no_grad()
    def draft(self, hidden: torch.Tensor, sequence: torch.Tensor, buffers: TreeBuffers) -> torch.Tensor:
        if self.heads.config.condition != "path":
            top = self.heads.topk(hidden, buffers.topk, context=sequence[-1:])  # (K, topk)
            return top.reshape(-1)[buffers.draft_index]
        tokens = torch.empty(buffers.size, dtype=torch.long, device=hidden.device)
        tokens[0] = sequence[-1]
        for d, (chains, nodes, row, rank) in enumerate(buffers.levels):
            h = hidden.expand(chains.shape[0], -1)
            top = self.heads.head_topk(d, h, buffers.topk, context=tokens[chains])  # (parents, topk)
            tokens[nodes] = top[row, rank]
        return tokens[1:]
