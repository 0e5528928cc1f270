"""The heads drafting on weight-only int8 (draft_dtype=torch.int8) against fp32 (oneDNN, packed), on llama.cpp and
on transformers, llama.cpp's (or transformers') plain decoding beside them, one process, arms alternating per prompt
(ab_loop.alternate): tokens/s, outputs differing from plain decoding, and drafting ms a step."""
from __future__ import annotations

import json
from collections import defaultdict

import torch
from transformers import AutoTokenizer

from medusa_heads import MedusaModel, default_model_path, llamacpp
from medusa_heads.cli.commands import _read_prompts

from experiments.ab_loop import alternate
from scripts.common import parser


def main() -> None:
    p = parser(__doc__, "prompts", "max_new_tokens", "threads", limit=21)
    p.add_argument("--gguf", default="q8_0", help="a weight type, or 'none' for the transformers target")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    gguf = None if args.gguf == "none" else args.gguf
    models = {d: MedusaModel.from_pretrained(path, gguf=gguf, threads=args.threads, draft_dtype=dtype)
              for d, dtype in (("fp32", torch.float32), ("int8", torch.int8))}
    parts = defaultdict(lambda: defaultdict(float))

    def heads(name):
        def run(ids):
            res = models[name].generate(ids, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True)
            for k, v in res.stats.seconds.items():
                parts[name][k] += v
            parts[name]["steps"] += res.stats.steps
            parts[name]["tokens"] += res.sequences.shape[1] - ids.shape[1]
            return res.sequences
        return run

    plain = llamacpp.Plain(llamacpp.gguf(path, gguf), threads=args.threads) if gguf else None

    def reference(ids):
        if plain is not None:
            return torch.tensor([ids[0].tolist() + plain.generate(ids[0].tolist(), args.max_new_tokens)[0]])
        return models["fp32"].base_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                  max_new_tokens=args.max_new_tokens)
    arms = {"plain": reference, "fp32": heads("fp32"), "int8": heads("int8")}
    for arm in arms.values():
        arm(torch.tensor([tok("Hello").input_ids]))
    parts.clear()
    rows = _read_prompts(args.prompts)[: args.limit]
    speed, differ = alternate(tok, rows, arms, reference=lambda arm: "plain")
    out = {"target": f"llama.cpp {gguf}" if gguf else "transformers fp32", "prompts": len(rows),
           "tokens_per_s": speed, "x_plain": {a: speed[a] / speed["plain"] for a in speed}, "differ": differ,
           "tau": {a: parts[a]["tokens"] / parts[a]["steps"] for a in parts},
           "ms_per_step": {a: {k: 1000 * v / parts[a]["steps"] for k, v in parts[a].items()
                               if k not in ("steps", "tokens")} for a in parts}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
