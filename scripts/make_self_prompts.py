#!/usr/bin/env python
"""Write user prompts that the target itself asks (Magpie's method): given only its chat template up to the opening of
a user turn, an instruct model samples what a user would write there. The heads' training prompts come from a few
public sets (GSM8K is 30% of the distilled answers), while people ask the target everyday assistant questions; on one
such question ("Why is the sky blue?") head 1's held-out top-1 falls from 0.54 to 0.24. These prompts are that kind,
in the target's own idea of a user, and `distill` then answers them greedily like any other prompt:

    python -m scripts.make_self_prompts --count 3000 --out data/self_prompts.jsonl.gz
    medusa-heads distill --prompts data/self_prompts.jsonl.gz --out data/distilled_self.jsonl --features data/features_self

The sampling, its filters and resuming are `medusa_heads.training.self_prompts.write_self_prompts`, which `fit` also
runs for a model with a chat template."""
from __future__ import annotations

import glob

import torch

from medusa_heads.default_model import DEFAULT_MODEL
from medusa_heads.loading import load_base, load_tokenizer
from medusa_heads.training.self_prompts import write_self_prompts
from scripts.common import parser


def main() -> None:
    p = parser(__doc__, model=DEFAULT_MODEL, out="data/self_prompts.jsonl.gz", threads=None)
    p.add_argument("--count", type=int, required=True, help="prompts wanted in --out in all")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=96, help="longest prompt sampled (a longer one is dropped)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exclude", nargs="*", default=sorted(glob.glob("data/bench_prompts*.jsonl")),
                   help="prompt files to share no 13-word n-gram with (default: every bench prompt file)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    tokenizer = load_tokenizer(args.model)
    model = load_base(args.model)
    rows = write_self_prompts(model, tokenizer, args.out, args.count, exclude=args.exclude, batch_size=args.batch_size,
                              max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                              seed=args.seed)
    print(f"{len(rows)} prompts in {args.out}")


if __name__ == "__main__":
    main()
