"""Medusa heads: K stacks of residual blocks over the base model's final hidden state."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from medusa_heads.config import MedusaConfig


class ResBlock(nn.Module):
    """x + SiLU(W x + b), with W and b zero-initialised: a new head is the identity, so it starts as the base LM
    head."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MLPBlock(nn.Module):
    """x + W2 SiLU(W1 x + b1) + b2: a wider residual block. W2 and b2 start at zero, so a new head is again the
    identity; W1 keeps its default initialisation (a zero W1 would never receive a gradient)."""

    def __init__(self, hidden_size: int, mlp_size: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden_size, mlp_size)
        self.down = nn.Linear(mlp_size, hidden_size)
        nn.init.zeros_(self.down.weight)
        nn.init.zeros_(self.down.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.silu(self.up(x)))


def _block(config: MedusaConfig) -> nn.Module:
    h = config.hidden_size
    return MLPBlock(h, config.mlp_size) if config.mlp_size else ResBlock(h)


class MedusaHeads(nn.Module):
    """Head k maps the hidden state h_t to logits for token t+1+k over the draft vocabulary.

    With `own_lm_head=False` every head scores through `lm_head_weight`, the base model's frozen LM head,
    which is referenced (never copied, never saved) unless a draft vocabulary selects some of its rows.

    With `config.condition` "root" or "path" a head also reads context tokens through the base's frozen input
    embeddings (`embed_weight`, referenced like the LM head): head k adds P_kj E[context_j] to h_t for each of its
    slots j (root first, then the tokens drafted above the node), with P_kj zero-initialised."""

    def __init__(self, config: MedusaConfig, lm_head_weight: torch.Tensor,
                 embed_weight: torch.Tensor | None = None) -> None:
        super().__init__()
        if lm_head_weight.shape != (config.vocab_size, config.hidden_size):
            raise ValueError(
                f"LM-head weight has shape {tuple(lm_head_weight.shape)}, heads expect "
                f"({config.vocab_size}, {config.hidden_size}) (vocab_size, hidden_size)"
            )
        self.config = config
        h = config.hidden_size
        self.blocks = nn.ModuleList(
            nn.Sequential(*[_block(config) for _ in range(config.num_layers)]) for _ in range(config.num_heads)
        )
        if config.context_size:
            if embed_weight is None:
                raise ValueError(f'heads with condition="{config.condition}" need the base model\'s input embeddings')
            if embed_weight.shape[1] != h:
                raise ValueError(f"input embeddings have shape {tuple(embed_weight.shape)}, heads expect width {h}")
            self.token_proj = nn.ModuleList(
                nn.ModuleList(nn.Linear(h, h, bias=False) for _ in range(config.context_slots(k)))
                for k in range(config.num_heads)
            )
            for proj in self.token_proj.modules():
                if isinstance(proj, nn.Linear):
                    nn.init.zeros_(proj.weight)
            self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)  # (V, H), frozen
        else:
            self.token_proj = None
            self.embed_weight = None
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
        # weight -> fn(x, weight) = x @ weight.T on other kernels (prepack_heads: oneDNN); see use_kernels
        self.pack = None
        self._scorer = None  # self.pack(shared_weight)
        self._joint: dict[int, tuple] = {}  # head -> (its weights' identity, joint weight, packed); see _joint_proj

    def _check_context(self, h: torch.Tensor, context: torch.Tensor | None, width: int) -> None:
        if width == 0:
            return
        if context is None or context.shape[:-1] != h.shape[:-1] or context.shape[-1] < width:
            raise ValueError(
                f'heads with condition="{self.config.condition}" need context tokens of shape '
                f"{(*h.shape[:-1], width)} (root first), got {None if context is None else tuple(context.shape)}"
            )

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the heads compute in: their weights'. Hidden states and embeddings are cast to it on the way in."""
        return next(self.blocks.parameters()).dtype

    def cast(self, dtype: torch.dtype) -> "MedusaHeads":
        """Weights and the shared LM-head rows in `dtype`, for drafting (e.g. bf16 on a CPU with bf16 kernels: half
        the bytes a drafting level reads). The base's input embeddings stay shared, never copied. Drafts only:
        the output stays the target's whatever the heads' dtype."""
        embed, self.embed_weight = self.embed_weight, None
        self.to(dtype)
        self.embed_weight = embed
        return self

    def head_hidden(self, k: int, h: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """(..., H), context (..., S) -> (..., H): head k's (0-based) input to its LM head, in the heads' dtype."""
        block = self.blocks[k]
        h = h.to(self.dtype)
        if self.token_proj is not None:
            slots = self.config.context_slots(k)
            self._check_context(h, context, slots)
            embedded = self.embed_weight[context[..., :slots]].to(h.dtype)  # (..., S, H)
            if torch.is_grad_enabled() or slots == 1:
                for j, proj in enumerate(self.token_proj[k]):
                    h = h + proj(embedded[..., j, :])
            else:  # drafting: head k's S projections as one product over the S embeddings side by side
                h = h + self._joint_proj(k, embedded.flatten(-2))
        return block(h)

    def _joint_proj(self, k: int, x: torch.Tensor) -> torch.Tensor:
        """x (..., S * H) -> (..., H): sum_j P_kj x_j through [P_k0 | ... | P_k(S-1)], built once per version of the
        weights (a training step or .to() builds it anew) and packed as use_kernels says."""
        projs = self.token_proj[k]
        key = tuple((p.weight.data_ptr(), p.weight._version, p.weight.dtype, p.weight.device) for p in projs)
        cached = self._joint.get(k)
        if cached is None or cached[0] != key:
            weight = torch.cat([p.weight.detach() for p in projs], dim=1)  # (H, S * H)
            cached = self._joint[k] = (key, weight, None if self.pack is None else self.pack(weight))
        return _product(x, cached[1], cached[2])

    def hidden(self, h: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """(..., H) -> (K, ..., H): each head's residual stack."""
        return torch.stack([self.head_hidden(k, h, context) for k in range(self.config.num_heads)])

    def forward(self, h: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """(..., H), context (..., S) token ids (root, then the drafted path; only for conditioned heads)
        -> (K, ..., V') logits over the draft vocabulary."""
        z = self.hidden(h, context)
        if self.lm_heads is None:
            return self._score(z)  # one product for all heads: the weight is read once
        return torch.stack([head(z[k]) for k, head in enumerate(self.lm_heads)])

    def head_logits(self, k: int, h: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """(..., H) -> (..., V'): head k (0-based) alone."""
        z = self.head_hidden(k, h, context)
        return self._score(z) if self.lm_heads is None else self.lm_heads[k](z)

    def use_kernels(self, pack) -> None:
        """Run the products that belong to no nn.Linear (scoring through the shared LM-head rows, each head's joint
        context projection) through pack(weight) -> fn(x, weight) (inference.prepack.pack_weight: oneDNN), or
        plain matmul for None. pack may return None for a weight it cannot serve; fn falls back to the plain
        product itself once the heads' weights have been replaced (a .to()). Drafts only: output never depends on it."""
        self.pack = pack
        self._joint.clear()
        self._scorer = None if pack is None or self.shared_weight is None else pack(self.shared_weight)

    def _score(self, z: torch.Tensor) -> torch.Tensor:
        return _product(z, self.shared_weight, self._scorer)

    def token_ids(self, ranks: torch.Tensor) -> torch.Tensor:
        """Rows of the heads' logits (draft-vocabulary ranks) -> token ids."""
        return ranks if self.draft_vocab is None else self.draft_vocab[ranks]

    @torch.no_grad()
    def topk(self, h: torch.Tensor, k: int, context: torch.Tensor | None = None) -> torch.Tensor:
        """(..., H) -> (K, ..., k) token ids: each head's k best guesses, best first."""
        return self.token_ids(self(h, context).topk(k, dim=-1).indices)

    @torch.no_grad()
    def head_topk(self, head: int, h: torch.Tensor, k: int, context: torch.Tensor | None = None) -> torch.Tensor:
        """(..., H) -> (..., k) token ids: head `head`'s (0-based) k best guesses."""
        return self.token_ids(self.head_logits(head, h, context).topk(k, dim=-1).indices)


def _product(x: torch.Tensor, weight: torch.Tensor, packed) -> torch.Tensor:
    """x @ weight.T, through `packed` (see MedusaHeads.use_kernels) where there is one."""
    return x @ weight.T if packed is None else packed(x, weight)
