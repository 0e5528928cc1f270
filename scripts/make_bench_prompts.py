"""Write data/bench_prompts.jsonl: prompts the shipped heads never trained on, by category.

Held out are (a) rows of the training file in the trainer's evaluation split (a hash of their id, fraction 0.05)
and (b) GSM8K rows left out by the distillation cap. Run from the repo root:
    python -m scripts.make_bench_prompts data/train_prompts.jsonl.gz --per-category 3
"""
from __future__ import annotations

import json
import random

from medusa_heads.corpus import read_prompts, subsample
from medusa_heads.corpus import is_eval
from scripts.common import parser

CATEGORY = {
    "gsm8k-train": "math", "mbpp-train": "code", "tico19-translation": "translation",
    "scitldr-summarize": "summarize", "cosmosqa-summarize": "summarize", "pubmedqa-summarize": "summarize",
    "cosmosqa-context-qa": "qa", "pubmedqa-context-qa": "qa",
    "scitldr-extract": "extract-rewrite", "pubmedqa-extract": "extract-rewrite", "scitldr-rewrite": "extract-rewrite",
    "cosmosqa-rewrite": "extract-rewrite",
}


def main() -> None:
    p = parser()
    p.add_argument("prompts")
    p.add_argument("--per-category", type=int, default=3)
    p.add_argument("--gsm8k-cap", type=int, default=2000, help="the cap the distillation used")
    p.add_argument("--out", default="data/bench_prompts.jsonl")
    args = p.parse_args()
    rows = read_prompts(args.prompts)
    distilled = {r.id for r in subsample(rows, {"gsm8k-train": args.gsm8k_cap}, seed=0)}
    held = [r for r in rows if r.id not in distilled or is_eval(r.id, 0.05)]
    rng = random.Random(0)
    rng.shuffle(held)
    picked: dict[str, list] = {}
    for r in held:
        cat = CATEGORY.get(r.source, "chat")
        if len(picked.setdefault(cat, [])) < args.per_category and len(r.turns[0]) < 1500:
            picked[cat].append(r)
    with open(args.out, "w") as f:
        for cat, group in sorted(picked.items()):
            for r in group:
                f.write(json.dumps({"id": r.id, "prompt": r.turns[0], "category": cat, "source": r.source}) + "\n")


if __name__ == "__main__":
    main()
