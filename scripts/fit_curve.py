#!/usr/bin/env python
"""What a `fit` budget buys: fresh heads at each budget, then all of them beside the shipped heads in one process.

    python -m scripts.fit_curve --budgets 6m 30m 1h 2h

For each budget B it runs `medusa-heads fit --budget B --out runs/fit-B` (skipped where runs/fit-B holds a finished
fit; a run that was stopped continues), one after another and nothing else beside them: their budgets are wall
clock. Then `scripts/heads_ab.py` runs the shipped heads and every budget's heads against generate on the bench
prompts (128 new tokens, alternating per prompt). Writes into --out: each budget's report.md / report.json /
train_log.jsonl / train_plot.png (B/), ab.md and ab.json, and curve.md / curve.json / curve.png: per budget the wall
clock, what it bought, its own bench, and its speed-up in the A/B as a share of the shipped heads' gain over
generate."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from scripts.common import parser

SHIPPED = "medusa_heads/default_heads"


def seconds(budget: str) -> float:
    from medusa_heads.training.fit import parse_budget

    return parse_budget(budget)


def main() -> None:
    p = parser(__doc__, "model", prompts=["data/bench_prompts.jsonl"], out="results/training/fit")
    p.add_argument("--budgets", nargs="+", default=["6m", "30m", "1h", "2h"])
    p.add_argument("--runs", default="runs", help="the fits go to RUNS/fit-<budget>")
    p.add_argument("--skip-ab", action="store_true", help="only the fits (the A/B of an earlier run stays)")
    args = p.parse_args()
    for b in args.budgets:
        seconds(b)  # a bad budget is refused before any work
    out, runs = Path(args.out), {b: Path(args.runs) / f"fit-{b}" for b in args.budgets}
    todo = [b for b in args.budgets if not (runs[b] / "report.json").is_file()]
    print(f"fit at {', '.join(todo) or 'no budget'} (about {sum(map(seconds, todo)) / 60:.0f} min, one after another), "
          f"{'then an A/B of ' + str(len(args.budgets) + 1) + ' heads (about 10 min)' if not args.skip_ab else 'no A/B'}",
          flush=True)
    for b in todo:
        print(f"fit --budget {b} --out {runs[b]}", flush=True)
        subprocess.run([sys.executable, "-m", "medusa_heads.cli", "fit", "--model", args.model, "--budget", b,
                        "--out", str(runs[b])], check=True)
    for b in args.budgets:
        (out / b).mkdir(parents=True, exist_ok=True)
        for name in ("report.md", "report.json", "train_log.jsonl", "train_plot.png"):
            shutil.copy(runs[b] / name, out / b / name)
    if not args.skip_ab:
        subprocess.run([sys.executable, "-m", "scripts.heads_ab", "--model", args.model, "--heads", SHIPPED,
                        *map(str, runs.values()), "--prompts", *args.prompts, "--out", str(out / "ab.md"),
                        "--json", str(out / "ab.json")], check=True)
    ab = json.loads((out / "ab.json").read_text())["heads"]
    shipped = ab[SHIPPED]
    rows = []
    for b in args.budgets:
        r, a = json.loads((out / b / "report.json").read_text()), ab.get(str(runs[b]))
        rows.append({"budget": b, "budget_s": r["budget_s"], "spent_s": r["spent_s"], "answers": r["answers"],
                     "train_tokens": r["train_tokens"], "steps": r["steps"], "held_out_top1": r["held_out_top1"],
                     "own_bench": r["bench"], "ab": a,
                     "share_of_gain": (a["speedup"] - 1) / (shipped["speedup"] - 1) if a else None})
    (out / "curve.json").write_text(json.dumps({"model": args.model, "shipped": shipped, "budgets": rows}, indent=1) + "\n")
    md = [f"# What a `fit` budget buys: {args.model}", "",
          f"`python -m scripts.fit_curve --budgets {' '.join(args.budgets)}`. Speed-up and τ from one A/B "
          f"(`ab.md`: {shipped['prompts']} prompts of {', '.join(args.prompts)}, 128 new tokens, greedy); the shipped "
          f"heads there: **{shipped['speedup']:.2f}×**, τ {shipped['tau']:.2f}.", "",
          "| budget | wall clock | answers (greedy + sampled) | answer tokens | steps | held-out top-1, head 1 | "
          "speed-up | τ | of the shipped heads' gain | identical |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a = r["ab"] or {}
        md.append(f"| {r['budget']} | {r['spent_s'] / 60:.1f} min | {r['answers']['greedy']} + {r['answers']['sampled']} "
                  f"| {r['train_tokens']:,} | {r['steps']} | {r['held_out_top1'][0]:.3f} | "
                  + (f"{a['speedup']:.2f}× | {a['tau']:.2f} | {100 * r['share_of_gain']:.0f}% | {a['identical']}/{a['prompts']} |"
                     if a else "– | – | – | – |"))
    (out / "curve.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    plot(rows, shipped, out / "curve.png", args.model)


def plot(rows: list[dict], shipped: dict, png: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [(r["budget_s"] / 60, r["ab"]["speedup"]) for r in rows if r["ab"]]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", label="fit at this budget")
    ax.axhline(shipped["speedup"], color="gray", ls="--", label="the shipped heads")
    ax.axhline(1.0, color="black", lw=0.6)
    for r in rows:
        if r["ab"]:
            ax.annotate(r["budget"], (r["budget_s"] / 60, r["ab"]["speedup"]), textcoords="offset points", xytext=(4, -12))
    ax.set_xscale("log")
    ax.set_xlabel("budget (minutes, wall clock, this machine)")
    ax.set_ylabel("speed-up over generate")
    ax.set_title(f"fit: {model}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main()
