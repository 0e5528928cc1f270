"""Batched decoding: B left-padded prompts; every row accepts its own path at every step and ends on its own.

The engine keeps the rows in one cache (engines/hf.BatchRows says how). Finished rows are padded with pad_token_id,
as transformers does; they ride along in the verify with their root alone and are not drafted. With the per-step
tree (inference/adaptive.py) the drafter chooses one tree size for the running rows from the batch's verify cost."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from medusa_heads.engines.base import Engine
from medusa_heads.inference.decode import DecodeState, DecodeStats, emit, run

if TYPE_CHECKING:
    from medusa_heads.inference.plan import DecodePlan


@torch.no_grad()
def decode_batch(engine: Engine, plan: "DecodePlan", input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 max_new_tokens: int, eos: set[int], pad_token_id: int,
                 stopping=None) -> tuple[torch.Tensor, DecodeStats]:
    """input_ids, attention_mask: (B, L), left-padded. Returns ((B, L + longest) tokens, stats)."""
    stats, clock = DecodeStats(), time.perf_counter
    b_size, prompt_len = input_ids.shape
    # a row's entries end by prompt_len + max_new_tokens; past the guess (a larger tree) the cache grows
    rows = engine.batch(input_ids, attention_mask, prompt_len + max_new_tokens + plan.max_size)

    sequences = torch.full((b_size, prompt_len + max_new_tokens), pad_token_id, dtype=torch.long,
                           device=input_ids.device)
    sequences[:, :prompt_len] = input_ids
    t0 = clock()
    out = rows.prefill()
    states, emitted = [], 0
    for b in range(b_size):
        logits = out.logits[b, -1:]
        if plan.processors:
            logits = plan.processors(input_ids[b : b + 1], logits.float())
        state = DecodeState(sequences[b], prompt_len, out.hidden[b, -1])
        emitted += len(emit(state, [plan.rule.first(logits)], max_new_tokens, eos, stopping))
        states.append(state)
    stats.tokens_per_step.append(emitted)
    stats.rows_per_step.append(b_size)
    stats.seconds["prefill"] += clock() - t0

    run(rows, states, plan, max_new_tokens, eos, stats, stopping)
    longest = max(s.new_tokens for s in states)
    return sequences[:, : prompt_len + longest].clone(), stats
