#!/usr/bin/env python
"""How much of τ the per-step tree's selection leaves on the table, greedy: at each step, the target's own
continuation (known once the answer is done) is matched against the kept tree and against every candidate the
drafter scored (heads and lookup, before the selection).

    python -m experiments.tree_headroom --prompts data/bench_prompts.jsonl --limit 12 --out results/x/headroom.md

Per step: kept = the accepted length (drafted tokens the target took); candidates = the longest prefix of the
target's continuation that is a path among the candidates; at the kept size = the same, at most the kept tree's
size (an oracle that knew the continuation and kept only its path, at the same verify cost). τ is 1 + the mean.
If "at the kept size" is far above "kept", better selection could pay; if it is close, the candidates are the
limit (the heads, and the lookup)."""
from __future__ import annotations

import torch
from tqdm import tqdm

from medusa_heads import prompt_ids
from medusa_heads.inference.adaptive import DraftObserver
from scripts.common import emit, greedy_pass


class Headroom(DraftObserver):
    """Each step's root position, candidate paths (each a tuple of drafted tokens below the root), kept paths and
    each candidate's rank among its parent's candidates by worth (1: the most), one row of one call at a time."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def drafted(self, sequence, candidates, kept):
        paths = [tuple(p[1:]) for p in candidates.paths]
        siblings: dict[int, list[int]] = {}
        for i in range(1, len(candidates.tok)):
            siblings.setdefault(candidates.par[i], []).append(i)
        rank = {}
        for kids in siblings.values():
            for r, i in enumerate(sorted(kids, key=lambda i: -candidates.val[i]), 1):
                rank[paths[i]] = r
        chosen = {paths[i] for i in candidates.order[:kept]}
        self.steps.append({"root": sequence.shape[0] - 1, "candidates": set(paths[1:]) | chosen, "kept": chosen,
                           "rank": rank})


def matched(paths: set[tuple[int, ...]], continuation: list[int]) -> int:
    """The longest prefix of `continuation` that is a path in `paths` (prefix-closed sets)."""
    n = 0
    while n < len(continuation) and tuple(continuation[: n + 1]) in paths:
        n += 1
    return n


def main() -> None:
    args, model, tok, rows = greedy_pass(__doc__)
    totals: dict[str, list[float]] = {}  # file -> [steps, kept, candidates, at the kept size, kept nodes]
    misses: dict[tuple[int, str], int] = {}  # (depth, how) -> steps whose kept tree leaves the path there, a candidate not
    for name, row in tqdm(rows, desc="headroom", unit="prompt"):
        seen = Headroom()
        drafter = model.adaptive_drafter(model.config.lookup_tokens, greedy=True, observer=seen)  # as generate makes it
        ids = prompt_ids(tok, row.turns[0])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                             do_sample=False, drafter=drafter, prompt_lookup_num_tokens=0)[0].tolist()
        for s in seen.steps:  # each step matched once, counted for its file and for all
            continuation = out[s["root"] + 1 :]
            have, could, size = matched(s["kept"], continuation), matched(s["candidates"], continuation), len(s["kept"])
            for t in (totals.setdefault(name, [0.0] * 5), totals.setdefault("all", [0.0] * 5)):
                t[0], t[1], t[2], t[3], t[4] = t[0] + 1, t[1] + have, t[2] + could, t[3] + min(could, size), t[4] + size
            if could > have:
                below = [k for k in s["kept"] if len(k) == have + 1 and k[:have] == tuple(continuation[:have])]
                rank = s["rank"].get(tuple(continuation[: have + 1]), 0)
                how = f"other children kept, the right one ranked {rank}" if below else "no child kept there"
                misses[(have + 1, how)] = misses.get((have + 1, how), 0) + 1
    lines = [f"The target's own continuation against the kept tree and against every candidate, greedy, "
             f"{args.max_new_tokens} new tokens, {model.cost_model_key()} cost model; τ = 1 + mean matched length.", "",
             "| prompts | steps | kept nodes | τ kept | τ oracle at the kept size | τ oracle over all candidates |",
             "|---|---|---|---|---|---|"]
    for name, (n, kept, cand, same, nodes) in sorted(totals.items(), key=lambda kv: kv[0] == "all"):
        lines.append(f"| {name} | {int(n)} | {nodes / n:.1f} | {1 + kept / n:.2f} | {1 + same / n:.2f} | {1 + cand / n:.2f} |")
    lines += ["", "Steps whose kept tree leaves the target's path where a candidate follows it, by the depth it leaves "
              "at and how (the rank is by worth among the parent's candidates):", "",
              "| depth | how | steps |", "|---|---|---|"]
    lines += [f"| {d} | {how} | {n} |" for (d, how), n in sorted(misses.items())]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
