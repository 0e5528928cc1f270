"""One process, greedy steps sized by the greedy verify's own cost table (CostModel.greedy: the screen, no LM head)
against the full verify's table, alternating per prompt (which goes first alternates too), the shipped heads and
per-step tree; the screen runs in both (only the trees' sizing differs).

    python -m experiments.greedy_cost_ab --prompts data/bench_prompts.jsonl --no-prepack --out FILE
"""
from __future__ import annotations

import copy

import torch

from experiments.ab_loop import settings_ab
from scripts.common import emit, greedy_pass


def main() -> None:
    args, model, tok, rows = greedy_pass(__doc__)
    key = model.cost_model_key()
    stored = model.config.adaptive
    if "greedy" not in stored["cost"][key]:
        raise SystemExit(f"the heads have no greedy cost for {key}: medusa-heads calibrate --parts greedy")
    without = copy.deepcopy(stored)
    del without["cost"][key]["greedy"]
    configs = {"full table": without, "greedy table": stored}

    def use(name: str) -> None:
        model.config.adaptive = configs[name]

    timed = settings_ab(model, tok, rows, list(configs), use, "greedy table", args.max_new_tokens)  # warm: builds the screen
    runs = {name: [(seconds, res.stats.new_tokens, res.stats.steps, res.sequences, res.stats.tree_sizes)
                   for seconds, res in r] for name, r in timed.items()}  # (seconds, new tokens, steps, ids, tree sizes)
    a, b = runs.values()
    same = sum(torch.equal(x[3], y[3]) for x, y in zip(a, b))
    kernels = "stock" if args.no_prepack else "prepacked"
    lines = [f"{len(rows)} prompts, greedy, {args.max_new_tokens} new tokens, {kernels} kernels ({key}), "
             f"{args.threads} threads, one process, alternating; identical outputs: {same}/{len(rows)}", "",
             "| trees sized by | seconds | tokens/s | tau | mean drafted nodes | speed vs full table |",
             "|---|---|---|---|---|---|"]
    base = None
    for name, r in runs.items():
        sec, new, steps = sum(x[0] for x in r), sum(x[1] for x in r), sum(x[2] for x in r)
        sizes = [s for x in r for s in x[4]]
        base = base or new / sec
        lines.append(f"| {name} | {sec:.1f} | {new / sec:.2f} | {new / steps:.2f} | {sum(sizes) / len(sizes):.2f} | "
                     f"{new / sec / base:.3f} |")
    per = sorted(x[0] / y[0] for x, y in zip(a, b))
    lines += ["", f"per prompt, full-table time / greedy-table time: median {per[len(per) // 2]:.3f}, "
                  f"min {per[0]:.3f}, max {per[-1]:.3f}"]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
