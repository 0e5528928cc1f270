"""Medusa loss: sum over heads of w^(k-1) * CE(head_k(h_t), token_{t+k+1}), with per-head accuracy."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

IGNORE = -100


def medusa_loss(head_logits: torch.Tensor, labels: torch.Tensor, decay: float = 0.8,
                soft: "SoftTargets | None" = None, soft_weight: float = 0.0,
                shares: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """head_logits: (K, N, V') over the draft vocabulary; labels: (N, K) draft-vocabulary indices, IGNORE where
    there is no target (past the answer's end) or the token is outside the draft vocabulary.
    With `soft` and soft_weight = a, head k's term is (1 - a) * CE(labels) + a * CE(soft targets): the target's
    own distribution where it wrote the labelled token (Hydra's teacher loss), not just its choice.
    shares (hard, soft), each (K,): what to divide each head's summed CE by instead of this batch's own count of
    targets. A process's share of a global batch divides by the global count over the processes (their number
    times less: DDP averages gradients), so that N processes train exactly as one process on the whole batch.
    Returns (loss, metrics) with metrics ce_k (the hard-label CE of this batch) for each head k = 1..K."""
    k_heads = head_logits.shape[0]
    loss = head_logits.new_zeros((), dtype=torch.float32)
    metrics = {}
    for k in range(k_heads):
        logits = head_logits[k].float()
        if shares is None:
            ce = F.cross_entropy(logits, labels[:, k], ignore_index=IGNORE)
            # a batch with no target for this head adds nothing
            term = ce if torch.isfinite(ce) else logits.new_zeros(())
        else:
            summed = F.cross_entropy(logits, labels[:, k], ignore_index=IGNORE, reduction="sum")
            term = summed / shares[0][k] if shares[0][k] > 0 else logits.new_zeros(())
            ce = summed.detach() / (labels[:, k] != IGNORE).sum()  # this batch's own mean, as without shares
        if soft is not None and soft_weight > 0:
            valid = soft.valid[:, k]
            if valid.any() or shares is not None:
                logp = logits[valid].log_softmax(-1).gather(-1, soft.index[valid, k])  # (n, m)
                per_row = -(soft.prob[valid, k].float() * logp).sum(-1)
                if shares is None:
                    soft_ce = per_row.mean()
                else:
                    soft_ce = per_row.sum() / shares[1][k] if shares[1][k] > 0 else logits.new_zeros(())
                term = (1 - soft_weight) * term + soft_weight * soft_ce
        loss = loss + decay**k * term
        metrics[f"ce_{k + 1}"] = float(ce.detach())
    return loss, metrics


class SoftTargets(NamedTuple):
    """For each position and head: the target's m most likely draft-vocabulary tokens at the position the head
    guesses, with their probabilities renormalised over those m."""
    index: torch.Tensor  # (N, K, m) draft-vocabulary indices
    prob: torch.Tensor  # (N, K, m)
    valid: torch.Tensor  # (N, K) bool: the head has a target there


@torch.no_grad()
def teacher_topk(hidden: torch.Tensor, weight: torch.Tensor, m: int,
                 chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden (N, H) LM-head inputs, weight (V', H) the LM head's draft-vocabulary rows -> the m most likely
    draft indices (N, m) int32 and their probabilities renormalised over those m (N, m) fp16."""
    idx, prob = [], []
    for a in range(0, hidden.shape[0], chunk):
        logits = hidden[a : a + chunk].to(weight.dtype) @ weight.T
        top = logits.float().topk(min(m, weight.shape[0]), dim=-1)
        idx.append(top.indices.to(torch.int32))
        prob.append(top.values.softmax(-1).to(torch.float16))  # renormalised over the m kept
    return torch.cat(idx), torch.cat(prob)


@torch.no_grad()
def topk_hits(head_logits: torch.Tensor, targets: torch.Tensor,
              ks: tuple[int, ...] = (1, 5)) -> tuple[torch.Tensor, torch.Tensor]:
    """head_logits: (K, N, V'); targets: (N, K) draft indices, -1 for a real token outside the draft vocabulary
    (always a miss), IGNORE where there is no target. Returns (hits (K, len(ks)), counted (K,))."""
    valid = (targets != IGNORE).T  # (K, N)
    top = head_logits.topk(max(ks), dim=-1).indices  # (K, N, maxk)
    match = top == targets.T[..., None]  # (K, N, maxk)
    hits = torch.stack([(match[..., :k].any(-1) & valid).sum(-1) for k in ks], dim=-1)
    return hits, valid.sum(-1)
