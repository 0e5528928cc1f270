"""Medusa heads: K stacks of residual blocks over the base model's final hidden state."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import MedusaConfig


class ResBlock(nn.Module):
    """x + SiLU(W x + b), with W and b zero-initialised: a new head is the identity, so it starts as the base LM head."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """Head k maps the hidden state h_t to logits for token t+1+k over the draft vocabulary.

    With `own_lm_head=False` every head scores through `lm_head_weight`, the base model's frozen LM head,
    which is referenced (never copied, never saved) unless a draft vocabulary selects some of its rows."""

    def __init__(self, config: MedusaConfig, lm_head_weight: torch.Tensor) -> None:
        super().__init__()
        if lm_head_weight.shape != (config.vocab_size, config.hidden_size):
            raise ValueError(
                f"LM-head weight has shape {tuple(lm_head_weight.shape)}, heads expect "
                f"({config.vocab_size}, {config.hidden_size}) (vocab_size, hidden_size)"
            )
        self.config = config
        h = config.hidden_size
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(h) for _ in range(config.num_layers)]) for _ in range(config.num_heads)
        )
        vocab = None if config.draft_vocab is None else torch.tensor(config.draft_vocab, dtype=torch.long)
        self.register_buffer("draft_vocab", vocab, persistent=False)  # (V',) or None
        rows = lm_head_weight.detach() if vocab is None else lm_head_weight.detach()[vocab.to(lm_head_weight.device)]
        if config.own_lm_head:
            self.lm_heads = nn.ModuleList(nn.Linear(h, rows.shape[0], bias=False) for _ in range(config.num_heads))
            for head in self.lm_heads:
                head.weight.data.copy_(rows)
            self.shared_weight = None
        else:
            self.lm_heads = None
            self.register_buffer("shared_weight", rows, persistent=False)  # (V', H), frozen

    def hidden(self, h: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (K, ..., H): each head's residual stack."""
        return torch.stack([blocks(h) for blocks in self.blocks])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (K, ..., V') logits over the draft vocabulary."""
        z = self.hidden(h)
        if self.lm_heads is None:
            return z @ self.shared_weight.T  # one product for all heads: the weight is read once
        return torch.stack([head(z[k]) for k, head in enumerate(self.lm_heads)])

    @torch.no_grad()
    def topk(self, h: torch.Tensor, k: int) -> torch.Tensor:
        """(H,) -> (K, k) token ids: each head's k best guesses, best first."""
        ids = self(h).topk(k, dim=-1).indices
        return ids if self.draft_vocab is None else self.draft_vocab[ids]
