"""What the target's forwards and the heads' drafting take on this machine: one verify by tree size after a cached
context (transformers' target or any engine), a batch's verify, what the greedy verify saves, a drafting level; and
the cost models (tree/adaptive.py: CostModel) built from them. Every timing alternates its sizes (timing.py)."""
from __future__ import annotations

import time

import torch
from tqdm import tqdm

from medusa_heads.calibration.timing import device_sync, timings
from medusa_heads.engines.hf_cache import crop_to, new_cache
from medusa_heads.inference.adaptive import DraftObserver
from medusa_heads.inference.propose import HeadsDrafter
from medusa_heads.tree.adaptive import CostModel
from medusa_heads.tree.buffers import build_buffers, chain
from medusa_heads.tree.spec import TreeSpec

BATCH_ROWS = (2, 4, 8)  # batch sizes whose verify the cost model measures ("batch")
BATCH_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)  # tree tokens per row measured for a batch (its trees stay small)
BATCH_CONTEXTS = (256, 1024)
COST_SIZES = tuple(range(1, 33))  # every size: a kernel's cost need not grow with the rows (CostModel, "measured")
COST_CONTEXTS = (256, 1024, 4096)


@torch.no_grad()
def verify_latency(target, sizes: list[int], context: int = 300, repeats: int = 3) -> dict[int, float]:
    """Median seconds of one target forward over n new tokens after `context` cached tokens, for each n, into the
    preallocated cache that decoding writes to (a growing cache would add a copy of every layer's keys and values
    to each forward: ~3 ms at 2K cached tokens for SmolLM2 on a CPU, which decoding never pays)."""
    keys = [(n, "step" if n == 1 else "full") for n in sizes]  # n = 1: a plain decoding step, as generate takes it
    verifier = _CacheVerifier(target, context, sizes)
    return {n: t for (n, _), t in _chain_seconds(verifier, keys, context, repeats, "latency").items()}


def greedy_savings(target, sizes: list[int], text: torch.Tensor, repeats: int = 3) -> dict[int, float]:
    """For each n: the median seconds of the full verify of a chain of n tokens less those of the greedy verify of it
    (argmaxes through the screen, medusa_heads/kernels/screen.py), the two timed one after the other in one run, a
    root alone (n = 1) as a per-step tree with no drafted node verifies it. text: (context + max(sizes),) the target's
    own text (answer_text): the cached context, then the chain verified. The screen's work depends on how sure the
    target is (random tokens leave it unsure: many candidates to rescore), so it runs on text the target wrote.
    Paired, since a shared host's speed drifts by 10-20% between runs: a table timed apart from the full one would
    mostly measure that."""
    keys = [(n, mode) for n in sizes for mode in ("full", "greedy")]
    context = text.shape[0] - max(sizes)
    t = _chain_seconds(_CacheVerifier(target, context, sizes), keys, context, repeats, "full - greedy", text=text)
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


class _CacheVerifier:
    """transformers' target (engines/hf.py) into the preallocated cache that decoding writes to, cropped back to the
    context after each forward. A key (n, mode): "step" (target.step, n = 1), "full" (target.verify) or "greedy"
    (target.verify(greedy=True)) of a chain of n tokens."""

    def __init__(self, target, context: int, sizes: list[int]) -> None:
        self.target, self.context, self.device = target, context, target.model.device
        self.vocab = target.lm_head.weight.shape[0]
        self.cache = new_cache(target.model, context + max(sizes))
        self.chains = {n: chain(n, self.device) for n in sizes}

    def prefill(self, ids: torch.Tensor) -> None:
        self.target.prefill(ids[None].to(self.device), self.cache)

    def forward(self, tokens: torch.Tensor, key: tuple[int, str]):
        n, mode = key
        tokens = tokens.to(self.device)
        if mode == "step":
            return lambda: self.target.step(tokens, self.context, self.cache)
        return lambda: self.target.verify(tokens, self.context, self.cache, self.chains[n], greedy=mode == "greedy")

    def reset(self) -> None:
        crop_to(self.cache, self.context)


class _SessionVerifier:
    """Any engine (engines/base.py) through a session: a key (n, "full") verifies a chain of n tokens, rolled back
    after it is timed."""

    def __init__(self, engine, context: int, sizes: list[int], vocab: int) -> None:
        self.device, self.vocab = engine.device, vocab
        self.chains = {n: chain(n, engine.device) for n in sizes}
        self.session = engine.session(context + max(sizes) + 1)

    def prefill(self, ids: torch.Tensor) -> None:
        self.session.prefill(ids[None])

    def forward(self, tokens: torch.Tensor, key: tuple[int, str]):
        return lambda: self.session.verify(tokens, self.chains[key[0]], greedy=False)

    def reset(self) -> None:
        self.session.rollback()


def _chain_seconds(verifier, keys: list[tuple[int, str]], context: int, repeats: int, desc: str,
                   text: torch.Tensor | None = None) -> dict:
    """The median seconds of verifier's forward for each (n, mode) key after `context` tokens prefilled: random
    tokens (one generator, seeded 0, drawn in turn: the context, then each forward's chain), or `text` (the context,
    then each chain's tokens)."""
    vocab = verifier.vocab
    g = torch.Generator().manual_seed(0)
    verifier.prefill(text[:context] if text is not None else torch.randint(0, vocab, (context,), generator=g))

    def forward(key: tuple[int, str]):
        n = key[0]
        tokens = text[context : context + n] if text is not None else torch.randint(0, vocab, (n,), generator=g)
        return verifier.forward(tokens, key)

    return _median_seconds(forward, verifier.reset, keys, repeats, verifier.device, desc)


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


def _median_seconds(forward, reset, sizes: list, repeats: int, device: torch.device, desc: str) -> dict:
    """For each n in sizes: forward(n) prepares the inputs of one forward and returns it; the median of its timed
    runs over `repeats` rounds after one round of warm-up, sizes alternating in order (timing.py: so drift hits them
    alike), reset() after each run (the cache cropped back)."""
    ready = {}  # n -> the forward prepared for it, off the clock
    arms = {n: (lambda _, n=n: ready.pop(n)()) for n in sizes}
    seconds = timings(arms, tqdm(range(repeats + 1), desc=desc, leave=False), skip=1, sync=device_sync(device),
                      before=lambda n: ready.__setitem__(n, forward(n)), after=lambda n: reset()).seconds
    return {n: sorted(v)[len(v) // 2] for n, v in seconds.items()}


def ms_table(latency, contexts: tuple[int, ...], sizes: tuple[int, ...], desc: str | None = "contexts") -> tuple:
    """A cost model's milliseconds: for each context c, latency(c) (seconds by size) read at `sizes`, rounded."""
    ms = []
    for c in tqdm(contexts, desc=desc, leave=False) if desc else contexts:
        seconds = latency(c)
        ms.append(tuple(round(1000 * seconds[n], 2) for n in sizes))
    return tuple(ms)


def measure_batch_cost(target, cost: CostModel, rows: tuple[int, ...] = BATCH_ROWS,
                       sizes: tuple[int, ...] = BATCH_SIZES, contexts: tuple[int, ...] = BATCH_CONTEXTS,
                       repeats: int = 5) -> CostModel:
    """`cost` (one row, these kernels) with a batch's verify measured for each of `rows` (batch_verify_latency);
    drafting and overhead as `cost` has them (a row drafts as it does alone)."""
    batches = {}
    for b in tqdm(rows, desc="batches", leave=False):
        ms = ms_table(lambda c: batch_verify_latency(target, b, list(sizes), context=c, repeats=repeats), contexts,
                      sizes, desc=None)
        batches[b] = CostModel(tuple(contexts), tuple(sizes), ms, draft_ms=cost.draft_ms,
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
        saved = sorted(greedy_savings(target, list(cost.sizes), answer_text(answers, c, cost.max_size),
                                      repeats).values())
        cut = max(1000 * saved[len(saved) // 2], 0.0)  # never dearer: the same decoder, a cheaper head (noise aside)
        ms.append(tuple(round(max(t - cut, 0.5 * t), 2) for t in row))
    return cost.with_greedy(CostModel(cost.contexts, cost.sizes, tuple(ms), fit=cost.fit))


@torch.no_grad()
def draft_latency(heads, spec: TreeSpec, repeats: int = 20) -> float:
    """Seconds the heads take to draft `spec` (path-conditioned heads draft level by level, so it depends on it)."""
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
    ms = ms_table(lambda c: verify_latency(target, list(sizes), context=c, repeats=repeats), contexts, sizes)
    draft = round(level_draft_ms(heads, topk=topk), 3)
    return CostModel(tuple(contexts), tuple(sizes), ms, draft_ms=draft, overhead_ms=overhead_ms, fit="measured")


@torch.no_grad()
def engine_latency(engine, sizes: list[int], context: int, repeats: int, vocab: int) -> dict[int, float]:
    """Median seconds of one verify of a chain of n random tokens after `context` cached ones, for each n, on any
    engine (engines/base.py): through a session, each verify rolled back after it is timed."""
    verifier = _SessionVerifier(engine, context, sizes, vocab)
    try:
        keys = [(n, "full") for n in sizes]
        return {n: t for (n, _), t in
                _chain_seconds(verifier, keys, context, repeats, f"latency, {context} cached").items()}
    finally:
        verifier.session.close()


def measure_engine_cost(engine, heads, vocab: int, sizes: tuple[int, ...] = COST_SIZES,
                        contexts: tuple[int, ...] = COST_CONTEXTS, repeats: int = 5, topk: int = 8,
                        overhead_ms: float = 3.0) -> CostModel:
    """measure_cost for an engine other than transformers (llama.cpp): its verify by tree size and context."""
    ms = ms_table(lambda c: engine_latency(engine, list(sizes), c, repeats, vocab), contexts, sizes)
    draft = round(level_draft_ms(heads, topk=topk), 3)
    return CostModel(tuple(contexts), tuple(sizes), ms, draft_ms=draft, overhead_ms=overhead_ms, fit="measured")


LOOP_PROMPTS = 6  # held-out prompts whose greedy calls measure the loop
LOOP_TOKENS = 128  # new tokens each


class _Steps(DraftObserver):
    """Keeps each step's kept nodes and drafting levels."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int]] = []

    def drafted(self, sequence, candidates, kept: int) -> None:
        self.steps.append((kept, candidates.levels))


def measure_loop(model, drafting, prompts: list[torch.Tensor], max_new_tokens: int = LOOP_TOKENS) -> tuple[dict, dict]:
    """What the decode loop itself costs a step, besides the verify: greedy calls of `model` with the per-step tree
    of `drafting` on `prompts`, each step's time outside its verify (DecodeStats.loop_seconds) fitted by least
    squares as loop + tree x (it kept nodes) + level x (drafting levels it ran). Returns ({"loop_ms", "overhead_ms",
    "draft_ms"}, what the fit saw). A level's cost is fitted too: in the loop it costs the heads' product and its
    Python around it, which level_draft_ms' product alone leaves out; where too few steps drafted to tell (the heads
    resting on these prompts) it stays the measured product's."""
    rows = []
    for i, ids in enumerate([prompts[0], *prompts]):  # the first call warms up
        seen = _Steps()
        drafter = drafting.adaptive_drafter(drafting.lookup_tokens, observer=seen)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, drafter=drafter, prompt_lookup_num_tokens=0,
                             return_dict_in_generate=True)
        # the last steps: an engine whose prefill hands over no hidden state verifies the root alone, undrafted, first
        loop = out.stats.loop_seconds[len(out.stats.loop_seconds) - len(seen.steps):]
        if i:
            rows += [(kept, levels, 1000 * s) for (kept, levels), s in zip(seen.steps, loop)]
    return fit_loop(rows, drafting.cost.draft_ms)


def fit_loop(rows: list[tuple[int, int, float]], draft_ms: float, least: int = 20) -> tuple[dict, dict]:
    """measure_loop's fit over steps (kept nodes, drafting levels, ms outside the verify): least squares of
    loop + tree x (kept nodes > 0) + level x levels, each at least 0. A step over 5x the median is left out (a
    collection, a preemption). The tree's term needs `least` steps with nodes and as many without (else it is 0: the
    loop's term takes it), the level's `least` steps that drafted (else it is `draft_ms`, subtracted first)."""
    if not rows:
        raise ValueError("the loop's cost: the calls drafted no step to time")
    ms = torch.tensor([r[2] for r in rows], dtype=torch.float64)
    keep = ms <= 5 * ms.median()
    tree = torch.tensor([float(r[0] > 0) for r in rows], dtype=torch.float64)[keep]
    levels = torch.tensor([float(r[1]) for r in rows], dtype=torch.float64)[keep]
    ms = ms[keep]
    fitted_level = int((levels > 0).sum()) >= least
    separable = int((tree > 0).sum()) >= least and int((tree == 0).sum()) >= least
    columns = [torch.ones_like(ms)] + [tree] * separable + [levels] * fitted_level
    y = ms if fitted_level else ms - levels * draft_ms
    coef = torch.linalg.lstsq(torch.stack(columns, 1), y[:, None]).solution[:, 0].clamp_min(0.0).tolist()
    loop, overhead = coef[0], coef[1] if separable else 0.0
    draft = coef[-1] if fitted_level else draft_ms
    seen = {"steps": len(rows), "dropped": int((~keep).sum()), "tree steps": int((tree > 0).sum()),
            "drafting steps": int((levels > 0).sum()), "median ms outside the verify": round(float(ms.median()), 3)}
    return {"loop_ms": round(loop, 3), "overhead_ms": round(overhead, 3), "draft_ms": round(draft, 3)}, seen
