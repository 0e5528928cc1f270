"""Sibling linears as one product (q, k and v stacked; gate and up stacked: `inference/prepack.py: Siblings`)
against each linear's own product, two copies of the model in one process, alternating per prompt, greedy; each
build's own `generate` as its yardstick, and each build's outputs compared with it.

    python experiments/siblings_ab.py --dtype {fp32,bf16,int8} [--prompts data/bench_prompts.jsonl]
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
from medusa_heads.inference import int8, prepack

LOAD = {"fp32": {}, "bf16": {"dtype": torch.bfloat16}, "int8": {"quantize": "int8"}}


def load(dtype: str, siblings: bool) -> MedusaModel:
    kept = prepack.fuse_siblings
    if not siblings:
        prepack.fuse_siblings = int8.fuse_siblings = lambda model: 0
    try:
        return MedusaModel.from_pretrained(**LOAD[dtype])
    finally:
        prepack.fuse_siblings = int8.fuse_siblings = kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=list(LOAD), required=True)
    ap.add_argument("--prompts", default="data/bench_prompts.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None, help="default results/ab/siblings_ab_<dtype>.md")
    args = ap.parse_args()
    torch.set_num_threads(2)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path())
    models = {"own products": load(args.dtype, False), "siblings as one product (kept)": load(args.dtype, True)}
    arms = [(build, method) for build in models for method in ("generate", "heads")]
    rows = _read_prompts(args.prompts)
    print(f"{len(rows)} prompts x {len(arms)} arms, {args.max_new_tokens} tokens each: about "
          f"{len(rows) * len(arms) * 4 // 60 + 1} minutes")
    secs, tokens, differ = ({a: 0.0 for a in arms}, {a: 0 for a in arms}, {a: 0 for a in arms})
    for model in models.values():
        model.generate(prompt_ids(tok, "Hello"), max_new_tokens=8)
    for i, row in enumerate(tqdm(rows, desc="A/B", unit="prompt")):
        ids = prompt_ids(tok, row.turns[0])
        outs = {}
        for arm in (arms if i % 2 == 0 else arms[::-1]):
            model = models[arm[0]]
            t0 = time.perf_counter()
            with torch.no_grad():
                if arm[1] == "generate":
                    out = model.base_model.generate(ids, attention_mask=torch.ones_like(ids),
                                                    max_new_tokens=args.max_new_tokens, do_sample=False)
                else:
                    out = model.generate(ids, max_new_tokens=args.max_new_tokens)
            secs[arm] += time.perf_counter() - t0
            tokens[arm] += out.shape[1] - ids.shape[1]
            outs[arm] = out
        for arm in arms:
            differ[arm] += not torch.equal(outs[arm], outs[(arm[0], "generate")])
    yard = tokens[arms[0]] / secs[arms[0]]
    lines = [f"# Sibling linears as one product against their own products ({args.dtype})", "",
             f"{cpu_name()}, 2 threads, {args.dtype}, shipped heads, {len(rows)} prompts of `{args.prompts}`, "
             f"{args.max_new_tokens} new tokens, greedy, alternating per prompt in one process "
             f"(`python experiments/siblings_ab.py --dtype {args.dtype}`).", "",
             "| linears | method | tokens/s | × generate with own products | outputs differing from that build's generate |",
             "|---|---|---|---|---|"]
    for arm in arms:
        tps = tokens[arm] / secs[arm]
        lines.append(f"| {arm[0]} | {arm[1]} | {tps:.1f} | {tps / yard:.2f} | {differ[arm]} |")
    out = Path(args.out or f"results/ab/siblings_ab_{args.dtype}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
