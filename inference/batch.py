"""Batched decoding: B left-padded prompts; every row accepts its own path at every step and ends on its own.

All rows write their trees at the same cache slots, after the longest row; then each row's accepted entries move
to its own end (keep_accepted_rows), so the cache is as long as the longest row, and what lies past a row's end
is hidden by its attention mask, as its left padding is. Positions count each row's real tokens only, so every
row computes exactly what it would alone. Finished rows are padded with pad_token_id, as transformers does; they ride
along in the verify with their root alone and are not drafted. With the per-step tree (inference/adaptive.py) the
drafter chooses one tree size for the running rows from the batch's measured verify cost."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from einops import repeat

from medusa_heads.tree.buffers import from_parents
from medusa_heads.inference.cache import keep_accepted_rows, new_cache
from medusa_heads.inference.decode import DecodeState, DecodeStats, emit, run
from medusa_heads.inference.propose import Draft
from medusa_heads.inference.verify import Target

if TYPE_CHECKING:
    from medusa_heads.inference.plan import DecodePlan


@torch.no_grad()
def decode_batch(target: Target, plan: "DecodePlan", input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 max_new_tokens: int, eos: set[int], pad_token_id: int, stopping=None) -> tuple[torch.Tensor, DecodeStats]:
    """input_ids, attention_mask: (B, L), left-padded. Returns ((B, L + longest) tokens, stats)."""
    stats, clock = DecodeStats(), time.perf_counter
    b_size, prompt_len = input_ids.shape
    if not bool(attention_mask[:, -1].all()):
        raise ValueError("batched prompts must be left-padded: the last position of every row must be a real token")
    # written in place, not grown by torch.cat at every forward (which copies every row's keys and values each step);
    # a row's entries end by prompt_len + max_new_tokens, and past the guess (a larger tree) a layer doubles
    cache = new_cache(target.model, prompt_len + max_new_tokens + plan.max_size)

    sequences = torch.full((b_size, prompt_len + max_new_tokens), pad_token_id, dtype=torch.long, device=input_ids.device)
    sequences[:, :prompt_len] = input_ids
    t0 = clock()
    out = target.prefill_batch(input_ids, attention_mask, cache)
    states, emitted = [], 0
    for b in range(b_size):
        logits = out.logits[b, -1:]
        if plan.processors:
            logits = plan.processors(input_ids[b : b + 1], logits.float())
        state = DecodeState(sequences[b], prompt_len, prompt_len, out.hidden[b, -1])
        emitted += len(emit(state, [plan.rule.first(logits)], max_new_tokens, eos, stopping))
        states.append(state)
    stats.tokens_per_step.append(emitted)
    stats.rows_per_step.append(b_size)
    stats.seconds["prefill"] += clock() - t0

    run(_Batch(target, cache, states, attention_mask.bool(), max_new_tokens), plan, max_new_tokens, eos, stats, stopping)
    longest = max(s.new_tokens for s in states)
    return sequences[:, : prompt_len + longest].clone(), stats


class _Batch:
    """The rows of a batch for the decode loop (inference/decode.run): see the module's docstring."""

    def __init__(self, target: Target, cache, states: list[DecodeState], prompt_valid: torch.Tensor,
                 max_new_tokens: int) -> None:
        self.target, self.cache, self.states = target, cache, states
        self.prompt_valid = prompt_valid  # (B, L): the prompt's cache slots that hold each row's own tokens
        device, prompt_len = prompt_valid.device, prompt_valid.shape[1]
        self.ends = torch.full((len(states),), prompt_len, device=device)  # (B,): where each row's entries end
        self.slots = torch.arange(prompt_len, prompt_len + max_new_tokens, device=device)
        self.root_alone = Draft(states[0].sequence.new_zeros(0), from_parents((-1,), device))  # a finished row's tree
        self.past = prompt_len

    def verify(self, running, drafts, greedy):
        every = [self.root_alone] * len(self.states)  # finished rows ride along with their root alone
        for b, d in zip(running, drafts):
            every[b] = d
        trees, masks, depths = pad_trees(every, [s.sequence[s.length - 1] for s in self.states])
        self.past = int(self.ends.max())  # the cache's length
        prompt_len = self.prompt_valid.shape[1]
        valid = torch.cat([self.prompt_valid, self.slots[None, : self.past - prompt_len] < self.ends[:, None]], dim=1)
        positions = valid.long().sum(1)  # (B,): each row's root position = its real tokens so far
        out = self.target.verify_batch(trees, positions, valid, self.cache, masks, depths, greedy=greedy)
        return [(trees[b, : d.buffers.size], out.row(b, d.buffers.size)) for b, d in zip(running, drafts)]

    def commit(self, running, keeps):
        """Each row's accepted entries move to its own end."""
        every = [self.root_alone.tokens] * len(self.states)  # finished rows keep nothing
        for b, k in zip(running, keeps):
            every[b] = k
        keep = torch.zeros(len(every), max(k.shape[0] for k in every), dtype=torch.long, device=self.ends.device)
        for b, k in enumerate(every):
            if k.shape[0]:
                keep[b, : k.shape[0]], keep[b, k.shape[0] :] = k, k[-1]
        counts = torch.tensor([k.shape[0] for k in every], device=self.ends.device)
        keep_accepted_rows(self.cache, self.past, keep, counts, self.ends)
        self.ends += counts


def pad_trees(drafts: list[Draft], roots: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's tree (root + drafted nodes), padded to the largest: (B, T) tokens, (B, T, T) ancestor masks and
    (B, T) depths. A padding node repeats the root one level below it (a child of the root, seeing only the root
    and itself): its entries are never accepted, so they are dropped with the rest of the tree."""
    size = max(d.buffers.size for d in drafts)
    device = drafts[0].buffers.mask.device
    tokens = repeat(torch.stack(roots), "b -> b t", t=size).clone()
    padded = []
    for row, (drafted, buffers) in enumerate(drafts):
        tokens[row, 1 : buffers.size] = drafted
        padded.append(buffers if buffers.size == size else
                      from_parents((*buffers.parent.tolist(), *[0] * (size - buffers.size)), device))
    return tokens, torch.stack([b.mask for b in padded]), torch.stack([b.depth for b in padded])
