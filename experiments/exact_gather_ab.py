"""The row-exact attention's per-row values: one gather of the whole width (the first build) against the cached
prefix copied as one broadcast and only the rest gathered (kept), alternating per prompt in one process, bf16,
greedy; `generate` as the yardstick. Both must give the same tokens.

    python experiments/exact_gather_ab.py [--prompts data/bench_prompts.jsonl] [--out results/ab/exact_gather_ab.md]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm import tqdm

from medusa_heads import MedusaModel, default_model_path, prompt_ids
from medusa_heads.calibration.machine import cpu_name
from medusa_heads.cli.commands import _read_prompts
from medusa_heads.inference import exact_attention

KEPT = exact_attention._row_values


def whole_width(values, order, shared, t):  # the first build: every row's whole width gathered
    return values[:, order]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default="data/bench_prompts.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="results/ab/exact_gather_ab.md")
    args = ap.parse_args()
    torch.set_num_threads(2)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path())
    model = MedusaModel.from_pretrained(dtype=torch.bfloat16)
    base = model.base_model
    rows = _read_prompts(args.prompts)
    arms = {"hf": None, "whole width gathered": whole_width, "prefix broadcast (kept)": KEPT}
    secs, tokens, differ = ({a: 0.0 for a in arms}, {a: 0 for a in arms}, {a: 0 for a in arms})
    model.generate(prompt_ids(tok, "Hello"), max_new_tokens=8)
    for i, row in enumerate(tqdm(rows, desc="A/B", unit="prompt")):
        ids = prompt_ids(tok, row.turns[0])
        outs = {}
        for arm in (list(arms) if i % 2 == 0 else list(arms)[::-1]):
            t0 = time.perf_counter()
            if arms[arm] is None:
                out = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                    do_sample=False)
            else:
                exact_attention._row_values = arms[arm]
                out = model.generate(ids, max_new_tokens=args.max_new_tokens)
            secs[arm] += time.perf_counter() - t0
            tokens[arm] += out.shape[1] - ids.shape[1]
            outs[arm] = out
        for arm in arms:
            differ[arm] += not torch.equal(outs[arm], outs["hf"])
    exact_attention._row_values = KEPT
    hf = tokens["hf"] / secs["hf"]
    lines = ["# The row-exact attention's per-row values: whole width gathered against prefix broadcast", "",
             f"{cpu_name()}, 2 threads, bf16, shipped heads, {len(rows)} prompts of `{args.prompts}`, "
             f"{args.max_new_tokens} new tokens, greedy, alternating per prompt in one process "
             "(`python experiments/exact_gather_ab.py`).", "",
             "| values | tokens/s | × generate | outputs differing from generate |", "|---|---|---|---|"]
    for arm in arms:
        tps = tokens[arm] / secs[arm]
        lines.append(f"| {arm} | {tps:.1f} | {tps / hf:.2f} | {differ[arm]} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
