"""The shipped heads' trees sized by their stored cost tables (timed on another machine) against trees sized by this
machine's, timed at first use (calibration/machine.py): one process, the same base, the two alternating per prompt
with transformers' `generate` as the yardstick; greedy, so every output must equal `generate`'s.

    python -m experiments.machine_cost_ab [--prompts data/bench_prompts.jsonl] [--max-new-tokens 128] [--dtype bf16]
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from medusa_heads import MedusaModel
from medusa_heads.calibration import machine
from medusa_heads.cli.commands import _read_prompts
from medusa_heads.prompting import prompt_ids

from experiments.ab_loop import alternate
from scripts.common import parser


def main() -> None:
    ap = parser(__doc__.split("\n\n")[0], "prompts", "max_new_tokens", "threads", out="results/ab/machine_cost_ab.md")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16: with the row-exact attention")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ[machine.ENV] = "off"
    stored = MedusaModel.from_pretrained(dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    tok = stored.tokenizer if hasattr(stored, "tokenizer") else None
    if tok is None:
        from transformers import AutoTokenizer

        from medusa_heads import default_model_path

        tok = AutoTokenizer.from_pretrained(default_model_path())
    stored.cost_model()
    os.environ[machine.ENV] = "on"
    t0 = time.perf_counter()  # the load sizes its default tree: the first use is there
    local = MedusaModel.from_pretrained(stored.base_model, heads="auto")
    local.cost_model()
    first_use = time.perf_counter() - t0
    base = stored.base_model
    rows = _read_prompts(args.prompts)
    methods = {"hf": None, "stored tables": stored, "this machine's": local}
    warm = prompt_ids(tok, "Hello")
    for m in methods.values():
        if m is not None:
            m.generate(warm, max_new_tokens=8)

    def run(model):
        if model is None:
            return lambda ids: base.generate(ids, attention_mask=torch.ones_like(ids),
                                             max_new_tokens=args.max_new_tokens, do_sample=False)
        return lambda ids: model.generate(ids, max_new_tokens=args.max_new_tokens)

    tps, differ = alternate(tok, rows, {name: run(m) for name, m in methods.items()})
    cost = local.cost_model()
    lines = ["# Trees sized by the stored cost tables against this machine's", "",
             f"{machine.cpu_name()}, {args.threads} threads, {args.dtype} prepacked{' (row-exact attention)' if args.dtype == 'bf16' else ''}, shipped heads, {len(rows)} prompts of "
             f"`{args.prompts}`, {args.max_new_tokens} new tokens, greedy; this machine's tables ({local.cost_model_key()}) "
             f"in {first_use:.1f} s, the heads' load included (`python -m experiments.machine_cost_ab`).", "",
             "| trees sized by | tokens/s | speed-up vs generate | outputs differing from generate |", "|---|---|---|---|"]
    for name in methods:
        lines.append(f"| {name} | {tps[name]:.1f} | {tps[name] / tps['hf']:.2f} | {differ[name]} |")
    lines += ["", "This machine's plain step and verify at 256 cached tokens (ms by tree tokens 1, 2, 4, 8, 16, 32): "
              + ", ".join(f"{float(cost.verify_ms(256)[n - 1]):.1f}" for n in (1, 2, 4, 8, 16, 32)),
              "The stored tables' (ms, same sizes): "
              + ", ".join(f"{float(stored.cost_model().verify_ms(256)[n - 1]):.1f}" for n in (1, 2, 4, 8, 16, 32))]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
