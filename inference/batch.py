"""Batched decoding: B left-padded prompts; every row accepts its own path at every step and ends on its own.

All rows write their trees at the same cache slots, after the longest row; then each row's accepted entries move
to its own end (keep_accepted_rows), so the cache is as long as the longest row, and what lies past a row's end
is hidden by its attention mask, as its left padding is. Positions count each row's real tokens only, so every
row computes exactly what it would alone. Finished rows are padded with pad_token_id, as transformers does; they ride
along in the verify with their root alone and are not drafted. With the per-step tree (inference/adaptive.py) the
drafter chooses one tree size for the running rows from the batch's measured verify cost."""
from __future__ import annotations

import time

import torch
from einops import repeat

from medusa_heads.tree.buffers import TreeBuffers, from_parents
from medusa_heads.inference.cache import PreallocatedLayer, keep_accepted_rows, new_cache
from medusa_heads.inference.decode import AcceptRule, DecodeState, DecodeStats, accept_tree, emit
from medusa_heads.inference.propose import Draft, Drafter
from medusa_heads.inference.verify import Target


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
    # written in place, not grown by torch.cat at every forward (which copies every row's keys and values each step);
    # a row's entries end by prompt_len + max_new_tokens, and past the guess (a larger tree) a layer doubles
    cache = new_cache(target.model, prompt_len + max_new_tokens + buffers.size)
    odd = sorted({type(layer).__name__ for layer in cache.layers if not isinstance(layer, PreallocatedLayer)})
    if odd:
        raise NotImplementedError(f"batched generation needs full-attention cache layers; this model has {', '.join(odd)}")

    width = prompt_len + max_new_tokens
    sequences = torch.full((b_size, width), pad_token_id, dtype=torch.long, device=device)
    sequences[:, :prompt_len] = input_ids
    prompt_valid = attention_mask.bool()  # (B, L): the prompt's cache slots that hold each row's own tokens
    ends = torch.full((b_size,), prompt_len, device=device)  # (B,): where each row's entries end in the cache
    slots = torch.arange(prompt_len, prompt_len + max_new_tokens, device=device)

    t0 = clock()
    out = target.prefill_batch(input_ids, attention_mask, cache)
    states, emitted = [], 0
    for b in range(b_size):
        logits = out.logits[b, -1:]
        if processors:
            logits = processors(input_ids[b : b + 1], logits.float())
        state = DecodeState(sequences[b], prompt_len, prompt_len, out.hidden[b, -1])
        emitted += len(emit(state, [rule.first(logits)], max_new_tokens, eos, stopping))
        states.append(state)
    stats.tokens_per_step.append(emitted)
    stats.rows_per_step.append(b_size)
    stats.seconds["prefill"] += clock() - t0

    greedy = rule.greedy and not processors  # only the target's argmax at each node is needed
    root_alone = Draft(sequences.new_zeros(0), from_parents((-1,), device))  # a finished row's tree
    while not all(s.done for s in states):
        # 1. propose: every running row's tree (finished rows ride along with their root alone, dropped below)
        t0 = clock()
        running = [b for b, s in enumerate(states) if not s.done]
        drafts = [root_alone] * b_size
        for b, d in zip(running, drafter.draft(torch.stack([states[b].hidden for b in running]),
                                               [states[b].sequence[: states[b].length] for b in running], buffers)):
            drafts[b] = d
        trees, masks, depths = pad_trees(drafts, [s.sequence[s.length - 1] for s in states])  # (B, T), (B, T, T), (B, T)
        # 2. verify: one forward over every row's tree, each at its own position
        t1 = clock()
        past = int(ends.max())  # the cache's length
        valid = torch.cat([prompt_valid, slots[None, : past - prompt_len] < ends[:, None]], dim=1)  # (B, past)
        positions = valid.long().sum(1)  # (B,): each row's root position = its real tokens so far
        out = target.verify_batch(trees, positions, valid, cache, masks, depths, greedy=greedy)
        # 3. accept, row by row
        t2 = clock()
        keeps, emitted, active = [], 0, 0
        for b, (s, (_, step)) in enumerate(zip(states, drafts)):
            if s.done:
                keeps.append(trees.new_zeros(0))
                continue
            tree = trees[b, : step.size]
            nodes, bonus = accept_tree(rule, tree, step, out.row(b, step.size), processors, s.sequence[: s.length - 1])
            chunk = emit(s, tree[nodes[1:]].tolist() + [bonus], max_new_tokens, eos, stopping)
            nodes = nodes[: len(chunk) + 1]
            keeps.append(nodes)
            s.hidden = out.hidden[b, nodes[-1]]
            emitted, active = emitted + len(chunk), active + 1
            stats.tree_sizes.append(step.size - 1)
        drafter.update([keeps[b] for b in running])
        # 4. commit: each row's accepted entries move to its own end
        t3 = clock()
        m = max(k.shape[0] for k in keeps)
        keep = torch.zeros(b_size, m, dtype=torch.long, device=device)
        for b, k in enumerate(keeps):
            if k.shape[0]:
                keep[b, : k.shape[0]], keep[b, k.shape[0] :] = k, k[-1]
        counts = torch.tensor([k.shape[0] for k in keeps], device=device)
        keep_accepted_rows(cache, past, keep, counts, ends)
        ends += counts
        stats.tokens_per_step.append(emitted)
        stats.rows_per_step.append(active)
        t4 = clock()
        for key, dt in zip(("propose", "verify", "accept", "commit"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            stats.seconds[key] += dt

    longest = max(s.new_tokens for s in states)
    return sequences[:, : prompt_len + longest].clone(), stats


def pad_trees(drafts: list[Draft], roots: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's tree (root + drafted nodes), padded to the largest: (B, T) tokens, (B, T, T) ancestor masks and
    (B, T) depths. A padding node repeats the root one level below it and sees only the root and itself: its
    entries are never accepted, so they are dropped with the rest of the tree."""
    size = max(d.buffers.size for d in drafts)
    b = len(drafts)
    device = drafts[0].buffers.mask.device
    tokens = repeat(torch.stack(roots), "b -> b t", t=size).clone()
    masks = repeat(torch.eye(size, dtype=torch.bool, device=device), "t s -> b t s", b=b).clone()
    masks[:, :, 0] = True
    depths = torch.ones(b, size, dtype=torch.long, device=device)
    depths[:, 0] = 0
    for row, (drafted, buffers) in enumerate(drafts):
        n = buffers.size
        tokens[row, 1:n] = drafted
        masks[row, :n, :n] = buffers.mask
        depths[row, :n] = buffers.depth
    return tokens, masks, depths
