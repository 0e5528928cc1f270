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
        return self.draft_batch(hidden[None], sequence[-1:], buffers)[0]

    @torch.no_grad()
    def draft_batch(self, hidden: torch.Tensor, roots: torch.Tensor, buffers: TreeBuffers) -> torch.Tensor:
        """hidden: (B, H); roots: (B,) each row's root token. Returns (B, N): every row's tree in one pass."""
        if self.heads.config.condition != "path":
            top = self.heads.topk(hidden, buffers.topk, context=roots[:, None])  # (K, B, topk)
            return top.transpose(0, 1).reshape(hidden.shape[0], -1)[:, buffers.draft_index]
        tokens = torch.empty(hidden.shape[0], buffers.size, dtype=torch.long, device=hidden.device)
        tokens[:, 0] = roots
        for d, (chains, nodes, row, rank) in enumerate(buffers.levels):
            h = hidden[:, None].expand(-1, chains.shape[0], -1)
            top = self.heads.head_topk(d, h, buffers.topk, context=tokens[:, chains])  # (B, parents, topk)
            tokens[:, nodes] = top[:, row, rank]
        return tokens[:, 1:]
