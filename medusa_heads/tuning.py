"""Calibration: measure the heads' path accuracies and the target's verify latency, choose the fastest tree."""
from __future__ import annotations

import time

import torch
from tqdm import tqdm

from .inference.cache import crop_to, new_cache
from .tree.buffers import build_buffers
from .tree.calibrate import best_tree, tree_value
from .tree.spec import TreeSpec


@torch.no_grad()
def correct_ranks(heads, segments, topk: int = 10, chunk: int = 2048) -> list[tuple[int, ...]]:
    """For every answer position i, the rank of tokens[i + k] among head k's top-k at hidden[i] (-1 if absent).
    Conditioned heads see the true tokens[i .. i + k - 1]: on the path that is right, these are the very tokens
    they are given when drafting, so the ranks are exact for every path that matters.
    Positions whose continuation is shorter than the heads are left out."""
    from .training.trainer import segment_context

    k_heads = heads.config.num_heads
    out: list[tuple[int, ...]] = []
    dtype = heads.shared_weight.dtype if heads.lm_heads is None else heads.lm_heads[0].weight.dtype
    for s in segments:
        n = s.tokens.shape[0] - k_heads
        if n <= 0:
            continue
        for a in range(0, n, chunk):
            h = s.hidden[a : min(a + chunk, n)].to(dtype)
            context = segment_context(s.tokens, heads.config.context_size)[a : a + h.shape[0]]
            top = heads.topk(h, topk, context)  # (K, m, topk)
            idx = torch.arange(a, a + h.shape[0])
            truth = torch.stack([s.tokens[idx + k + 1] for k in range(k_heads)])  # (K, m)
            hit = top == truth[..., None]
            rank = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(truth, -1))  # (K, m)
            out += [tuple(r) for r in rank.T.tolist()]
    return out


@torch.no_grad()
def verify_latency(target, sizes: list[int], context: int = 300, repeats: int = 3) -> dict[int, float]:
    """Median seconds of one target forward over n new tokens after `context` cached tokens, for each n."""
    model = target.model
    device = model.device
    vocab = target.lm_head.weight.shape[0]
    g = torch.Generator().manual_seed(0)
    cache = new_cache(model)
    target.prefill(torch.randint(0, vocab, (1, context), generator=g).to(device), cache)
    chains = {n: build_buffers(TreeSpec.from_paths([[0] * d for d in range(1, n)])).to(device) for n in sizes if n > 1}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for rep in tqdm(range(repeats + 1), desc="latency", leave=False):
        order = sizes if rep % 2 == 0 else sizes[::-1]  # alternate, so drift hits all sizes alike
        for n in order:
            tokens = torch.randint(0, vocab, (n,), generator=g).to(device)
            t0 = time.perf_counter()
            if n == 1:  # a plain decoding step, as generate takes it
                target._run(input_ids=tokens[None], cache=cache, position_ids=torch.tensor([[context]], device=device))
            else:
                target.verify(tokens, context, cache, chains[n])
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            crop_to(cache, context)
            if rep > 0:  # the first round warms up
                times[n].append(dt)
    return {n: sorted(v)[len(v) // 2] for n, v in times.items()}


@torch.no_grad()
def draft_latency(heads, spec: TreeSpec, repeats: int = 20) -> float:
    """Seconds the heads take to draft `spec` (path-conditioned heads draft level by level, so it depends on it)."""
    from .inference.propose import HeadsDrafter

    param = next(heads.parameters())
    buffers = build_buffers(spec).to(param.device)
    drafter = HeadsDrafter(heads)
    h = torch.randn(heads.config.hidden_size, dtype=param.dtype, device=param.device)
    seq = torch.zeros(8, dtype=torch.long, device=param.device)
    drafter.draft(h, seq, buffers)
    t0 = time.perf_counter()
    for _ in range(repeats):
        drafter.draft(h, seq, buffers)
    return (time.perf_counter() - t0) / repeats


def choose_tree(path_prob, latency: dict[int, float], t_heads, t_overhead: float, max_nodes: int) -> dict:
    """For each size N, the optimal tree (best_tree) and its predicted tokens/s; returns the best and the table.
    t_heads: the heads' drafting seconds, a number or a function of the tree."""
    table = []
    for n in range(1, max_nodes + 1):
        if n + 1 not in latency:
            continue
        spec = best_tree(path_prob, n) if path_prob else None
        if spec is None or spec.num_nodes < n:
            break
        tau = 1.0 + tree_value(spec, path_prob)
        draft = t_heads(spec) if callable(t_heads) else t_heads
        step = latency[n + 1] + draft + t_overhead
        table.append({"nodes": n, "tau": tau, "step_s": step, "draft_s": draft, "tokens_per_s": tau / step, "paths": spec.to_list()})
    best = max(table, key=lambda r: r["tokens_per_s"])
    plain = 1.0 / latency[1]
    for row in table:
        row["speedup"] = row["tokens_per_s"] / plain
    return {"best": best, "table": table, "plain_tokens_per_s": plain}
