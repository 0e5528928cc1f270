#!/usr/bin/env python
"""bf16 batches with and without the row cap (medusa_heads/kernels/exactness.py: cap_rows), in one process, alternating per
batch, with transformers' batched `generate` on the same model as the reference and the yardstick: what splitting
products past the rows where oneDNN's bf16 kernel changes a row's bits costs, and what it buys (rows whose greedy
output leaves generate's). Each build's heads are compared with `generate` on that build's kernels: the split also
changes the bits of a prefill of more rows than the cap, so `generate` is timed, and read, on both.

    python -m experiments.row_cap_ab --batch-sizes 4,8 --limit 16 --out results/ab/row_cap_ab.md
"""
from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from medusa_heads import MedusaModel, default_model_path
from medusa_heads.calibration.timing import alternate
from medusa_heads.machine import cpu_name
from medusa_heads.kernels.exactness import _products
from medusa_heads.prompting import eos_ids, prompt_text, user_turn
from scripts.common import emit, parser


def answer(row: torch.Tensor, start: int, eos: set[int]) -> list[int]:
    """A row's new tokens up to its first EOS (generate pads after it; the heads may stop there)."""
    out = row[start:].tolist()
    return next((out[:i] for i, t in enumerate(out) if t in eos), out)


def main() -> None:
    ap = parser(__doc__.split("\n\n")[0], "prompts", "max_new_tokens", "threads", limit=16,
                out="results/ab/row_cap_ab.md")
    ap.add_argument("--batch-sizes", default="4,8")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = MedusaModel.from_pretrained(dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(default_model_path())
    tok.padding_side = "left"
    eos = set(eos_ids(tok, model.base_model.generation_config))
    kernels = [k for k in _products(model.base_model) if k.row_cap is not None]
    caps = {id(k): k.row_cap for k in kernels}

    def capped(on: bool) -> None:
        for k in kernels:
            k.row_cap = caps[id(k)] if on else None

    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    texts = [prompt_text(tok, user_turn(r["prompt"])) for r in rows if "prompt" in r][: args.limit]
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    arms = ["generate, capped", "capped", "generate, uncapped", "uncapped"]
    reference = {"capped": "generate, capped", "uncapped": "generate, uncapped"}
    print(f"{len(texts)} prompts in batches of {sizes}, {len(arms)} arms, {args.max_new_tokens} tokens: about "
          f"{len(sizes) * len(arms) * len(texts) * args.max_new_tokens // 60 // 25 + 1} minutes on two cores", file=sys.stderr)
    def call(arm: str, enc):
        if arm.startswith("generate"):
            return model.base_model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False)
        return model.generate(enc["input_ids"], attention_mask=enc["attention_mask"],
                              max_new_tokens=args.max_new_tokens, do_sample=False)

    table = []
    for size in sizes:
        secs, tokens, differ = {a: 0.0 for a in arms}, {a: 0 for a in arms}, {a: 0 for a in arms}
        batches = [texts[i : i + size] for i in range(0, len(texts), size)]
        encs = (tok(batch, return_tensors="pt", padding=True, add_special_tokens=False)
                for batch in tqdm(batches, desc=f"batches of {size}"))
        for enc, results in alternate({arm: partial(call, arm) for arm in arms}, encs, rotate=True,  # each arm first in turn
                                      before=lambda arm: capped(not arm.endswith("uncapped"))):
            start = enc["input_ids"].shape[1]
            outs = {}
            for arm, (out, seconds) in results.items():
                secs[arm] += seconds
                outs[arm] = [answer(r, start, eos) for r in out]
                tokens[arm] += sum(len(a) for a in outs[arm])
            capped(True)
            for arm, ref in reference.items():
                differ[arm] += sum(a != b for a, b in zip(outs[arm], outs[ref]))
        speed = {a: tokens[a] / secs[a] for a in arms}
        table.append((size, speed, differ, len(texts)))
    lines = ["# bf16 batches with and without the row cap", "",
             f"{cpu_name()}, {args.threads} threads, SmolLM2-135M-Instruct in bf16 with the row-exact attention and "
             f"the shipped heads, {len(texts)} bench prompts, {args.max_new_tokens} new tokens, greedy, arms "
             "alternating per batch in one process (`python -m experiments.row_cap_ab`). Capped: each bf16 product "
             "split at the rows found by `cap_rows` (" + ", ".join(sorted({str(c) for c in caps.values()})) +
             " here, the build); uncapped: the build before.", "",
             "| rows | `generate`, capped | heads, capped | `generate`, uncapped | heads, uncapped | heads: capped / "
             "uncapped | rows differing from their `generate`: capped, uncapped |",
             "|---|---|---|---|---|---|---|"]
    for size, speed, differ, n in table:
        gc, gu = speed["generate, capped"], speed["generate, uncapped"]
        lines.append(f"| {size} | {gc:.1f} | {speed['capped']:.1f} ({speed['capped'] / gc:.2f}×) | {gu:.1f} | "
                     f"{speed['uncapped']:.1f} ({speed['uncapped'] / gu:.2f}×) | "
                     f"{speed['capped'] / speed['uncapped']:.3f} | {differ['capped']}/{n}, {differ['uncapped']}/{n} |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
