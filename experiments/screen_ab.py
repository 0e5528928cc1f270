"""One process, the greedy verify's argmax through the LM head's bf16 screen (medusa_heads/kernels/screen.py) against the full
fp32 LM head, alternating per prompt (which goes first alternates too), the shipped heads and per-step tree.

    python -m experiments.screen_ab --prompts data/bench_prompts.jsonl data/bench_prompts_fresh.jsonl \
        data/bench_prompts_new.jsonl --out results/ab/screen_ab.md
"""
from __future__ import annotations

import torch

from experiments.ab_loop import settings_ab
from scripts.common import emit, greedy_pass


def main() -> None:
    args, model, tok, rows = greedy_pass(__doc__)
    screen = model.target.screen

    def switch(name: str) -> None:
        screen.enabled = name == "screen"

    timed = settings_ab(model, tok, rows, ["full", "screen"], switch, "screen", args.max_new_tokens)  # warm: builds the screen
    runs = {name: [(seconds, res.stats.new_tokens, res.stats.steps, res.sequences) for seconds, res in r]
            for name, r in timed.items()}  # (seconds, new tokens, steps, ids)
    same = sum(torch.equal(a[3], b[3]) for a, b in zip(runs["full"], runs["screen"]))
    kernels = "stock" if args.no_prepack else "prepacked"
    lines = [f"{len(rows)} prompts, greedy, {args.max_new_tokens} new tokens, {kernels} kernels, {args.threads} threads, "
             f"one process, alternating; identical outputs: {same}/{len(rows)}", "",
             "| LM head at the verify | seconds | tokens/s | tau | speed vs full |", "|---|---|---|---|---|"]
    base = None
    for name, r in runs.items():
        sec, new, steps = sum(x[0] for x in r), sum(x[1] for x in r), sum(x[2] for x in r)
        base = base or new / sec
        lines.append(f"| {name} | {sec:.1f} | {new / sec:.2f} | {new / steps:.2f} | {new / sec / base:.3f} |")
    per = sorted(b[0] / a[0] for a, b in zip(runs["screen"], runs["full"]))
    lines.append("")
    lines.append(f"per prompt, full time / screen time: median {per[len(per) // 2]:.3f}, min {per[0]:.3f}, max {per[-1]:.3f}")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
