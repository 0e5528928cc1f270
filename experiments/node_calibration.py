#!/usr/bin/env python
"""How often the per-step tree's kept nodes are accepted against what it rated them, by source (a head at depth d,
or prompt lookup by how it met the heads' candidates), greedy: every kept node whose parent was accepted is one
trial of its conditional rate (the rate its worth was built from, the call's online correction included).

    python -m experiments.node_calibration --prompts data/bench_prompts.jsonl --limit 12 --out results/x/nodes.md

Prints the table and writes it as Markdown to --out. A source whose rates sit above what it was accepted at makes
trees larger than they are worth."""
from __future__ import annotations

from collections import defaultdict

import torch
from tqdm import tqdm

from medusa_heads import prompt_ids
from medusa_heads.inference.adaptive import DraftObserver
from scripts.common import emit, greedy_pass

EDGES = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0001)
KINDS = {0: "lookup below no drafted child", -1: "lookup against the heads", -2: "lookup = a head's"}


def source(kind: int) -> str:
    """What drafted a node: a head at depth `kind`, or prompt lookup of a kind that Trials marks."""
    return KINDS.get(kind, f"head {kind}")


class Trials(DraftObserver):
    """Every (source, predicted rate, accepted) the drafter's online correction is given after a verify (one per kept
    node whose parent was accepted). A lookup node is marked by how it met the heads' candidates: a new node under a
    parent with drafted children (-1: the heads drafted other tokens there), under one without (0), or a drafted
    child the lookup repeated and raised (-2)."""

    def __init__(self, repeat_slot: int) -> None:
        self.repeat_slot = repeat_slot
        self.trials: list[tuple[int, float, bool]] = []
        self._kinds: list[int] = []

    def drafted(self, sequence, candidates, kept):
        heads = {candidates.par[i] for i in range(1, len(candidates.tok)) if candidates.slot[i] > 0}
        self._kinds = [0]
        for i in candidates.order[:kept]:
            slot = candidates.slot[i]
            if slot == self.repeat_slot:
                slot = -2
            elif slot == 0:
                slot = -1 if candidates.par[i] in heads else 0
            self._kinds.append(slot)

    def verified(self, accepted, trials):
        self.trials += [(self._kinds[node], rate, hit) for node, _, rate, hit in trials]


def main() -> None:
    args, model, tok, rows = greedy_pass(__doc__)
    trials: list[tuple[int, float, bool]] = []  # (a head's depth, or a lookup kind; conditional rate; accepted)
    for _, row in tqdm(rows, desc="nodes", unit="prompt"):
        seen = Trials(model.config.num_heads + 1)  # AdaptiveDrafter's slot of the children the lookup raised
        drafter = model.adaptive_drafter(model.config.lookup_tokens, greedy=True, observer=seen)  # as generate makes it
        ids = prompt_ids(tok, row.turns[0])
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, do_sample=False,
                       drafter=drafter, prompt_lookup_num_tokens=0)
        trials += seen.trials

    table = defaultdict(lambda: [0, 0.0, 0])  # (source, bin) -> [n, sum rate, accepted]
    for slot, rate, hit in trials:
        b = next(i for i in range(len(EDGES) - 1) if rate < EDGES[i + 1])
        for key in ((source(slot), b), (source(slot), None)):
            t = table[key]
            t[0] += 1
            t[1] += rate
            t[2] += int(hit)
    lines = [f"Kept nodes whose parent was accepted: rated (conditional rate, online correction included) against "
             f"accepted; {len(rows)} prompts ({', '.join(args.prompts)}{f', the first {args.limit} of each' if args.limit else ''}), "
             f"greedy, {args.max_new_tokens} new tokens, {model.cost_model_key()} cost model.", "",
             "| source | rate bin | nodes | rated | accepted |", "|---|---|---|---|---|"]
    for name in sorted({s for s, _ in table}, key=lambda s: (s.startswith("head"), s)):
        for b in [*range(len(EDGES) - 1), None]:
            if (name, b) not in table:
                continue
            n, rated, hit = table[(name, b)]
            span = "all" if b is None else f"{EDGES[b]:.2f}–{min(EDGES[b + 1], 1.0):.2f}"
            lines.append(f"| {name} | {span} | {n} | {rated / n:.3f} | {hit / n:.3f} |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
