"""The tree of each step: what a node is worth (calibrated acceptance) and what it costs (a stored verify-time model).

Pure tensor code, no model. `medusa-heads calibrate` measures both and stores them in the heads' config
(`MedusaConfig.adaptive`); inference/propose.AdaptiveDrafter uses them at every step.

A node's worth is the probability that the target accepts it: the product, along its path, of each head's
calibrated probability for its token (acceptance of a child given that its parent was accepted). A prefix-closed
set of nodes then yields 1 + sum of its nodes' worth tokens in expectation, and costs one verify over its size."""
from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from functools import cached_property

import torch


class _RateTable:
    """A frozen table of rates keyed by its first field (`KEY`): as a dict of lists for JSON, and back."""

    KEY = ""

    def to_dict(self) -> dict:
        return {self.KEY: list(getattr(self, self.KEY)), "rates": [list(r) for r in self.rates]}

    @classmethod
    def from_dict(cls, d: dict):
        return cls(tuple(d[cls.KEY]), tuple(tuple(r) for r in d["rates"]))


@dataclass(frozen=True)
class Acceptance(_RateTable):
    """P(a drafted token is accepted | its parent was) from the head's own probability, per depth: isotonic bins."""

    edges: tuple[float, ...]  # B + 1 increasing bin edges over [0, 1]
    rates: tuple[tuple[float, ...], ...]  # rates[d - 1][b]: acceptance at depth d for head probability in bin b
    KEY = "edges"

    def __post_init__(self) -> None:
        if (len(self.edges) < 2 or list(self.edges) != sorted(self.edges) or self.edges[0] != 0.0
                or self.edges[-1] != 1.0):
            raise ValueError(f"acceptance bin edges must rise from 0 to 1, got {self.edges}")
        if not self.rates or any(len(r) != len(self.edges) - 1 for r in self.rates):
            raise ValueError(f"acceptance rates need one row per depth and {len(self.edges) - 1} bins each")
        if any(not 0.0 <= x <= 1.0 for r in self.rates for x in r):
            raise ValueError("acceptance rates must lie in [0, 1]")

    @property
    def depth(self) -> int:
        return len(self.rates)

    def table(self) -> torch.Tensor:
        """(D, B) float32."""
        return torch.tensor(self.rates, dtype=torch.float32)

    @cached_property
    def _lookup(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(D, B) rates and (B - 1,) inner edges, float32, built once (a step reads them at every level)."""
        return self.table(), torch.tensor(self.edges[1:-1], dtype=torch.float32)

    def __call__(self, depth: int, probs: torch.Tensor) -> torch.Tensor:
        """probs: (...) head probabilities at depth `depth` (1-based; deeper than measured reads the last row) ->
        (...) acceptance probabilities, float32."""
        rates, edges = self._lookup
        bins = torch.bucketize(probs.float().cpu(), edges, right=True)
        return rates[min(depth, self.depth) - 1][bins].to(probs.device)

    def rate(self, depth: int, prob: float) -> float:
        """One probability's acceptance, in plain Python (a handful per step cost less than a tensor call)."""
        b = min(bisect.bisect_right(self.edges, prob) - 1, len(self.edges) - 2)
        return self.rates[min(depth, self.depth) - 1][max(b, 0)]


@dataclass(frozen=True)
class LookupAcceptance(_RateTable):
    """P(the j-th token of a prompt-lookup continuation is accepted | the (j-1)-th was), by matched n-gram length."""

    ngrams: tuple[int, ...]  # matched n-gram lengths measured, increasing
    rates: tuple[tuple[float, ...], ...]  # rates[i][j - 1]: for ngrams[i], depth j (deeper reads the last entry)
    KEY = "ngrams"

    def __post_init__(self) -> None:
        if not self.ngrams or len(self.rates) != len(self.ngrams) or any(not r for r in self.rates):
            raise ValueError("lookup acceptance needs one non-empty row of rates per n-gram length")
        if any(not 0.0 <= x <= 1.0 for r in self.rates for x in r):
            raise ValueError("lookup acceptance rates must lie in [0, 1]")

    def chain(self, ngram: int, length: int) -> list[float]:
        """Conditional acceptance of each of `length` continuation tokens found by an n-gram of length `ngram`."""
        i = max(0, bisect.bisect_right(self.ngrams, ngram) - 1)
        row = self.rates[i]
        return [row[min(j, len(row) - 1)] for j in range(length)]


@dataclass(frozen=True)
class PhraseAcceptance:
    """P(the phrasebook's j-th token is accepted | the (j-1)-th was): per length of the n-gram that found it, an
    Acceptance over the store's confidence (a 4-gram's follower is accepted more often than a 2-gram's of the same
    confidence)."""

    orders: tuple[int, ...]  # matched n-gram lengths measured, increasing
    tables: tuple[Acceptance, ...]  # tables[i]: for orders[i] (a shorter match reads the first, a longer the last)

    def __post_init__(self) -> None:
        if not self.orders or len(self.tables) != len(self.orders) or list(self.orders) != sorted(set(self.orders)):
            raise ValueError("phrasebook acceptance needs increasing n-gram lengths, one table each, "
                             f"got {self.orders}")
        if len({t.depth for t in self.tables}) != 1:
            raise ValueError("phrasebook acceptance tables must measure the same depths")

    @property
    def depth(self) -> int:
        return self.tables[0].depth

    def rate(self, depth: int, order: int, confidence: float) -> float:
        i = max(0, bisect.bisect_right(self.orders, order) - 1)
        return self.tables[i].rate(depth, confidence)

    def to_dict(self) -> dict:
        return {"orders": list(self.orders), "tables": [t.to_dict() for t in self.tables]}

    @classmethod
    def from_dict(cls, d: dict) -> "PhraseAcceptance":
        return cls(tuple(d["orders"]), tuple(Acceptance.from_dict(t) for t in d["tables"]))


FITS = ("measured", "steps", "line")


@dataclass(frozen=True)
class CostModel:
    """Milliseconds of one step as a function of the tree's size and the cached context, for one set of kernels:
    the verify forward over n tree tokens (n = 1 is a plain decoding step), interpolated between the measured
    sizes and context lengths, plus drafting (per head level run) and fixed per-step work.

    `fit` says how each context's timings are read over the sizes:
    - "measured": as they are, every size its own (calibrate measures every size from 1 to 32, 15 times each).
      GEMM kernels work on blocks of rows, and where a block is cheap the cost is not monotone in the size: MKL's
      fp32 GEMM on an AVX-512 EPYC takes 3, 7 and 11 rows at ~1.35x the time of 4, 8 and 12, and oneDNN's packed
      product takes 2 rows at ~1.15x the time of 3 to 6. best_size weighs every size, so where a larger tree costs
      less it takes the next candidates for free; a fit would charge both sizes a smoothed average.
    The two fits below smooth the timings (heads calibrated before "measured"), since a few timings per size are
    noisy (+-10%) and noise that makes some large trees look free biases the choice towards them:
    - "steps": over trees of 2 tokens and more, the closest non-decreasing function (isotonic). CPU GEMM kernels
      work on blocks of rows (about 6 in fp32), so a verify costs about the same from 2 to 6 tokens and jumps at 7;
      a line hides those steps and charges 6 tokens like 7. The plain step (1 token) keeps its own timing: it runs
      other kernels (one row), and in bf16 on a CPU another attention path, which at long contexts costs more than
      a 2-token tree (results/transformers/bf16/one_token.md); pooled with the trees, it would be charged what they
      cost.
    - "line": a least-squares line through the tree sizes (>= 2), never below a plain step (heads calibrated
      before "steps" existed).

    `batches` holds the same for a batch's verify: for B rows (2, 4, 8 as calibrate measures them), one forward over
    each row's tree padded to a common size, its milliseconds by that size (size 1: a batched plain step). On a CPU
    a batch is compute-bound at a few rows, so what a tree costs there is another curve: on two AVX-512 cores, 6
    tokens for each of 4 rows cost 1.8x a plain step of the 4 (for one row: 0.96x). Without it, batches draft a
    fixed tree.

    `greedy` holds the same for a greedy verify that skips the LM head through the screen
    (medusa_heads/kernels/screen.py: only each node's argmax is needed, where the screen serves the model): one row's
    milliseconds by size, read by `for_greedy`. calibrate times greedy and full verifies alternately and takes from
    `ms` what the greedy one saves (a host's speed drifts between runs by more than the head costs). On MKL's fp32
    kernels the head over a few rows costs ~15 ms of a 60-150 ms verify, which the screen saves at about every size: a
    plain step gains more, relatively, than a large tree; with prepacked linears the two differ by ~2 ms. None: greedy
    steps are charged `ms`."""

    contexts: tuple[int, ...]  # cached tokens measured, increasing
    sizes: tuple[int, ...]  # tree tokens measured (root included), increasing, starting at 1
    ms: tuple[tuple[float, ...], ...]  # ms[c][s]: verify over sizes[s] tokens after contexts[c] cached tokens
    draft_ms: float = 0.0  # one level of drafting (a head over the level's parents)
    overhead_ms: float = 0.0  # per-step work a tree adds besides verify and drafting (building, accepting along it)
    fit: str = "steps"  # how timings are smoothed over sizes: "steps" or "line" (see above)
    batches: tuple[tuple[int, "CostModel"], ...] = ()  # (rows B, the cost of verifying B rows' trees at once)
    greedy: "CostModel | None" = None  # one row's verify when only argmaxes are needed (screened; see above)
    loop_ms: float = 0.0  # the decode loop's own work at every step, a plain one too (lookup, acceptance, commit)

    def __post_init__(self) -> None:
        rows = [b for b, _ in self.batches]
        if rows != sorted(set(rows)) or any(b < 2 for b in rows):
            raise ValueError(f"cost model batches must be for increasing row counts of 2 or more, got {rows}")
        if any(c.batches or c.greedy for _, c in self.batches):
            raise ValueError("a batch's cost model cannot hold batches or a greedy cost of its own")
        if self.greedy is not None and (self.greedy.batches or self.greedy.greedy):
            raise ValueError("a greedy cost model is one row's: it cannot hold batches or a greedy cost of its own")
        if self.fit not in FITS:
            raise ValueError(f"cost model fit must be one of {FITS}, got {self.fit!r}")
        if not self.contexts or list(self.contexts) != sorted(set(self.contexts)):
            raise ValueError(f"cost model contexts must increase, got {self.contexts}")
        if not self.sizes or self.sizes[0] != 1 or list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError(f"cost model sizes must increase from 1, got {self.sizes}")
        if len(self.ms) != len(self.contexts) or any(len(r) != len(self.sizes) for r in self.ms):
            raise ValueError("cost model needs one row of milliseconds per context, one entry per size")

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    @property
    def batched(self) -> bool:
        """Whether batches were measured (else a tree for a batch cannot be sized)."""
        return bool(self.batches)

    def verify_ms(self, context: int, rows: int = 1) -> torch.Tensor:
        """(S,) verify milliseconds for 1..S tree tokens (per row) after `context` cached tokens, for `rows` rows.
        One row: S = max_size, linear over the measured contexts (beyond them, extrapolated from the last two),
        smoothed over sizes by `fit`. More rows: linear between the measured row counts (one row is this model
        itself; beyond the last, extrapolated from the last two, as a compute-bound forward grows), S the smallest
        max_size of the two. Raises for rows > 1 where no batch was measured."""
        if rows <= 1:
            return self._one_row(context)
        if not self.batches:
            raise ValueError("this cost model measured one row only: run medusa-heads calibrate --parts batch")
        tables = [(1, self), *self.batches]
        i = min(max(bisect.bisect_right([b for b, _ in tables], rows) - 1, 0), len(tables) - 2)
        (b0, c0), (b1, c1) = tables[i], tables[i + 1]
        v0, v1 = c0._one_row(context), c1._one_row(context)
        n = min(v0.shape[0], v1.shape[0])
        return torch.lerp(v0[:n], v1[:n], (rows - b0) / (b1 - b0))

    def _one_row(self, context: int) -> torch.Tensor:
        rows = self._by_size  # (C, max_size)
        if len(self.contexts) == 1:
            return rows[0]
        c = min(max(bisect.bisect_right(self.contexts, context) - 1, 0), len(self.contexts) - 2)
        c0, c1 = self.contexts[c], self.contexts[c + 1]
        w = max((context - c0) / (c1 - c0), 0.0) if context > c0 or c == 0 else 0.0
        return torch.lerp(rows[c], rows[c + 1], w)

    @cached_property
    def _by_size(self) -> torch.Tensor:
        """(C, max_size) float32: each measured context's milliseconds for 1..max_size tree tokens, fitted once."""
        sizes = torch.tensor(self.sizes, dtype=torch.float64)
        n = torch.arange(1, self.max_size + 1, dtype=torch.float64)
        rows = []
        for row in torch.tensor(self.ms, dtype=torch.float64):
            if self.fit == "measured":
                rows.append(_interp(n, sizes, row))
                continue
            if self.fit == "steps":
                trees = isotonic(row[1:].tolist(), [1.0] * (len(self.sizes) - 1))  # the plain step stays apart
                rows.append(_interp(n, sizes, torch.tensor([float(row[0]), *trees], dtype=torch.float64)))
                continue
            if len(self.sizes) < 3:
                rows.append(_interp(n, sizes, row).cummax(0).values)
                continue
            x, y = sizes[1:], row[1:]
            slope = (((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()).clamp_min(0.0)
            fit = y.mean() + slope * (n - x.mean())
            rows.append(torch.cat([row[:1], fit[1:].clamp_min(float(row[0]))]))
        return torch.stack(rows).float()

    def for_greedy(self) -> "CostModel":
        """What a greedy step through the screen costs: the greedy table where measured (with this model's drafting,
        overhead and batches: a batch's greedy verify is charged the head it skips), else this model."""
        if self.greedy is None:
            return self
        return dataclasses.replace(self.greedy, draft_ms=self.draft_ms, overhead_ms=self.overhead_ms,
                                   loop_ms=self.loop_ms, batches=self.batches)

    def with_greedy(self, greedy: "CostModel") -> "CostModel":
        """This model with the greedy verify's table (replacing any); its drafting and overhead are this model's."""
        return dataclasses.replace(self, greedy=dataclasses.replace(greedy, draft_ms=0.0, overhead_ms=0.0,
                                                                    loop_ms=0.0))

    def to_dict(self) -> dict:
        out = {"contexts": list(self.contexts), "sizes": list(self.sizes), "ms": [list(r) for r in self.ms],
               "draft_ms": self.draft_ms, "overhead_ms": self.overhead_ms, "fit": self.fit}
        if self.loop_ms:
            out["loop_ms"] = self.loop_ms
        if self.batches:
            out["batches"] = {str(b): c.to_dict() for b, c in self.batches}
        if self.greedy is not None:
            out["greedy"] = {k: v for k, v in self.greedy.to_dict().items()
                             if k not in ("draft_ms", "overhead_ms", "loop_ms")}
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        batches = tuple(sorted((int(b), cls.from_dict(c)) for b, c in d.get("batches", {}).items()))
        greedy = cls.from_dict(d["greedy"]) if "greedy" in d else None
        return cls(tuple(d["contexts"]), tuple(d["sizes"]), tuple(tuple(r) for r in d["ms"]),
                   float(d.get("draft_ms", 0.0)), float(d.get("overhead_ms", 0.0)), d.get("fit", "line"), batches,
                   greedy, float(d.get("loop_ms", 0.0)))

    def up_to(self, size: int) -> "CostModel":
        """This one row's model for trees of at most `size` tokens (an engine whose kernels change a row's bits past
        them); batches and the greedy table are dropped."""
        keep = [i for i, s in enumerate(self.sizes) if s <= size]
        return dataclasses.replace(self, sizes=tuple(self.sizes[i] for i in keep),
                                   ms=tuple(tuple(row[i] for i in keep) for row in self.ms), batches=(), greedy=None)

    def with_batches(self, batches: dict[int, "CostModel"]) -> "CostModel":
        """This model with these batch measurements added (replacing any for the same row counts)."""
        merged = {**dict(self.batches), **batches}
        return dataclasses.replace(self, batches=tuple(sorted(merged.items())))


def _interp(x: torch.Tensor, xp: torch.Tensor, fp: torch.Tensor) -> torch.Tensor:
    """Piecewise-linear interpolation of (xp, fp) at x, flat beyond the ends."""
    i = torch.searchsorted(xp, x, right=True).clamp(1, len(xp) - 1)
    x0, x1, f0, f1 = xp[i - 1], xp[i], fp[i - 1], fp[i]
    w = ((x - x0) / (x1 - x0).clamp_min(1e-9)).clamp(0, 1)
    return f0 + w * (f1 - f0)


def expected_tokens(values: torch.Tensor, sizes: int) -> torch.Tensor:
    """values: (M,) worth of one row's candidate nodes, best first, each at most its parent's (so any first n is
    prefix-closed). Returns (sizes,): the expected tokens of a step whose tree keeps the first n, for n in
    0..sizes - 1 (the root's token, plus each kept node's worth; past M, no more nodes to keep)."""
    worth = values[: sizes - 1].to(torch.float64).cumsum(0)
    tau = torch.ones(sizes, dtype=torch.float64)
    tau[1 : worth.shape[0] + 1] += worth
    if worth.shape[0]:
        tau[worth.shape[0] + 1 :] += worth[-1]
    return tau


def best_size(tau: torch.Tensor, step_ms: torch.Tensor) -> int:
    """The one rule that sizes a tree, for a row or a batch, chosen at each step or calibrated once: tau[n] the
    expected tokens and step_ms[n] the milliseconds of a step whose tree holds n drafted nodes (0: a plain step).
    Returns the n with the most expected tokens per millisecond (the smallest, on a tie)."""
    n = min(tau.shape[0], step_ms.shape[0])
    return int((tau[:n].to(torch.float64) / step_ms[:n].to(torch.float64)).argmax())


def isotonic(y: list[float], w: list[float]) -> list[float]:
    """Non-decreasing least-squares fit of y with weights w (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [value, weight, count]
    for yi, wi in zip(y, w):
        blocks.append([yi, wi, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            wt = w1 + w2
            blocks.append([(v1 * w1 + v2 * w2) / wt if wt > 0 else (v1 + v2) / 2, wt, n1 + n2])
    out: list[float] = []
    for v, _, n in blocks:
        out += [v] * n
    return out
