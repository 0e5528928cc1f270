#!/usr/bin/env python
"""How often the per-step tree's kept nodes are accepted against what it rated them, by source (a head at depth d,
or prompt lookup by how it met the heads' candidates), greedy: every kept node whose parent was accepted is one
trial of its conditional rate (the rate its worth was built from, the call's online correction included).

    python scripts/node_calibration.py --prompts data/bench_prompts.jsonl --limit 12 --out results/x/nodes.md

Prints the table and writes it as Markdown to --out. A source whose rates sit above what it was accepted at makes
trees larger than they are worth."""
from __future__ import annotations

from collections import defaultdict

import torch
from tqdm import tqdm

from medusa_heads import prompt_ids
from medusa_heads.inference.adaptive import AdaptiveDrafter, Correction
from common import emit, greedy_pass  # scripts/common.py: this script's folder is on the path

EDGES = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0001)


KINDS = {0: "lookup below no drafted child", -1: "lookup against the heads", -2: "lookup = a head's"}


def source(slot: int) -> str:
    """What drafted a node: a head at depth `slot`, or prompt lookup of a kind that `record` marks."""
    return KINDS.get(slot, f"head {slot}")


def record(trials: list[tuple[int, float, bool]]) -> None:
    """Marks each lookup node by how it met the heads' candidates: a new node under a parent with drafted children
    (-1: the heads drafted other tokens there), a new node under one without (0), or a drafted child the lookup
    repeated and raised (-2). The drafter's online correction keeps its own slots (the lookup's new nodes pooled,
    the raised children apart). Every (slot, predicted rate, observed) the correction is given after a verify
    (AdaptiveDrafter.update: one per kept node whose parent was accepted) is appended to `trials`."""
    merge, add = AdaptiveDrafter._merge_lookup, Correction.add

    def tagged(self, sequence, tok, par, val, slot, paths):
        before, drafted_parents = len(tok), set(par[1:])
        merge(self, sequence, tok, par, val, slot, paths)
        for i in range(1, len(tok)):
            if i >= before:
                slot[i] = -1 if par[i] in drafted_parents else 0
            elif slot[i] == self.repeat:
                slot[i] = -2

    def drafter_slot(correction: Correction, slot: int) -> int:
        return len(correction.shift) - 1 if slot == -2 else max(slot, 0)  # -2: the raised children's slot

    def recorded(self, slot, predicted, observed):
        trials.append((slot, predicted, bool(observed)))
        add(self, drafter_slot(self, slot), predicted, observed)

    AdaptiveDrafter._merge_lookup = tagged
    Correction.add = recorded


def main() -> None:
    args, model, tok, rows = greedy_pass(__doc__)
    trials: list[tuple[int, float, bool]] = []  # (slot: a head's depth, or a lookup kind; conditional rate; accepted)
    record(trials)
    for _, row in tqdm(rows, desc="nodes", unit="prompt"):
        ids = prompt_ids(tok, row.turns[0])
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, do_sample=False)

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
