"""Batched decoding: B left-padded prompts; every row accepts its own path at every step and ends on its own.

All rows write their trees at the same cache slots; a row that accepted fewer nodes than the longest leaves
holes, which its attention mask hides (`valid`). Positions count each row's real tokens only, so every row
computes exactly what it would alone. Finished rows are padded with pad_token_id, as transformers does."""
from __future__ import annotations

import time

import torch
from transformers.cache_utils import DynamicLayer

from ..tree.buffers import TreeBuffers
from .cache import keep_accepted, new_cache
from .decode import AcceptRule, DecodeState, DecodeStats, _emit
from .propose import Drafter
from .sampling import process_tree
from .verify import Target


@torch.no_grad()
def decode_batch(
    target: Target,
    drafter: Drafter,
    buffers: TreeBuffers,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    rule: AcceptRule,
    eos: set[int],
    pad_token_id: int,
    processors=None,
    stopping=None,
) -> tuple[torch.Tensor, DecodeStats]:
    """input_ids, attention_mask: (B, L), left-padded. Returns ((B, L + longest) tokens, stats)."""
    stats, clock = DecodeStats(), time.perf_counter
    b_size, prompt_len = input_ids.shape
    device = input_ids.device
    if not bool(attention_mask[:, -1].all()):
        raise ValueError("batched prompts must be left-padded: the last position of every row must be a real token")
    cache = new_cache(target.model)  # grows with the holes; a preallocated one would have to assume the worst
    odd = sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer})
    if odd:
        raise NotImplementedError(f"batched generation needs full-attention cache layers; this model has {', '.join(odd)}")

    width = prompt_len + max_new_tokens
    sequences = torch.full((b_size, width), pad_token_id, dtype=torch.long, device=device)
    sequences[:, :prompt_len] = input_ids
    valid = attention_mask.bool().clone()  # (B, P): cache slots that hold each row's own tokens

    t0 = clock()
    out = target.prefill_batch(input_ids, attention_mask, cache)
    states, emitted = [], 0
    for b in range(b_size):
        logits = out.logits[b, -1:]
        if processors:
            logits = processors(input_ids[b : b + 1], logits.float())
        state = DecodeState(sequences[b], prompt_len, prompt_len, out.hidden[b, -1])
        emitted += len(_emit(state, [rule.first(logits)], max_new_tokens, eos, stopping))
        states.append(state)
    stats.tokens_per_step.append(emitted)
    stats.rows_per_step.append(b_size)
    stats.seconds["prefill"] += clock() - t0

    while not all(s.done for s in states):
        t0 = clock()
        roots = torch.stack([s.sequence[s.length - 1] for s in states])
        if hasattr(drafter, "draft_batch"):  # every row in one pass
            drafts = drafter.draft_batch(torch.stack([s.hidden for s in states]), roots, buffers)
        else:
            drafts = torch.stack([drafter.draft(s.hidden, s.sequence[: s.length], buffers) for s in states])
        trees = torch.cat([roots[:, None], drafts], dim=1)  # (B, T); finished rows ride along and are dropped below
        t1 = clock()
        positions = valid.long().sum(1)  # (B,): each row's root position = its real tokens so far
        out = target.verify_batch(trees, positions, valid, cache, buffers)
        t2 = clock()
        past, keeps, emitted, active = valid.shape[1], [], 0, 0
        for b, s in enumerate(states):
            if s.done:
                keeps.append(trees.new_zeros(0))
                continue
            logits = out.logits[b]
            if processors:
                logits = process_tree(processors, s.sequence[: s.length - 1], trees[b], logits, buffers.mask)
            nodes, bonus = rule.accept(trees[b], logits, buffers)
            chunk = _emit(s, trees[b, nodes[1:]].tolist() + [bonus], max_new_tokens, eos, stopping)
            nodes = nodes[: len(chunk) + 1]
            keeps.append(nodes)
            s.hidden = out.hidden[b, nodes[-1]]
            emitted, active = emitted + len(chunk), active + 1
        t3 = clock()
        m = max(k.shape[0] for k in keeps)
        keep = torch.zeros(b_size, m, dtype=torch.long, device=device)
        for b, k in enumerate(keeps):
            if k.shape[0]:
                keep[b, : k.shape[0]], keep[b, k.shape[0] :] = k, k[-1]
        keep_accepted(cache, past, keep)
        lengths = torch.tensor([k.shape[0] for k in keeps], device=device)
        valid = torch.cat([valid, torch.arange(m, device=device)[None] < lengths[:, None]], dim=1)
        stats.tokens_per_step.append(emitted)
        stats.rows_per_step.append(active)
        t4 = clock()
        for key, dt in zip(("propose", "verify", "accept", "commit"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            stats.seconds[key] += dt

    longest = max(s.new_tokens for s in states)
    return sequences[:, : prompt_len + longest].clone(), stats
