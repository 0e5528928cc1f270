"""Calibration: measure the heads' path accuracies and the target's verify latency, choose the fastest tree; and
measure what the per-step tree runs on (tree/adaptive.py): calibrated acceptance, prompt lookup's acceptance, cost."""
from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, fields

import torch
from tqdm import tqdm

from medusa_heads.engines.hf_cache import crop_to, new_cache
from medusa_heads.inference.propose import MAX_NGRAM
from medusa_heads.tree.adaptive import Acceptance, CostModel, LookupAcceptance, PhraseAcceptance, best_size, isotonic
from medusa_heads.tree.buffers import build_buffers, chain
from medusa_heads.tree.ngrams import NgramStore
from medusa_heads.tree.calibrate import best_tree, tree_value
from medusa_heads.tree.spec import TreeSpec


@torch.no_grad()
def correct_ranks(heads, segments, topk: int = 10, chunk: int = 2048) -> list[tuple[int, ...]]:
    """For every answer position i, the rank of tokens[i + k] among head k's top-k at hidden[i] (-1 if absent).
    Conditioned heads see the true tokens[i .. i + k - 1]: on the path that is right, these are the very tokens
    they are given when drafting, so the ranks are exact for every path that matters.
    Positions whose continuation is shorter than the heads are left out."""
    from medusa_heads.shards import segment_context

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
    """Median seconds of one target forward over n new tokens after `context` cached tokens, for each n, into the
    preallocated cache that decoding writes to (a growing cache would add a copy of every layer's keys and values
    to each forward: ~3 ms at 2K cached tokens for SmolLM2 on a CPU, which decoding never pays)."""
    keys = [(n, "step" if n == 1 else "full") for n in sizes]  # n = 1: a plain decoding step, as generate takes it
    return {n: t for (n, _), t in _verify_seconds(target, keys, context, repeats, "latency").items()}


def greedy_savings(target, sizes: list[int], text: torch.Tensor, repeats: int = 3) -> dict[int, float]:
    """For each n: the median seconds of the full verify of a chain of n tokens less those of the greedy verify of it
    (argmaxes through the screen, medusa_heads/kernels/screen.py), the two timed one after the other in one run, a root alone
    (n = 1) as a per-step tree with no drafted node verifies it. text: (context + max(sizes),) the target's own text
    (answer_text): the cached context, then the chain verified. The screen's work depends on how sure the target is
    (random tokens leave it unsure: many candidates to rescore), so it runs on text the target wrote. Paired, since
    a shared host's speed drifts by 10-20% between runs: a table timed apart from the full one would mostly
    measure that."""
    keys = [(n, mode) for n in sizes for mode in ("full", "greedy")]
    t = _verify_seconds(target, keys, text.shape[0] - max(sizes), repeats, "full - greedy", text=text)
    return {n: t[n, "full"] - t[n, "greedy"] for n in sizes}


def answer_text(answers: list[tuple[torch.Tensor, list[tuple[int, int]]]], context: int, length: int) -> torch.Tensor:
    """(context + length,) token ids of conversations end to end (tokenized_answers) whose last `length` start in an
    answer (up to 8 tokens into it), after `context` tokens: text the target wrote, where the verify's chain goes on."""
    ids = torch.cat([c for c, _ in answers]) if answers else torch.zeros(0, dtype=torch.long)
    offset = 0
    for conv, spans in answers:
        for a, b in spans:
            start = offset + a + min(8, (b - a) // 2)
            if start >= context and start + length <= ids.shape[0]:
                return ids[start - context : start + length]
        offset += conv.shape[0]
    raise ValueError(f"the {len(answers)} conversations given hold {ids.shape[0]} tokens: too few for an answer after "
                     f"{context} tokens of text with {length} tokens from there")


def _verify_seconds(target, keys: list[tuple[int, str]], context: int, repeats: int, desc: str,
                    text: torch.Tensor | None = None) -> dict:
    """verify_latency's timings for (n, mode) keys: mode "step" (target.step, n = 1), "full" (target.verify) or
    "greedy" (target.verify(greedy=True)); on random tokens, or on `text` (the context, then each chain's tokens)."""
    model = target.model
    device = model.device
    vocab = target.lm_head.weight.shape[0]
    g = torch.Generator().manual_seed(0)
    sizes = sorted({n for n, _ in keys})
    cache = new_cache(model, context + max(sizes))
    prefix = text[:context] if text is not None else torch.randint(0, vocab, (context,), generator=g)
    target.prefill(prefix[None].to(device), cache)
    chains = {n: chain(n, device) for n in sizes}

    def forward(key: tuple[int, str]):
        n, mode = key
        if text is not None:
            tokens = text[context : context + n].to(device)
        else:
            tokens = torch.randint(0, vocab, (n,), generator=g).to(device)
        if mode == "step":
            return lambda: target.step(tokens, context, cache)
        return lambda: target.verify(tokens, context, cache, chains[n], greedy=mode == "greedy")

    return _median_seconds(forward, lambda: crop_to(cache, context), keys, repeats, device, desc)


BATCH_ROWS = (2, 4, 8)  # batch sizes whose verify the cost model measures ("batch")
BATCH_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)  # tree tokens per row measured for a batch (its trees stay small)
BATCH_CONTEXTS = (256, 1024)


@torch.no_grad()
def batch_verify_latency(target, rows: int, sizes: list[int], context: int = 256, repeats: int = 3) -> dict[int, float]:
    """Median seconds of one batched verify (inference/batch.py) over `rows` rows' chains of n tokens each after
    `context` cached tokens per row, for each n, into the preallocated cache that batched decoding writes to."""
    model = target.model
    device = model.device
    vocab = target.lm_head.weight.shape[0]
    g = torch.Generator().manual_seed(0)
    cache = new_cache(model, context + max(sizes))
    ids = torch.randint(0, vocab, (rows, context), generator=g).to(device)
    target.prefill_batch(ids, torch.ones_like(ids), cache)
    valid = torch.ones(rows, context, dtype=torch.bool, device=device)
    positions = torch.full((rows,), context, device=device)

    def forward(n: int):
        tokens = torch.randint(0, vocab, (rows, n), generator=g).to(device)
        tree = chain(n, device)
        return lambda: target.verify_batch(tokens, positions, valid, cache, tree.mask.expand(rows, n, n),
                                           tree.depth.expand(rows, n))

    return _median_seconds(forward, lambda: crop_to(cache, context), sizes, repeats, device, f"latency, {rows} rows")


def _median_seconds(forward, reset, sizes: list[int], repeats: int, device: torch.device, desc: str) -> dict[int, float]:
    """For each n in sizes: forward(n) prepares the inputs of one forward and returns it; the median of its timed
    runs over `repeats` rounds after one round of warm-up, sizes alternating in order (so drift hits them alike),
    reset() after each run (the cache cropped back)."""
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for rep in tqdm(range(repeats + 1), desc=desc, leave=False):
        for n in sizes if rep % 2 == 0 else sizes[::-1]:
            run = forward(n)
            t0 = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            reset()
            if rep > 0:  # the first round warms up
                times[n].append(dt)
    return {n: sorted(v)[len(v) // 2] for n, v in times.items()}


def measure_batch_cost(target, cost: CostModel, rows: tuple[int, ...] = BATCH_ROWS, sizes: tuple[int, ...] = BATCH_SIZES,
                       contexts: tuple[int, ...] = BATCH_CONTEXTS, repeats: int = 5) -> CostModel:
    """`cost` (one row, these kernels) with a batch's verify measured for each of `rows` (batch_verify_latency);
    drafting and overhead as `cost` has them (a row drafts as it does alone)."""
    batches = {}
    for b in tqdm(rows, desc="batches", leave=False):
        ms = []
        for c in contexts:
            latency = batch_verify_latency(target, b, list(sizes), context=c, repeats=repeats)
            ms.append(tuple(round(1000 * latency[n], 2) for n in sizes))
        batches[b] = CostModel(tuple(contexts), tuple(sizes), tuple(ms), draft_ms=cost.draft_ms,
                               overhead_ms=cost.overhead_ms, fit="steps")
    return cost.with_batches(batches)


def measure_greedy_cost(target, cost: CostModel, answers: list[tuple[torch.Tensor, list[tuple[int, int]]]],
                        repeats: int = 5) -> CostModel:
    """`cost` (one row, these kernels) with the greedy verify's table: its own less, at each context, the median
    over sizes of greedy_savings on the target's answers (tokenized_answers). One saving a context: the screen
    replaces the LM head's product by a cheaper one, about the same milliseconds at every size, while the
    per-size differences scatter by a few ms on a noisy host (and the selection reads each size as measured)."""
    ms = []
    for c, row in zip(tqdm(cost.contexts, desc="greedy contexts", leave=False), cost.ms):
        saved = sorted(greedy_savings(target, list(cost.sizes), answer_text(answers, c, cost.max_size), repeats).values())
        cut = max(1000 * saved[len(saved) // 2], 0.0)  # never dearer: the same decoder, a cheaper head (noise aside)
        ms.append(tuple(round(max(t - cut, 0.5 * t), 2) for t in row))
    return cost.with_greedy(CostModel(cost.contexts, cost.sizes, tuple(ms), fit=cost.fit))


@torch.no_grad()
def draft_latency(heads, spec: TreeSpec, repeats: int = 20) -> float:
    """Seconds the heads take to draft `spec` (path-conditioned heads draft level by level, so it depends on it)."""
    from medusa_heads.inference.propose import HeadsDrafter

    param = next(heads.parameters())
    buffers = build_buffers(spec).to(param.device)
    drafter = HeadsDrafter(heads)
    h = torch.randn(heads.config.hidden_size, dtype=param.dtype, device=param.device)
    seq = torch.zeros(8, dtype=torch.long, device=param.device)
    drafter.draft_tokens(h[None], seq[-1:], buffers)
    t0 = time.perf_counter()
    for _ in range(repeats):
        drafter.draft_tokens(h[None], seq[-1:], buffers)
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
    tau = torch.tensor([r["tau"] for r in table])
    best = table[best_size(tau, torch.tensor([1000.0 * r["step_s"] for r in table]))]  # a fixed tree drafts >= 1 node
    plain = 1.0 / latency[1]
    for row in table:
        row["speedup"] = row["tokens_per_s"] / plain
    return {"best": best, "table": table, "plain_tokens_per_s": plain}


# --- The per-step tree's measurements (tree/adaptive.py): acceptance, prompt lookup, cost --------------------------

ACCEPT_EDGES = (0.0, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
TEMPERATURES = tuple(float(t) for t in torch.logspace(-0.4, 0.6, 33, base=10.0))  # 0.40 .. 3.98, 7.5% apart
COST_SIZES = tuple(range(1, 33))  # every size: a kernel's cost need not grow with the rows (CostModel, "measured")
COST_CONTEXTS = (256, 1024, 4096)
PARTS = ("tree", "acceptance", "lookup", "cost", "batch", "greedy", "ngrams")  # what `medusa-heads calibrate --parts` measures
NGRAM_TOKENS = 8  # phrasebook continuation length measured (and drafted: its acceptance's depth)
MIN_TRIALS = 100  # the fewest trials a matched length's rates are fitted on at a depth (else all lengths' rates)


@dataclass
class CandidateSamples:
    """Head d's top-k candidates at the held-out positions where its parent could be accepted, for one depth."""

    probs: torch.Tensor  # (M, k) softmax over the draft vocabulary
    hits: torch.Tensor  # (M, k) bool: the candidate is the true token at that depth
    logits: torch.Tensor  # (M, k) the candidates' logits
    lse: torch.Tensor  # (M, G) logsumexp(logits / T) over the draft vocabulary, for each T in TEMPERATURES
    half: torch.Tensor  # (M,) bool: the position's conversation falls in the second half (the test half)

    def select(self, rows: torch.Tensor) -> "CandidateSamples":
        return CandidateSamples(*(getattr(self, f.name)[rows] for f in fields(self)))

    def temperature_probs(self, t: int) -> torch.Tensor:
        """(M, k) the candidates' probabilities at TEMPERATURES[t]."""
        return (self.logits / TEMPERATURES[t] - self.lse[:, t : t + 1]).exp()


def second_half(conv_id: str) -> bool:
    """Splits held-out conversations in two by prompt (every answer to a prompt falls on the same side)."""
    from medusa_heads.corpus import prompt_id

    return zlib.crc32(f"{prompt_id(conv_id)}#half".encode()) % 2 == 1


@torch.no_grad()
def candidate_samples(heads, segments, topk: int = 8, chunk: int = 1024) -> list[CandidateSamples]:
    """For each depth d = 1..K: head d's top-k at every answer position, path-conditioned heads given the true path
    above (what they are given on the path that is right), labelled by the true token at depth d. A position counts
    at depth d only where the true tokens at depths 1..d-1 are each in their head's top-k: there the parent is in
    the tree and accepted, so the labels are acceptance given an accepted parent."""
    from medusa_heads.shards import segment_context

    k_heads = heads.config.num_heads
    param = next(heads.parameters())
    temps = torch.tensor(TEMPERATURES)
    out: list[dict[str, list[torch.Tensor]]] = [{f.name: [] for f in fields(CandidateSamples)} for _ in range(k_heads)]
    for s in segments:
        n = s.tokens.shape[0] - k_heads
        for a in range(0, max(n, 0), chunk):
            h = s.hidden[a : min(a + chunk, n)].to(param.device, param.dtype)
            m = h.shape[0]
            context = segment_context(s.tokens, heads.config.context_size)[a : a + m].to(param.device)
            idx = torch.arange(a, a + m)
            parent_in_tree = torch.ones(m, dtype=torch.bool)
            for k in range(k_heads):
                logits = heads.head_logits(k, h, context).float().cpu()  # (m, V')
                top = logits.topk(topk, dim=-1)
                ids = top.indices if heads.draft_vocab is None else heads.draft_vocab.cpu()[top.indices]
                hits = ids == s.tokens[idx + k + 1][:, None]  # (m, topk)
                lse = torch.stack([torch.logsumexp(logits / t, dim=-1) for t in temps], dim=-1)  # (m, G)
                rows = parent_in_tree.nonzero()[:, 0]
                d = out[k]
                d["probs"].append((top.values - torch.logsumexp(logits, -1, keepdim=True)).exp()[rows])
                d["hits"].append(hits[rows])
                d["logits"].append(top.values[rows])
                d["lse"].append(lse[rows])
                d["half"].append(torch.full((len(rows),), second_half(s.conv_id)))
                parent_in_tree &= hits.any(-1)
    if not out[0]["hits"]:
        raise ValueError(f"no held-out answer has more than {k_heads} tokens: nothing to calibrate acceptance on")
    return [CandidateSamples(**{key: torch.cat(v) for key, v in d.items()}) for d in out]


def bin_rates(probs: torch.Tensor, hits: torch.Tensor, edges: tuple[float, ...] = ACCEPT_EDGES) -> tuple[list[float], list[int]]:
    """Observed acceptance and count in each bin of the probability (bins as Acceptance reads them)."""
    b = torch.bucketize(probs.flatten().double(), torch.tensor(edges[1:-1], dtype=torch.float64), right=True)
    count = torch.bincount(b, minlength=len(edges) - 1)
    hit = torch.bincount(b, weights=hits.flatten().double(), minlength=len(edges) - 1)
    return [float(h / c) if c else 0.0 for h, c in zip(hit, count)], count.tolist()


def fit_isotonic(probs: torch.Tensor, hits: torch.Tensor, edges: tuple[float, ...] = ACCEPT_EDGES) -> list[float]:
    """Per-bin acceptance, non-decreasing in the head's probability: pool adjacent violators over the bins'
    observed rates weighted by their counts; an empty bin takes the rate of the bin below it (leading ones, above)."""
    rates, counts = bin_rates(probs, hits, edges)
    full = [i for i, c in enumerate(counts) if c]
    if not full:
        raise ValueError("no candidates to fit acceptance on")
    fit = dict(zip(full, isotonic([rates[i] for i in full], [float(counts[i]) for i in full])))
    out, last = [], fit[full[0]]
    for i in range(len(counts)):
        last = fit.get(i, last)
        out.append(round(min(max(last, 0.0), 1.0), 4))
    return out


def log_loss(pred: torch.Tensor, hits: torch.Tensor, eps: float = 1e-4) -> float:
    p = pred.double().clamp(eps, 1 - eps)
    return float(-(hits * p.log() + (~hits) * (1 - p).log()).mean())


def brier(pred: torch.Tensor, hits: torch.Tensor) -> float:
    return float(((pred.double() - hits.double()) ** 2).mean())


def fit_temperature(s: CandidateSamples) -> int:
    """Index into TEMPERATURES of the temperature whose candidate probabilities have the least log-loss."""
    return min(range(len(TEMPERATURES)), key=lambda t: log_loss(s.temperature_probs(t), s.hits))


def calibrate_acceptance(samples: list[CandidateSamples], edges: tuple[float, ...] = ACCEPT_EDGES,
                         tolerance: float = 0.01) -> tuple[Acceptance, dict]:
    """Isotonic bins and a temperature per depth, each fitted on the first half of the conversations and scored on
    the second (log-loss, Brier, mean predicted vs observed); the winner is refitted on both halves. Isotonic is
    kept unless the temperature's log-loss is lower by more than `tolerance` (relative); the stored format holds
    bins only, so a winning temperature is stored as bins of its own predictions (a check, not expected)."""
    rows, totals = [], {m: [0.0, 0.0] for m in ("raw", "isotonic", "temperature")}
    for d, s in enumerate(samples, start=1):
        fit, test = s.select(~s.half), s.select(s.half)
        if not len(fit.hits) or not len(test.hits):
            raise ValueError(f"depth {d}: no held-out candidates in one half of the conversations "
                             f"({len(fit.hits)} and {len(test.hits)} positions); more held-out features are needed")
        rates = torch.tensor(fit_isotonic(fit.probs, fit.hits, edges))
        t = fit_temperature(fit)
        preds = {"raw": test.probs, "isotonic": Acceptance(edges, (tuple(rates.tolist()),))(1, test.probs),
                 "temperature": test.temperature_probs(t)}
        row = {"depth": d, "fit_positions": len(fit.hits), "test_positions": len(test.hits), "topk": s.hits.shape[1],
               "observed": float(test.hits.double().mean()), "observed_top1": float(test.hits[:, 0].double().mean()),
               "T": TEMPERATURES[t], "isotonic_fit": rates.tolist()}
        for name, p in preds.items():
            row[name] = {"mean": float(p.double().mean()), "mean_top1": float(p[:, 0].double().mean()),
                         "log_loss": log_loss(p, test.hits), "brier": brier(p, test.hits),
                         "reliability": _reliability(p, test.hits, edges)}
            totals[name][0] += row[name]["log_loss"] * test.hits.numel()
            totals[name][1] += row[name]["brier"] * test.hits.numel()
        rows.append(row)
    n = sum(r["test_positions"] * r["topk"] for r in rows)
    summary = {m: {"log_loss": v[0] / n, "brier": v[1] / n} for m, v in totals.items()}
    iso, temp = summary["isotonic"]["log_loss"], summary["temperature"]["log_loss"]
    method = "temperature" if temp < iso * (1 - tolerance) else "isotonic"
    final = []
    for s, row in zip(samples, rows):
        if method == "isotonic":
            final.append(tuple(fit_isotonic(s.probs, s.hits, edges)))
        else:  # bins of the raw probability whose rates are the temperature's mean prediction in the bin
            pred = s.temperature_probs(fit_temperature(s))
            b = torch.bucketize(s.probs.flatten().double(), torch.tensor(edges[1:-1], dtype=torch.float64), right=True)
            mean = torch.bincount(b, weights=pred.flatten().double(), minlength=len(edges) - 1)
            count = torch.bincount(b, minlength=len(edges) - 1).clamp_min(1)
            final.append(tuple(round(x, 4) for x in torch.cummax(mean / count, 0).values.clamp(0, 1).tolist()))
    report = {"method": method, "edges": list(edges), "depths": rows, "summary": summary,
              "held_out_positions": [len(s.hits) for s in samples]}
    return Acceptance(tuple(edges), tuple(final)), report


def _reliability(pred: torch.Tensor, hits: torch.Tensor, edges: tuple[float, ...]) -> list[list[float]]:
    """[mean prediction, observed rate, count] for each non-empty bin of the prediction."""
    b = torch.bucketize(pred.flatten().double(), torch.tensor(edges[1:-1], dtype=torch.float64), right=True)
    count = torch.bincount(b, minlength=len(edges) - 1)
    mean = torch.bincount(b, weights=pred.flatten().double(), minlength=len(edges) - 1)
    hit = torch.bincount(b, weights=hits.flatten().double(), minlength=len(edges) - 1)
    return [[float(m / c), float(h / c), int(c)] for m, h, c in zip(mean, hit, count) if c]


def answer_spans(ids: torch.Tensor, mask: torch.Tensor, eos: int | None) -> list[tuple[int, int]]:
    """[start, end) of each assistant answer in a tokenized conversation, cut after its first `eos`."""
    from medusa_heads.prompting import mask_runs

    spans = []
    for start, end in mask_runs(mask):
        stop = (ids[start:end] == eos).nonzero() if eos is not None else []
        spans.append((start, start + int(stop[0]) + 1 if len(stop) else end))
    return spans


def tokenized_answers(tokenizer, conversations: list[dict], max_length: int = 1 << 16) -> list[tuple[torch.Tensor, list[tuple[int, int]]]]:
    """Chat-template token ids of each conversation and its answers' spans; an answer that was cut off (not
    "finished") loses the end-of-turn token the template adds, which the model never wrote."""
    from medusa_heads.prompting import conversation_ids

    out = []
    for conv in conversations:
        ids, mask = conversation_ids(tokenizer, conv["messages"], max_length)
        finished = [m.get("finished", True) for m in conv["messages"] if m["role"] == "assistant"]
        spans = answer_spans(ids, mask, tokenizer.eos_token_id)
        cut = [int(not done and int(ids[b - 1]) == tokenizer.eos_token_id) for (_, b), done in zip(spans, finished)]
        out.append((ids, [(a, b - c) for (a, b), c in zip(spans, cut)]))
    return out


def lookup_acceptance(conversations: list[tuple[torch.Tensor, list[tuple[int, int]]]], lookup_tokens: int = 10,
                      max_ngram: int = MAX_NGRAM, min_ngram: int = 1, every_position: bool = False) -> tuple[LookupAcceptance, dict]:
    """conversations: (token ids (L,), answer spans). Walks each answer as decoding with prompt lookup alone would:
    at a root, lookup over the tokens up to it (inference.propose.lookup_match); the j-th continuation token is
    accepted if it and the ones before it equal the answer's next tokens; the next root follows the accepted ones
    (so roots fall where decoding steps start, often just after a miss). every_position: every answer token is a
    root (deep inside copied runs too, which decoding crosses in few steps). Rates per matched n-gram length and
    j, given j - 1 accepted."""
    from medusa_heads.inference.propose import lookup_match

    ngrams = list(range(min_ngram, max_ngram + 1))
    tried = torch.zeros(len(ngrams), lookup_tokens, dtype=torch.long)
    hit = torch.zeros_like(tried)
    roots = 0
    for ids, spans in conversations:
        for start, end in spans:
            p = start
            while p < end - 1:
                roots += 1
                cont, n = lookup_match(ids[: p + 1], lookup_tokens, max_ngram, min_ngram)
                truth, accepted = ids[p + 1 : end], 0
                for j in range(min(len(cont), len(truth)) if n else 0):
                    tried[n - min_ngram, j] += 1
                    if cont[j] != truth[j]:
                        break
                    hit[n - min_ngram, j] += 1
                    accepted += 1
                p += 1 if every_position else accepted + 1
    if not roots:
        raise ValueError("no answer tokens to measure prompt lookup on")
    rates = []
    for i in range(len(ngrams)):
        row, last = [], 0.0
        for j in range(lookup_tokens):
            last = round(int(hit[i, j]) / int(tried[i, j]), 4) if tried[i, j] else last  # unseen: the rate above
            row.append(last)
        rates.append(tuple(row))
    report = {"roots": roots, "matched": tried[:, 0].tolist(), "tried": tried.tolist(), "accepted": hit.tolist(),
              "max_tokens": lookup_tokens, "max_ngram": max_ngram, "min_ngram": min_ngram,
              "walk": "every position" if every_position else "decoding steps"}
    return LookupAcceptance(tuple(ngrams), tuple(rates)), report


def ngram_trials(store: NgramStore, answers: list[tuple[torch.Tensor, list[tuple[int, int]]]],
                 tokens: int = NGRAM_TOKENS) -> tuple[list[list[tuple[int, float, bool]]], int]:
    """answers: (token ids (L,), answer spans) the store did not learn. Every answer token is a root: the store's
    chain from the tokens up to it (NgramStore.chain); its j-th token is accepted if it and the ones before it equal
    the answer's next tokens. Returns, per depth j, (matched n-gram length, confidence, accepted) of each token
    tried there (j - 1 accepted), and the number of roots."""
    out: list[list[tuple[int, float, bool]]] = [[] for _ in range(tokens)]
    roots = 0
    for ids, spans in answers:
        seq = ids.tolist()
        for start, end in spans:
            for p in range(start, end - 1):  # each answer token is a root, as in decoding (prefill writes the first)
                roots += 1
                found, conf, orders = store.chain(seq[max(p + 1 - store.max_n, 0) : p + 1], tokens)
                for j, (token, c, n) in enumerate(zip(found, conf, orders)):
                    if p + 1 + j >= end:
                        break
                    out[j].append((n, c, token == seq[p + 1 + j]))
                    if not out[j][-1][2]:
                        break
    return out, roots


def _fit_depths(trials: list[list[tuple[int, float, bool]]], edges: tuple[float, ...],
                fallback: Acceptance | None = None) -> Acceptance:
    """Isotonic rates over the confidence bins per depth; a depth with fewer than MIN_TRIALS trials takes the
    fallback's rates there (else the depth above)."""
    rates = []
    for j, t in enumerate(trials):
        if len(t) >= MIN_TRIALS or (fallback is None and t):
            rates.append(tuple(fit_isotonic(torch.tensor([c for _, c, _ in t]), torch.tensor([a for _, _, a in t]), edges)))
        else:
            rates.append(fallback.rates[j] if fallback is not None else rates[-1])
    return Acceptance(tuple(edges), tuple(rates))


def ngram_acceptance(store: NgramStore, answers: list[tuple[torch.Tensor, list[tuple[int, int]]]],
                     test: list[tuple[torch.Tensor, list[tuple[int, int]]]] | None = None,
                     tokens: int = NGRAM_TOKENS, edges: tuple[float, ...] = ACCEPT_EDGES) -> tuple[PhraseAcceptance, dict]:
    """The store's acceptance per matched n-gram length and depth j (given j - 1 accepted), isotonic over its
    confidence bins, fitted on the chains of `answers` (ngram_trials); a length with too few trials at a depth reads
    all lengths' rates there. The report gives, per depth, what was tried and accepted, and predicted against
    observed acceptance on `test` (other held-out answers) where given, else on `answers` themselves."""
    trials, roots = ngram_trials(store, answers, tokens)
    if not trials[0]:
        raise ValueError("the n-gram store continues none of the held-out answers: nothing to measure")
    pooled = _fit_depths(trials, edges)
    orders = tuple(range(store.min_n, store.max_n + 1))
    tables = tuple(_fit_depths([[x for x in t if x[0] == n] for t in trials], edges, pooled) for n in orders)
    acceptance = PhraseAcceptance(orders, tables)
    t_trials, t_roots = ngram_trials(store, test, tokens) if test else (trials, roots)
    predicted = [sum(acceptance.rate(j + 1, n, c) for n, c, _ in t) / len(t) if t else 0.0 for j, t in enumerate(t_trials)]
    report = {"roots": roots, "entries": len(store), "min_n": store.min_n, "max_n": store.max_n,
              "tried": [len(t) for t in trials], "accepted": [sum(a for _, _, a in t) for t in trials],
              "first_by_order": {n: [sum(1 for m, _, _ in trials[0] if m == n), sum(a for m, _, a in trials[0] if m == n)]
                                 for n in orders},
              "test": {"answers": "other held-out answers" if test else "the same answers", "roots": t_roots,
                       "tried": [len(t) for t in t_trials],
                       "observed": [round(sum(a for _, _, a in t) / len(t), 4) if t else 0.0 for t in t_trials],
                       "predicted": [round(x, 4) for x in predicted]}}
    return acceptance, report


@torch.no_grad()
def level_draft_ms(heads, parents: int = 4, topk: int = 8, repeats: int = 30) -> float:
    """Milliseconds of one drafting level: head d's top-k for `parents` parent rows, averaged over the heads."""
    param = next(heads.parameters())
    g = torch.Generator().manual_seed(0)
    h = torch.randn(parents, heads.config.hidden_size, generator=g).to(param.device, param.dtype)
    width = heads.config.context_size
    ids = torch.arange(heads.config.draft_vocab_size) if heads.draft_vocab is None else heads.draft_vocab.cpu()
    context = ids[torch.randint(0, len(ids), (parents, width), generator=g)].to(param.device) if width else None
    times = []
    for d in range(heads.config.num_heads):
        heads.head_topk(d, h, topk, context)  # warm-up
        t0 = time.perf_counter()
        for _ in range(repeats):
            heads.head_topk(d, h, topk, context)
        if param.device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / repeats)
    return 1000 * sum(times) / len(times)


def measure_cost(target, heads, sizes: tuple[int, ...] = COST_SIZES, contexts: tuple[int, ...] = COST_CONTEXTS,
                 repeats: int = 5, topk: int = 8, overhead_ms: float = 3.0) -> CostModel:
    """The target's verify milliseconds for each tree size after each cached context length (verify_latency), and
    one drafting level (level_draft_ms)."""
    ms = []
    for c in tqdm(contexts, desc="contexts", leave=False):
        latency = verify_latency(target, list(sizes), context=c, repeats=repeats)
        ms.append(tuple(round(1000 * latency[n], 2) for n in sizes))
    draft = round(level_draft_ms(heads, topk=topk), 3)
    return CostModel(tuple(contexts), tuple(sizes), tuple(ms), draft_ms=draft, overhead_ms=overhead_ms, fit="measured")


@torch.no_grad()
def engine_latency(engine, sizes: list[int], context: int, repeats: int, vocab: int) -> dict[int, float]:
    """Median seconds of one verify of a chain of n random tokens after `context` cached ones, for each n, on any
    engine (engines/base.py): through a session, each verify rolled back after it is timed."""
    g = torch.Generator().manual_seed(0)
    session = engine.session(context + max(sizes) + 1)
    try:
        session.prefill(torch.randint(0, vocab, (1, context), generator=g))
        chains = {n: chain(n, engine.device) for n in sizes}

        def forward(n: int):
            tokens = torch.randint(0, vocab, (n,), generator=g)
            return lambda: session.verify(tokens, chains[n], greedy=False)

        return _median_seconds(forward, session.rollback, sizes, repeats, engine.device, f"latency, {context} cached")
    finally:
        session.close()


def measure_engine_cost(engine, heads, vocab: int, sizes: tuple[int, ...] = COST_SIZES,
                        contexts: tuple[int, ...] = COST_CONTEXTS, repeats: int = 5, topk: int = 8,
                        overhead_ms: float = 3.0) -> CostModel:
    """measure_cost for an engine other than transformers (llama.cpp): its verify by tree size and context."""
    ms = []
    for c in tqdm(contexts, desc="contexts", leave=False):
        latency = engine_latency(engine, list(sizes), c, repeats, vocab)
        ms.append(tuple(round(1000 * latency[n], 2) for n in sizes))
    draft = round(level_draft_ms(heads, topk=topk), 3)
    return CostModel(tuple(contexts), tuple(sizes), tuple(ms), draft_ms=draft, overhead_ms=overhead_ms, fit="measured")


def merge_adaptive(adaptive: dict | None, acceptance: Acceptance | None = None, lookup: LookupAcceptance | None = None,
                   cost: tuple[str, CostModel] | None = None, ngrams: PhraseAcceptance | None = None,
                   machine: dict | None = None) -> dict:
    """config.adaptive with the parts given replaced; cost models are kept per kernels key, others left as they are.
    machine: the machine a new cost table was timed on (calibration/machine.py), kept beside it; without one, a
    replaced table keeps the record it had (its batch or greedy part measured again on that machine)."""
    out = dict(adaptive or {})
    if ngrams is not None:
        out["ngrams"] = ngrams.to_dict()
    if acceptance is not None:
        out["acceptance"] = acceptance.to_dict()
    if lookup is not None:
        out["lookup"] = lookup.to_dict()
    if cost is not None:
        record = machine if machine is not None else out.get("cost", {}).get(cost[0], {}).get("machine")
        out["cost"] = {**out.get("cost", {}), cost[0]: {**cost[1].to_dict(), **({"machine": record} if record else {})}}
    return out
