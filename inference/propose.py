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
    """Each node takes rank `rank` of head `depth` from the heads' top-k."""

    def __init__(self, heads: MedusaHeads) -> None:
        self.heads = heads

    @torch.no_grad()
    def draft(self, hidden: torch.Tensor, sequence: torch.Tensor, buffers: TreeBuffers) -> torch.Tensor:
        top = self.heads.topk(hidden, buffers.topk)  # (K, topk)
        return top.reshape(-1)[buffers.draft_index]
