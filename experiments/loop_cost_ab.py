"""The per-step tree sized with the decode loop's own work in its cost model (CostModel.loop_ms at every step,
overhead_ms for a tree) at given values, against the stored cost model, on llama.cpp, its plain decoding beside
them, one process, arms alternating per prompt (ab_loop.alternate_by), by category: tokens/s over plain decoding,
and outputs differing.

    python -m experiments.loop_cost_ab --gguf q8_0 --loop-ms 1.2 --overhead-ms 0.3 [--out results/ab/loop_cost_ab.md]
"""
from __future__ import annotations

import dataclasses
import json

import torch
from transformers import AutoTokenizer

from medusa_heads import MedusaModel, default_model_path, llamacpp
from medusa_heads.cli.commands import _read_prompts
from medusa_heads.machine import cpu_name

from experiments.ab_loop import alternate_by
from scripts.common import parser


def main() -> None:
    p = parser(__doc__, "prompts", "max_new_tokens", "threads", "limit", "out")
    p.add_argument("--gguf", default="q8_0", help="the weight type llama.cpp runs")
    p.add_argument("--loop-ms", type=float, required=True, help="the loop's own work at every step")
    p.add_argument("--overhead-ms", type=float, required=True, help="what a tree adds to it")
    p.add_argument("--draft-ms", type=float, default=None, help="one drafting level (default: the stored one)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = MedusaModel.from_pretrained(path, gguf=args.gguf, threads=args.threads)
    plain = llamacpp.Plain(llamacpp.gguf(path, args.gguf), threads=args.threads)
    stored = model.drafting()
    changes = {"loop_ms": args.loop_ms, "overhead_ms": args.overhead_ms}
    if args.draft_ms is not None:
        changes["draft_ms"] = args.draft_ms
    measured = dataclasses.replace(stored, cost=dataclasses.replace(stored.cost, **changes))
    lookup = model.config.lookup_tokens

    def heads(drafting):
        def run(ids):
            drafter = drafting.adaptive_drafter(lookup)  # as generate makes it, for one call
            return model.generate(ids, max_new_tokens=args.max_new_tokens, drafter=drafter,
                                  prompt_lookup_num_tokens=0)
        return run

    arms = {"plain": lambda ids: torch.tensor([ids[0].tolist() + plain.generate(ids[0].tolist(),
                                                                               args.max_new_tokens)[0]]),
            "stored": heads(stored), "with the loop": heads(measured)}
    for arm in arms.values():
        arm(torch.tensor([tok("Hello").input_ids]))
    rows = _read_prompts(args.prompts)[: args.limit]
    table = {}
    for name, (speed, differ, prompts) in alternate_by(tok, rows, arms, reference=lambda arm: "plain",
                                                       group=lambda row: row.category or "none").items():
        table[name] = {"prompts": prompts, "tokens_per_s": speed,
                       "x_plain": {a: speed[a] / speed["plain"] for a in arms}, "differ": differ}
    c = stored.cost
    lines = [f"# The loop in the cost model, llama.cpp {args.gguf}: {len(rows)} prompts, {args.max_new_tokens} "
             f"tokens, greedy, {args.threads} threads, {cpu_name()}", "",
             f"stored: loop {c.loop_ms} ms, tree {c.overhead_ms} ms, level {c.draft_ms} ms; with the loop: "
             f"{', '.join(f'{k} {v}' for k, v in changes.items())}", "",
             "| category | prompts | plain tokens/s | stored, x plain | with the loop, x plain | differ (stored, with) |",
             "|---|---|---|---|---|---|"]
    for category, r in table.items():
        x, d = r["x_plain"], r["differ"]
        lines.append(f"| {category} | {r['prompts']} | {r['tokens_per_s']['plain']:.1f} | {x['stored']:.3f} | "
                     f"{x['with the loop']:.3f} | {d['stored']}, {d['with the loop']} |")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n\n```json\n" + json.dumps(table, indent=1) + "\n```\n")


if __name__ == "__main__":
    main()
