"""The per-step tree sized with the decode loop's own work in its cost model (CostModel.loop_ms at every step,
overhead_ms for a tree) at given values, against the stored cost model, on llama.cpp, its plain decoding beside
them, one process, arms alternating per prompt (ab_loop.alternate_by), by category: tokens/s over plain decoding,
and outputs differing.

    python -m experiments.loop_cost_ab --gguf q8_0 --loop-ms 1.2 --overhead-ms 0.3 [--out results/ab/loop_cost_ab.md]
"""
from __future__ import annotations

import dataclasses

from medusa_heads.cli.commands import _read_prompts
from medusa_heads.machine import cpu_name

from experiments.ab_loop import against_plain, on_llamacpp
from scripts.common import parser


def main() -> None:
    p = parser(__doc__, "prompts", "max_new_tokens", "threads", "limit", "out")
    p.add_argument("--gguf", default="q8_0", help="the weight type llama.cpp runs")
    p.add_argument("--loop-ms", type=float, required=True, help="the loop's own work at every step")
    p.add_argument("--overhead-ms", type=float, required=True, help="what a tree adds to it")
    p.add_argument("--draft-ms", type=float, default=None, help="one drafting level (default: the stored one)")
    args = p.parse_args()
    tok, model, plain = on_llamacpp(args.gguf, args.threads)
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

    arms = {"stored": heads(stored), "with the loop": heads(measured)}
    rows = _read_prompts(args.prompts)[: args.limit]
    c = stored.cost
    against_plain(tok, rows, plain, args.max_new_tokens, arms, [
        f"# The loop in the cost model, llama.cpp {args.gguf}: {len(rows)} prompts, {args.max_new_tokens} tokens, "
        f"greedy, {args.threads} threads, {cpu_name()}", "",
        f"stored: loop {c.loop_ms} ms, tree {c.overhead_ms} ms, level {c.draft_ms} ms; with the loop: "
        f"{', '.join(f'{k} {v}' for k, v in changes.items())}"], args.out)


if __name__ == "__main__":
    main()
