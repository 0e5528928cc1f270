"""Sibling linears as one product (q, k and v stacked; gate and up stacked: `medusa_heads/kernels/prepack.py: Siblings`)
against each linear's own product, two copies of the model in one process, alternating per prompt, greedy; each
build's own `generate` as its yardstick, and each build's outputs compared with it.

    python -m experiments.siblings_ab --dtype {fp32,bf16,int8} [--prompts data/bench_prompts.jsonl]
"""
from __future__ import annotations

from pathlib import Path

import torch

from medusa_heads import MedusaModel, default_model_path
from medusa_heads.machine import cpu_name
from medusa_heads.cli.commands import _read_prompts
from medusa_heads.kernels import int8, prepack

from experiments.ab_loop import builds_ab
from scripts.common import Option, parser

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
    ap = parser(__doc__.split("\n\n")[0], "prompts", "max_new_tokens",
                out=Option(None, "default results/ab/siblings_ab_<dtype>.md"))
    ap.add_argument("--dtype", choices=list(LOAD), required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path())
    models = {"own products": load(args.dtype, False), "siblings as one product (kept)": load(args.dtype, True)}
    rows = _read_prompts(args.prompts)
    tps, differ = builds_ab(tok, rows, models, args.max_new_tokens)
    yard = tps[next(iter(tps))]
    lines = [f"# Sibling linears as one product against their own products ({args.dtype})", "",
             f"{cpu_name()}, 2 threads, {args.dtype}, shipped heads, {len(rows)} prompts of `{args.prompts}`, "
             f"{args.max_new_tokens} new tokens, greedy, alternating per prompt in one process "
             f"(`python -m experiments.siblings_ab --dtype {args.dtype}`).", "",
             "| linears | method | tokens/s | × generate with own products | outputs differing from that build's generate |",
             "|---|---|---|---|---|"]
    for arm in tps:
        lines.append(f"| {arm[0]} | {arm[1]} | {tps[arm]:.1f} | {tps[arm] / yard:.2f} | {differ[arm]} |")
    out = Path(args.out or f"results/ab/siblings_ab_{args.dtype}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
