"""The row-exact attention's per-row values: one gather of the whole width (the first build) against the cached
prefix copied as one broadcast and only the rest gathered (kept), alternating per prompt in one process, bf16,
greedy; `generate` as the yardstick. Both must give the same tokens.

    python -m experiments.exact_gather_ab [--prompts data/bench_prompts.jsonl] [--out results/ab/exact_gather_ab.md]
"""
from __future__ import annotations

from pathlib import Path

import torch

from medusa_heads import MedusaModel, default_model_path, prompt_ids
from medusa_heads.machine import cpu_name
from medusa_heads.cli.commands import _read_prompts
from medusa_heads.kernels import exact_attention

from experiments.ab_loop import alternate
from scripts.common import parser

KEPT = exact_attention._row_values


def whole_width(values, order, shared, t):  # the first build: every row's whole width gathered
    return values[:, order]


def main() -> None:
    ap = parser(__doc__.split("\n\n")[0], "prompts", "max_new_tokens", out="results/ab/exact_gather_ab.md")
    args = ap.parse_args()
    torch.set_num_threads(2)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path())
    model = MedusaModel.from_pretrained(dtype=torch.bfloat16)
    base = model.base_model
    rows = _read_prompts(args.prompts)

    def run(values):
        def arm(ids):
            if values is None:
                return base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                     do_sample=False)
            exact_attention._row_values = values
            return model.generate(ids, max_new_tokens=args.max_new_tokens)
        return arm

    arms = {"hf": run(None), "whole width gathered": run(whole_width), "prefix broadcast (kept)": run(KEPT)}
    model.generate(prompt_ids(tok, "Hello"), max_new_tokens=8)
    try:
        tps, differ = alternate(tok, rows, arms)
    finally:
        exact_attention._row_values = KEPT
    lines = ["# The row-exact attention's per-row values: whole width gathered against prefix broadcast", "",
             f"{cpu_name()}, 2 threads, bf16, shipped heads, {len(rows)} prompts of `{args.prompts}`, "
             f"{args.max_new_tokens} new tokens, greedy, alternating per prompt in one process "
             "(`python -m experiments.exact_gather_ab`).", "",
             "| values | tokens/s | × generate | outputs differing from generate |", "|---|---|---|---|"]
    for arm in arms:
        lines.append(f"| {arm} | {tps[arm]:.1f} | {tps[arm] / tps['hf']:.2f} | {differ[arm]} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
