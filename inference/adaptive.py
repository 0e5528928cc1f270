"""The tree of each step, chosen from the heads' own confidence and what a verify costs (EAGLE-2's idea, sized
like Sequoia's trees by a measured cost model).

1. Expand: level by level, head d scores the children of the `beam` most promising nodes of level d - 1; each
   child is worth its parent's worth times its calibrated acceptance (tree/adaptive.Acceptance).
2. Lookup: a prompt-lookup continuation walks the same candidates; where it repeats a drafted child, that child is
   one node, its rate raised by the lookup's (a noisy OR of the two); the rest hangs below as a chain at the
   lookup's own rates. A lookup token never gets more than its node's other drafted children leave. The target's
   phrasebook (tree/ngrams.py: what followed the text's last n-gram most often in its own answers) is merged
   the same way, at its own calibrated rates.
3. Select: worth never grows down a path, so the n most valuable candidates are prefix-closed; keep the n (0: a
   plain step) that maximises expected tokens per millisecond under the stored cost model.
4. Learn: after the verify, observed acceptance corrects the calibration for the rest of this call.

In a batch every running row drafts its candidates the same way (each head level runs once for all the rows that
draft it), and one size n is chosen for all (the rows' trees are
padded to a common size in one verify): the n that maximises the rows' expected tokens together per millisecond
of the batch's measured verify (CostModel.batches), each row keeping its n most valuable candidates. On a CPU a
batch's verify is compute-bound at a few rows, so its trees come out smaller, down to plain steps.

The tree depends on the drafts, the context length, the stored cost model and earlier steps' acceptance, never on
the target's output at this step nor on live timings: output stays exactly the target's, and a seed reproduces
a sample."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from medusa_heads.heads import MedusaHeads
from medusa_heads.tree.adaptive import (Acceptance, CostModel, LookupAcceptance, PhraseAcceptance, best_size,
                                        expected_tokens)
from medusa_heads.tree.buffers import TreeBuffers, from_parents
from medusa_heads.tree.ngrams import NgramStore
from medusa_heads.inference.propose import MAX_NGRAM, Draft, lookup_continuations

PRIOR = 4.0  # the stored calibration counts as this many observations at p = 1/2 against a call's own acceptance
EPS = 1e-4  # rates are kept in [EPS, 1 - EPS] in log-odds


class Correction:
    """Per slot (a source of nodes: see AdaptiveDrafter), a shift b of the calibrated rates in log-odds,
    rate -> sigmoid(logit(rate) + b), fitted to the call's observed acceptance: the maximum a posteriori b under a
    Gaussian prior with the information of PRIOR observations at p = 1/2, a few Newton steps after each verify.
    A shift in log-odds moves a rate of 1/2 most and rates near 0 or 1 least, which is how the heads' rates miss on
    text they have not seen (docs/how-it-works.md, "The tree is chosen per step"); a factor moves the high rates most
    and clips them at 1. Trials are kept as the rates before the shift, so b measures the stored calibration's error,
    not what remains of it after an earlier b; and they are counted by (slot, rate to 0.01 in log-odds), so a fit
    costs the same after 100 steps as after 5,000."""

    def __init__(self, slots: int) -> None:
        self.shift = [0.0] * slots
        self.trials: dict[tuple[int, float], list[float]] = {}  # (slot, logit before the shift) -> [trials, hits]
        self._fitted = True  # no trial added since the last fit (a plain step adds none)

    def __call__(self, slot: int, rate: float) -> float:
        b = self.shift[slot]
        return rate if b == 0.0 else _sigmoid(_logit(rate) + b)

    def rates(self, slot: int, rates: torch.Tensor) -> torch.Tensor:
        b = self.shift[slot]
        return rates if b == 0.0 else torch.sigmoid(torch.logit(rates, EPS) + b)

    def add(self, slot: int, predicted: float, observed: float) -> None:
        """One trial: a node of `slot` rated `predicted` (after the shift the drafter applied) was accepted or not."""
        counts = self.trials.setdefault((slot, round(_logit(predicted) - self.shift[slot], 2)), [0.0, 0.0])
        counts[0] += 1.0
        counts[1] += observed
        self._fitted = False

    def fit(self, newton_steps: int = 3) -> None:
        if self._fitted:
            return
        self._fitted = True
        slot = torch.tensor([k[0] for k in self.trials])
        z = torch.tensor([k[1] for k in self.trials])
        n, y = torch.tensor(list(self.trials.values())).T
        b = torch.tensor(self.shift)
        precision = PRIOR / 4.0  # PRIOR observations at p = 1/2: each holds p(1 - p) = 1/4 of information
        for _ in range(newton_steps):  # concave: warm-started from the last fit, a few steps converge
            p = torch.sigmoid(z + b[slot])
            grad = torch.zeros_like(b).index_add_(0, slot, y - n * p) - precision * b
            curv = torch.zeros_like(b).index_add_(0, slot, n * p * (1 - p)) + precision
            b = b + grad / curv
        self.shift = b.tolist()


def _logit(p: float) -> float:
    p = min(max(p, EPS), 1.0 - EPS)
    return math.log(p / (1.0 - p))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


class AdaptiveDrafter:
    """Drafts a tree chosen for this step (see the module's docstring); one per generate call (it learns).

    Each node's rate is corrected online by the acceptance of its source (its slot): 0, prompt lookup's own tokens;
    d in 1..depth, head d; depth + 1, a drafted child that the lookup repeated and raised; depth + 2, the
    phrasebook's own tokens; depth + 3, a child the phrasebook repeated and raised (apart from the lookup's: the
    heads and the phrasebook learned from the same answers, so their agreement is weaker evidence than a noisy OR
    of independent sources says, and the correction learns by how much). The raised children are apart from the
    lookup's own tokens because their errors have opposite signs: the noisy OR rates the first too low and the
    lookup's chains past the heads too high, and pooled, the first pushed the second's rates up to 1."""

    def __init__(self, heads: MedusaHeads, acceptance: Acceptance, cost: CostModel,
                 lookup: LookupAcceptance | None = None, lookup_tokens: int = 0, max_ngram: int = MAX_NGRAM,
                 min_ngram: int = 1, topk: int = 4, beam: int = 4, lookup_branches: int = 1,
                 phrases: NgramStore | None = None, phrase_acceptance: PhraseAcceptance | None = None,
                 rows: int = 1, observer: "DraftObserver | None" = None) -> None:
        if topk < 1 or beam < 1 or lookup_branches < 1:
            raise ValueError(f"topk, beam and lookup_branches must be >= 1, got {topk}, {beam} and {lookup_branches}")
        if lookup_tokens and lookup is None:
            raise ValueError("prompt lookup in a per-step tree needs its measured acceptance "
                             "(run medusa-heads calibrate)")
        if (phrases is None) != (phrase_acceptance is None):
            raise ValueError("an n-gram store drafts only with its measured acceptance, and the other way round "
                             "(medusa-heads calibrate --parts ngrams makes both)")
        self.phrases, self.phrase_acceptance = phrases, phrase_acceptance
        self.heads, self.acceptance, self.cost, self.lookup = heads, acceptance, cost, lookup
        self.lookup_tokens, self.max_ngram, self.min_ngram = lookup_tokens, max_ngram, min_ngram
        self.branches = lookup_branches
        self.topk, self.beam = min(topk, heads.config.draft_vocab_size), min(beam, cost.max_size)
        self.depth = heads.config.num_heads
        self.repeat = self.depth + 1  # the slot of drafted children that the lookup raised
        self.phrase_slot = self.depth + 2  # the phrasebook's own tokens
        self.raised = {0: self.repeat, self.phrase_slot: self.depth + 3}  # a source -> the slot of children it raised
        self.correction = Correction(self.depth + 4)
        self.rows = rows  # the batch's rows: every one is verified, the finished ones with their root alone
        self._top_rate = acceptance.table().max(dim=1).values.tolist()  # per depth: the most a node can be accepted
        self._drafted: list[tuple[list[int], list[float], list[int]]] = []  # per row: parents, worth, slot
        self.observer = observer  # sees every row's candidates and kept tree, and every trial of the correction
        self._found: list[tuple[Candidates, int]] = []  # per row: its candidates and how many the tree keeps
        self.gate = DraftGate() if rows == 1 else None  # one row: the heads rest where they do not pay
        self._step: tuple[int, float, float] | None = None  # levels run, the step's and a plain step's modelled ms

    def draft(self, hidden: torch.Tensor, sequences: list[torch.Tensor], buffers: TreeBuffers) -> list[Draft]:
        self._drafted, self._found = [], []
        if self.rows == 1 and len(sequences) == 1:
            drafts = [self._draft_row(hidden[0], sequences[0])]
        else:
            drafts = self._draft_batch(hidden, sequences)
        if self.observer is not None:
            for sequence, (found, n) in zip(sequences, self._found):
                self.observer.drafted(sequence, found, n)
        return drafts

    @torch.no_grad()
    def _draft_row(self, h: torch.Tensor, sequence: torch.Tensor) -> Draft:
        verify_ms = self.cost.verify_ms(sequence.shape[0] - 1).tolist()  # 1..max_size tree tokens
        found = self._row_candidates(h, sequence, verify_ms, heads=self.gate is None or self.gate.open())
        step_ms = self._step_ms(verify_ms, found.levels)
        n = best_size(expected_tokens(torch.tensor(found.values), len(verify_ms)), torch.tensor(step_ms))
        self._step = (found.levels, step_ms[n], verify_ms[0] + self.cost.loop_ms)  # and a plain step's (_step_ms)
        return self._keep(found, n, h.device)

    @torch.no_grad()
    def _draft_batch(self, hidden: torch.Tensor, sequences: list[torch.Tensor]) -> list[Draft]:
        """One size for all rows (see the module's docstring): every running row's candidates (`sequences`; the
        verify holds all `self.rows`), then the n in 0..S - 1 that gives the most expected tokens of the running rows
        per millisecond of the batch's step, each row's first n."""
        verify_ms = self.cost.verify_ms(max(s.shape[0] for s in sequences) - 1, max(self.rows, len(sequences))).tolist()
        found = self._candidates_rows(hidden, sequences, verify_ms)
        tau = sum(expected_tokens(torch.tensor(f.values), len(verify_ms)) for f in found)  # the running rows' tokens
        # every row's levels charged as if drafted apart: an upper bound, since a level runs once for all its rows
        # (memory-bound, it costs little more for 8 rows than for 1), which leans a batch toward smaller trees
        n = best_size(tau, torch.tensor(self._step_ms(verify_ms, sum(f.levels for f in found))))
        return [self._keep(f, n, sequences[0].device) for f in found]

    def _keep(self, found: "Candidates", n: int, device: torch.device) -> Draft:
        """The tree of `found`'s first n candidates (parents before children), recorded for update()."""
        tok, par, val, slot = found.tok, found.par, found.val, found.slot
        self._found.append((found, n))
        keep = found.order[:n]  # parents before children: worth never grows down a path, ties go to the shallower
        index = {c: i + 1 for i, c in enumerate(keep)}
        parents = (-1, *(index[par[c]] if par[c] else 0 for c in keep))
        self._drafted.append((list(parents), [1.0] + [val[c] for c in keep], [0] + [slot[c] for c in keep]))
        tokens = torch.tensor([tok[c] for c in keep], dtype=torch.long, device=device)
        return Draft(tokens, from_parents(parents, device))

    def _row_candidates(self, h: torch.Tensor, sequence: torch.Tensor, verify_ms: list[float],
                        heads: bool = True) -> "Candidates":
        """This row's candidates (see _candidates_rows)."""
        return self._candidates_rows(h[None], [sequence], verify_ms, heads)[0]

    def _candidates_rows(self, hidden: torch.Tensor, sequences: list[torch.Tensor],
                         verify_ms: list[float], heads: bool = True) -> list["Candidates"]:
        """Each row's candidates for a step whose verify costs verify_ms (1..S tree tokens): the heads' level by
        level while a level could pay for the row (_worth_drafting), the lookup's and the phrasebook's merged in, and
        the S - 1 most valuable in order. A level runs once for all the rows that draft it (a head reads its weights
        once however many rows it scores: a drafting level is memory-bound). heads=False: the lookup's and the
        phrasebook's alone (DraftGate)."""
        device = hidden.device
        rows = [_Row(int(seq[-1])) for seq in sequences]
        for d in range(1, self.depth + 1 if heads else 1):
            for r in rows:  # a row that skips a level drafts no deeper one (its frontier would be a level short)
                if r.frontier and not self._worth_drafting(d, r.val, r.frontier, self._step_ms(verify_ms, r.levels)):
                    r.frontier = []
            drafting = [(b, r) for b, r in enumerate(rows) if r.frontier]
            if not drafting:
                break
            context = torch.tensor([r.paths[i] for _, r in drafting for i in r.frontier], device=device)  # (F, d)
            h = [hidden[b].expand(len(r.frontier), -1) for b, r in drafting]  # each parent's row state
            h = h[0] if len(h) == 1 else torch.cat(h)
            logits = self.heads.head_logits(d - 1, h, context)  # (F, V')
            probs, ranks = logits.float().softmax(-1).topk(self.topk, dim=-1)  # (F, k)
            ids = self.heads.token_ids(ranks).tolist()
            start = 0
            for _, r in drafting:
                part = slice(start, start + len(r.frontier))
                start = part.stop
                rates = self.correction.rates(d, self.acceptance(d, probs[part]))
                worth = (torch.tensor([r.val[i] for i in r.frontier])[:, None] * rates.cpu()).tolist()
                r.levels += 1
                level = []
                for f, (parent, row_ids) in enumerate(zip(r.frontier, ids[part])):
                    for j in range(self.topk):
                        level.append(len(r.tok))
                        r.tok.append(row_ids[j]), r.par.append(parent), r.val.append(worth[f][j]), r.slot.append(d)
                        r.paths.append(r.paths[parent] + [row_ids[j]])
                r.frontier = sorted(level, key=lambda i: -r.val[i])[: self.beam]
        out = []
        for r, sequence in zip(rows, sequences):
            if self.lookup_tokens or self.phrases is not None:
                self._merge_lookup(sequence, r.tok, r.par, r.val, r.slot, r.paths)
            order = sorted(range(1, len(r.tok)), key=lambda i: (-r.val[i], len(r.paths[i])))[: len(verify_ms) - 1]
            out.append(Candidates(r.tok, r.par, r.val, r.slot, order, [r.val[i] for i in order], r.levels, r.paths))
        return out

    def _step_ms(self, verify_ms: list[float], levels: int) -> list[float]:
        """The step's milliseconds with 1..max_size tree tokens after `levels` drafting levels: the loop's own work
        (cost.loop_ms: lookup, acceptance, commit) at every step, and what a tree adds to it (cost.overhead_ms) to
        trees alone, since a plain step builds, accepts and learns from none."""
        extra, tree = self.cost.loop_ms + levels * self.cost.draft_ms, self.cost.overhead_ms
        return [ms + extra + (tree if n else 0.0) for n, ms in enumerate(verify_ms)]

    def _worth_drafting(self, d: int, val: list[float], frontier: list[int], step_ms: list[float]) -> bool:
        """Whether drafting level d (and below) could change this step's tree: its nodes are worth at most
        w = (best frontier worth) x (the largest acceptance at depth d), so a tree that uses them yields at most
        1 + (the c candidates worth more than w) + w per further node, and costs at least one more level. If that
        bound per millisecond is no better than the best tree of the candidates at hand, stop here. Plain floats:
        it runs before every level, and a few dozen numbers cost less in Python than in tensor calls."""
        w = val[frontier[0]] * self.correction(d, self._top_rate[min(d, len(self._top_rate)) - 1])
        have = sorted(val[1:], reverse=True)[: len(step_ms) - 1]
        best, tau = 1.0 / step_ms[0], 1.0  # the best tree of the candidates at hand (tokens per ms), and its tau
        c, above = 0, 1.0  # the c candidates worth more than w (a prefix: have is sorted), 1 + their worth
        for n, v in enumerate(have, 1):
            tau += v
            best = max(best, tau / step_ms[n])
            if v > w:
                c, above = n, tau
        bound = max(((above + (m - c) * w) / (step_ms[m] + self.cost.draft_ms) for m in range(c + 1, len(step_ms))),
                    default=0.0)  # a tree of m nodes: the c, then m - c new ones worth at most w each
        return bound > best

    def _merge_lookup(self, sequence: torch.Tensor, tok: list[int], par: list[int], val: list[float],
                      slot: list[int], paths: list[list[int]]) -> None:
        """Each lookup continuation (lookup_branches of them, latest first) walks the drafted candidates while it
        repeats them, then hangs below as new candidates. Each token's rate given its parent, r, is the lookup's
        calibrated rate, capped by what the parent's other children leave (1 - the sum of their rates: the target
        takes one token, so a continuation that the heads or an earlier continuation contradict is worth little
        however long its n-gram). A new candidate is worth
        its parent's worth times r. Where the token repeats a drafted child that the heads rate h, the two are
        independent evidence for the same token: the child's rate becomes 1 - (1 - h)(1 - r) (a noisy OR), within
        the same cap, and its drafted subtree is rescaled with it: such children are accepted more often than the
        larger of h and r says."""
        children: dict[int, dict[int, int]] = {}
        for i in range(1, len(tok)):
            children.setdefault(par[i], {})[tok[i]] = i
        for found, rates, source in self._continuations(sequence):
            self._merge_chain(found, rates, tok, par, val, slot, paths, children, source)

    def _continuations(self, sequence: torch.Tensor) -> list[tuple[list[int], list[float], int]]:
        """The continuations to merge, each with its tokens' calibrated rates given their parents and its slot:
        prompt lookup's, then the phrasebook's (its j-th token rated at depth j by its confidence and matched
        length)."""
        out = []
        if self.lookup_tokens:
            found, ngram = lookup_continuations(sequence, self.lookup_tokens, self.max_ngram, self.min_ngram,
                                                self.branches)
            out += [(f.tolist(), self.lookup.chain(ngram, len(f)), 0) for f in found]
        if self.phrases is not None:
            found, confidence, orders = self.phrases.chain(sequence[-self.phrases.max_n:].tolist(),
                                                           self.phrase_acceptance.depth)
            if found:
                rates = [self.phrase_acceptance.rate(j, n, c) for j, (c, n) in enumerate(zip(confidence, orders), 1)]
                out.append((found, rates, self.phrase_slot))
        return out

    def _merge_chain(self, found: list[int], rates: list[float], tok: list[int], par: list[int], val: list[float],
                     slot: list[int], paths: list[list[int]], children: dict[int, dict[int, int]],
                     source: int = 0) -> None:
        """One continuation into the candidates (see _merge_lookup); `children` (parent -> token -> node) grows. Its
        new nodes are corrected online as slot `source` (0: prompt lookup)."""
        node = 0
        for token, rate in zip(found, rates):
            rate = self.correction(source, rate)
            siblings, base = children.get(node, {}), val[node]
            room = 1.0  # what the other drafted children leave
            if siblings and base > 0.0:
                room = max(1.0 - sum(val[c] for t, c in siblings.items() if t != token) / base, 0.0)
            rate = min(rate, room)
            child = siblings.get(token)
            if child is None:
                child = len(tok)
                tok.append(token), par.append(node), val.append(base * rate), slot.append(source)
                paths.append(paths[node] + [token])
                children.setdefault(node, {})[token] = child
            elif base > 0.0:
                heads = val[child] / base
                both = self.correction(self.raised[source], 1.0 - (1.0 - heads) * (1.0 - rate))
                both = max(min(both, room), heads)
                if both > heads:
                    val[child], slot[child] = base * both, self.raised[source]
                    _rescale(child, both / heads if heads > 0.0 else 0.0, val, children)
            node = child

    def update(self, accepted: list[torch.Tensor]) -> None:
        """Each accepted node's children predicted sum(rate) acceptances; one was observed if the path went on."""
        if self.gate is not None and self._step is not None:
            levels, step_ms, plain_ms = self._step
            self.gate.record(len(accepted[0]), step_ms / plain_ms if levels else None)
        for (parents, worth, slot), nodes in zip(self._drafted, accepted):
            nodes, trials = nodes.tolist(), []
            for depth, node in enumerate(nodes):
                nxt = nodes[depth + 1] if depth + 1 < len(nodes) else -1
                for child in (c for c in range(1, len(parents)) if parents[c] == node):
                    rate = worth[child] / max(worth[node], 1e-12)
                    self.correction.add(slot[child], rate, float(child == nxt))
                    trials.append((child, slot[child], rate, child == nxt))
            if self.observer is not None:
                self.observer.verified(nodes, trials)
        self.correction.fit()


class DraftGate:
    """Whether the heads draft at a step of one row. Each step's tree is the best the heads' calibrated rates
    predict, but drafting itself costs before any tree is chosen (a level a step, a few milliseconds: on llama.cpp's
    quantized steps a fifth of a plain step), and on text the heads know badly even their best trees yield fewer
    tokens per millisecond than plain steps. So the gate keeps the heads' recent record: the tokens their steps
    yielded against those steps' modelled cost in plain steps (the cost model's; never a live timing, so output and
    a seed's draws stay those of the tokens alone), decayed by DECAY a step. Where the tokens fall short of the cost,
    the heads rest for `wait` steps, in which the lookup and the phrasebook still draft (they cost next to nothing),
    and then draft again; each further shortfall doubles the wait (up to MAX_WAIT), a step that pays resets it."""

    DECAY = 0.75  # weight of a step's record after one more step (about the last four steps count)
    WAIT, MAX_WAIT = 2, 32  # steps the heads rest after their first shortfall, and at most

    def __init__(self) -> None:
        self.tokens = self.cost = 0.0  # decayed sums over the heads' steps: tokens yielded, cost in plain steps
        self.resting, self.wait = 0, self.WAIT

    def open(self) -> bool:
        return self.resting == 0

    def record(self, tokens: int, cost: float | None) -> None:
        """A step's tokens (the accepted path and the target's own token) and its modelled cost in plain steps,
        None where the heads did not draft it."""
        self.tokens, self.cost = self.tokens * self.DECAY, self.cost * self.DECAY
        if cost is None:
            self.resting = max(self.resting - 1, 0)
            return
        self.tokens, self.cost = self.tokens + tokens, self.cost + cost
        if self.tokens < self.cost:
            self.resting, self.wait = self.wait, min(2 * self.wait, self.MAX_WAIT)
        else:
            self.wait = self.WAIT


class DraftObserver:
    """What a per-step drafter shows of each step, for measurements outside the library (experiments/): subclass
    it and pass it as AdaptiveDrafter(..., observer=...). It sees; it changes nothing."""

    def drafted(self, sequence: torch.Tensor, candidates: "Candidates", kept: int) -> None:
        """A row's step: its tokens so far (the root last), every candidate it scored, and how many of them (the first
        `kept` of candidates.order) its tree keeps: kept node i (1-based) is candidates.order[i - 1]."""

    def verified(self, accepted: list[int], trials: list[tuple[int, int, float, bool]]) -> None:
        """After the verify, for the same row: its accepted nodes (root first), and each trial that corrects the
        rates: (kept node, its slot, the rate it was drafted at, whether the target accepted it) for every kept
        node whose parent was accepted."""


@dataclass
class Candidates:
    """One row's candidates for a step (node 0 is the root): token, parent, worth and slot of each, the best
    S - 1 of them in order (`order`, parents before children) with their worth (`values`), the drafting
    levels run, and each candidate's path."""

    tok: list[int]
    par: list[int]
    val: list[float]
    slot: list[int]
    order: list[int]
    values: list[float]
    levels: int
    paths: list[list[int]] = field(default_factory=list)  # each candidate's tokens from the root (the root's first)


class _Row:
    """A row's candidates while its levels are drafted: node 0 is the root; `paths` holds each candidate's tokens
    from the root (the drafted ones: the lookup's come after), `frontier` the parents of the next level."""

    def __init__(self, root: int) -> None:
        self.tok, self.par, self.val, self.slot = [root], [-1], [1.0], [0]
        self.paths = [[root]]
        self.frontier, self.levels = [0], 0


def _rescale(node: int, factor: float, val: list[float], children: dict[int, dict[int, int]]) -> None:
    """Multiplies the worth of `node`'s descendants by `factor` (their rates given their parents stand), each at
    most its parent's: selection relies on worth never growing down a path, which rounding must not break."""
    stack = [(c, node) for c in children.get(node, {}).values()]
    while stack:
        c, parent = stack.pop()
        val[c] = min(val[c] * factor, val[parent])
        stack += [(g, c) for g in children.get(c, {}).values()]
