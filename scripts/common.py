"""What the measuring scripts share: the options and set-up of a greedy pass over prompt files with the shipped (or
given) heads, and a Markdown table printed and, with --out, written."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from medusa_heads import MedusaModel
from medusa_heads.loading import load_tokenizer
from medusa_heads.corpus import read_prompts


def greedy_pass(doc: str):
    """Parses --prompts, --heads, --model, --limit, --max-new-tokens, --threads, --out, --no-prepack; sets the threads; returns
    (args, the MedusaModel, its tokenizer, [(prompt file, row)] with the first --limit rows of each file)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", nargs="+", required=True, help="JSONL prompt files (first turn of each row)")
    p.add_argument("--heads", default=None, help="heads directory (default: the shipped heads)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--limit", type=int, default=None, help="the first N prompts of each file")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="Markdown file for the table")
    p.add_argument("--no-prepack", action="store_true", help="the stock kernels (a model loaded the user's way)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = MedusaModel.from_pretrained(args.model, **({"heads": args.heads} if args.heads else {}),
                                        **({"prepack": False} if args.no_prepack else {}))
    rows = [(f, r) for f in args.prompts for r in read_prompts(f)[: args.limit]]
    return args, model, load_tokenizer(args.model), rows


def emit(lines: list[str], out: str | None) -> str:
    """Joins `lines` (a caption, then a Markdown table), prints them and writes them to `out` (its folder made)."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
    return text
