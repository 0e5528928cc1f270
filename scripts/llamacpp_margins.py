"""Where the heads on llama.cpp leave llama.cpp's own plain greedy decoding, and by how much plain decoding preferred
its token there (engines.llamacpp.divergence_margin): for each prompt and weight type, the first differing token's
index and the plain step's logit margin, next to the step's top-two gap and logit scale. Greedy, 128 new tokens.

    .venv/bin/python -m scripts.llamacpp_margins --weights q8_0 q4_k_m   # writes results/llamacpp/margins/
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from medusa_heads import MedusaModel, default_model_path, llamacpp, prompt_ids
from medusa_heads.cli.commands import _read_prompts
from medusa_heads.engines.llamacpp import divergence_margin
from medusa_heads.loading import load_tokenizer
from medusa_heads.machine import cpu_name, isa
from scripts.common import parser


def main() -> None:
    p = parser(__doc__, "prompts", "max_new_tokens", "threads", out="results/llamacpp/margins")
    p.add_argument("--weights", nargs="+", default=["q8_0", "q4_k_m"], choices=llamacpp.WEIGHTS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    path = default_model_path()
    tok, rows = load_tokenizer(str(path)), _read_prompts(args.prompts)
    print(f"{len(rows)} prompts x {len(args.weights)} weight types: plain decoding, the heads, and teacher-forced steps "
          f"up to each divergence; about {len(rows) * len(args.weights) * 10 // 60 + 1} minutes on two quiet cores")
    found = []
    for weights in args.weights:
        model = MedusaModel.from_pretrained(path, gguf=weights, threads=args.threads)
        plain = llamacpp.Plain(llamacpp.gguf(path, weights), threads=args.threads)
        for i, row in enumerate(tqdm(rows, desc=weights, unit="prompt")):
            ids = prompt_ids(tok, row.turns[0])
            want = plain.generate(ids[0].tolist(), args.max_new_tokens)[0]
            got = model.generate(ids, max_new_tokens=args.max_new_tokens)[0, ids.shape[1]:].tolist()
            margin = divergence_margin(model.engine, ids[0].tolist(), want, got)
            found.append({"weights": weights, "prompt": i + 1, "row_cap": model.engine.row_cap, **(margin or {})})
        plain.close()
    write(Path(args.out), found, args)


def write(out: Path, found: list[dict], args) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"cpu": cpu_name(), "isa": isa(), "settings": vars(args),
                                                  "prompts": found}, indent=1) + "\n")
    lines = [f"# Where the heads on llama.cpp leave its plain greedy decoding ({cpu_name()}, {isa()})", "",
             f"`python -m scripts.llamacpp_margins {' '.join(sys.argv[1:])}`: {args.prompts}, {args.max_new_tokens} new tokens, greedy, {args.threads} threads. "
             "Margin: the plain step's logit of plain decoding's token minus that of the heads' token, at the first "
             "token where they differ (teacher-forced one-token steps along plain decoding's output).", "",
             "| weights | outputs differing | largest margin | median margin | median logit scale (std) |", "|---|---|---|---|---|"]
    for w in args.weights:
        rows = [r for r in found if r["weights"] == w]
        diff = sorted(r["margin"] for r in rows if "margin" in r)
        scale = sorted(r["logit_scale"] for r in rows if "margin" in r)
        lines.append(f"| {w} | {len(diff)}/{len(rows)} | {max(diff, default=0):.4f} | "
                     f"{diff[len(diff) // 2] if diff else 0:.4f} | {scale[len(scale) // 2] if scale else 0:.2f} |")
    lines += ["", "| weights | prompt | first differing token | margin | plain's token the argmax |", "|---|---|---|---|---|"]
    lines += [f"| {r['weights']} | {r['prompt']} | {r['index']} | {r['margin']:.4f} | {r['plain_is_argmax']} |"
              for r in found if "margin" in r]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:8 + len(args.weights)]))


if __name__ == "__main__":
    main()
