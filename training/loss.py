"""Medusa loss: sum over heads of w^(k-1) * CE(head_k(h_t), token_{t+k+1}), with per-head accuracy."""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


def medusa_loss(head_logits: torch.Tensor, labels: torch.Tensor, decay: float = 0.8) -> tuple[torch.Tensor, dict[str, float]]:
    """head_logits: (K, N, V') over the draft vocabulary; labels: (N, K) draft-vocabulary indices, IGNORE where
    there is no target (past the answer's end) or the token is outside the draft vocabulary.
    Returns (loss, metrics) with metrics ce_k for each head k = 1..K."""
    k_heads = head_logits.shape[0]
    loss = head_logits.new_zeros((), dtype=torch.float32)
    metrics = {}
    for k in range(k_heads):
        ce = F.cross_entropy(head_logits[k].float(), labels[:, k], ignore_index=IGNORE)
        if torch.isfinite(ce):  # a batch with no target for this head adds nothing
            loss = loss + decay**k * ce
        metrics[f"ce_{k + 1}"] = float(ce.detach())
    return loss, metrics


@torch.no_grad()
def topk_hits(head_logits: torch.Tensor, targets: torch.Tensor, ks: tuple[int, ...] = (1, 5)) -> tuple[torch.Tensor, torch.Tensor]:
    """head_logits: (K, N, V'); targets: (N, K) draft indices, -1 for a real token outside the draft vocabulary
    (always a miss), IGNORE where there is no target. Returns (hits (K, len(ks)), counted (K,))."""
    valid = (targets != IGNORE).T  # (K, N)
    top = head_logits.topk(max(ks), dim=-1).indices  # (K, N, maxk)
    match = top == targets.T[..., None]  # (K, N, maxk)
    hits = torch.stack([(match[..., :k].any(-1) & valid).sum(-1) for k in ks], dim=-1)
    return hits, valid.sum(-1)
