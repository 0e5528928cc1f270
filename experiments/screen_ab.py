"""One process, the greedy verify's argmax through the LM head's bf16 screen (medusa_heads/kernels/screen.py) against the full
fp32 LM head, alternating per prompt (which goes first alternates too), the shipped heads and per-step tree.

    python experiments/screen_ab.py --prompts data/bench_prompts.jsonl data/bench_prompts_fresh.jsonl \
        data/bench_prompts_new.jsonl --out results/ab/screen_ab.md
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from common import emit, greedy_pass  # noqa: E402

from medusa_heads.prompting import prompt_ids  # noqa: E402


def main() -> None:
    args, model, tok, rows = greedy_pass(__doc__)
    screen = model.target.screen
    runs = {"full": [], "screen": []}  # (seconds, new tokens, steps, ids)

    def run(name: str, ids: torch.Tensor):
        screen.enabled = name == "screen"
        t = time.perf_counter()
        res = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                             return_dict_in_generate=True)
        runs[name].append((time.perf_counter() - t, res.stats.new_tokens, res.stats.steps, res.sequences))

    run("screen", prompt_ids(tok, rows[0][1].turns[0]))  # warm-up: builds the screen
    runs["screen"].clear()
    for i, (_, row) in enumerate(rows):
        ids = prompt_ids(tok, row.turns[0])
        order = ("full", "screen") if i % 2 == 0 else ("screen", "full")
        for name in order:
            run(name, ids)
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
