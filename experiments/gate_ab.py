"""The per-step tree with its gate (inference/adaptive.DraftGate: the heads rest where their recent trees did not
pay) against the same tree without it, llama.cpp's plain decoding of the same GGUF beside them, one process, arms
alternating per prompt (ab_loop.alternate_by), by category: tokens/s over plain decoding, and outputs differing."""
from __future__ import annotations

import json

import torch
from transformers import AutoTokenizer

from medusa_heads import MedusaModel, default_model_path, llamacpp
from medusa_heads.inference.adaptive import DraftGate
from medusa_heads.cli.commands import _read_prompts

from experiments.ab_loop import alternate_by
from scripts.common import parser


def main() -> None:
    p = parser(__doc__, "prompts", "max_new_tokens", "threads", "limit", "out")
    p.add_argument("--gguf", default="q8_0", help="the weight type llama.cpp runs")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = MedusaModel.from_pretrained(path, gguf=args.gguf, threads=args.threads)
    plain = llamacpp.Plain(llamacpp.gguf(path, args.gguf), threads=args.threads)
    gate_open = DraftGate.open

    def heads(gated: bool):
        def run(ids):
            DraftGate.open = gate_open if gated else (lambda self: True)  # the call's own drafter, as generate makes it
            try:
                return model.generate(ids, max_new_tokens=args.max_new_tokens)
            finally:
                DraftGate.open = gate_open
        return run

    arms = {"plain": lambda ids: torch.tensor([ids[0].tolist() + plain.generate(ids[0].tolist(),
                                                                               args.max_new_tokens)[0]]),
            "no gate": heads(False), "gate": heads(True)}
    for arm in arms.values():
        arm(torch.tensor([tok("Hello").input_ids]))
    rows = _read_prompts(args.prompts)[: args.limit]
    table = {}
    for name, (speed, differ, prompts) in alternate_by(tok, rows, arms, reference=lambda arm: "plain",
                                                       group=lambda row: row.category or "none").items():
        table[name] = {"prompts": prompts, "tokens_per_s": speed,
                       "x_plain": {a: speed[a] / speed["plain"] for a in arms}, "differ": differ}
    lines = [f"# The gate on llama.cpp {args.gguf}: {len(rows)} prompts, {args.max_new_tokens} tokens, greedy", "",
             "| category | prompts | plain tokens/s | no gate, x plain | gate, x plain | differ (no gate, gate) |",
             "|---|---|---|---|---|---|"]
    for category, r in table.items():
        x, d = r["x_plain"], r["differ"]
        lines.append(f"| {category} | {r['prompts']} | {r['tokens_per_s']['plain']:.1f} | {x['no gate']:.3f} | "
                     f"{x['gate']:.3f} | {d['no gate']}, {d['gate']} |")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n\n```json\n" + json.dumps(table, indent=1) + "\n```\n")


if __name__ == "__main__":
    main()
