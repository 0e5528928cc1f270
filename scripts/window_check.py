"""Lossless past a real model's sliding window: a long prompt and a long answer, ours against transformers' generate.

    python -m scripts.window_check --model gemma3-270m --heads runs/fit-gemma3-30m --out results/training/models/window_check.json

Two cases on the model's own window (Gemma 3 270M: 512 tokens on 15 of its 18 layers): a prompt of --prompt-tokens
tokens (default 1,000) with --new-tokens new ones (default 600), and a short prompt whose answer alone crosses the
window. Greedy, min_new_tokens = the budget (EOS suppressed, as in both generates); writes equality, τ and tokens/s."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from scripts.common import parser

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "docs" / "how-it-works.md"


def main() -> None:
    ap = parser(__doc__.splitlines()[0], "threads", model="gemma3-270m", out="results/training/models/window_check.json")
    ap.add_argument("--heads", default=None, help="a heads folder (default: new, untrained heads)")
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--new-tokens", type=int, default=600)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from medusa_heads import MedusaModel
    from medusa_heads.loading import load_base, load_tokenizer

    tok, base = load_tokenizer(args.model), load_base(args.model)
    model = MedusaModel.from_pretrained(base, heads=args.heads) if args.heads else \
        MedusaModel.from_pretrained(base, heads=None, tree="cpu-16")
    window = model.target.layout.smallest_window
    text = tok(TEXT.read_text(), return_tensors="pt").input_ids[0]
    cases = {"long prompt": text[: args.prompt_tokens], "short prompt, long answer": text[:32]}
    rows = []
    for name, prompt in cases.items():
        ids = prompt[None]
        gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                   do_sample=False)
        t = time.perf_counter()
        ref = base.generate(ids, **gen)
        t_hf = time.perf_counter() - t
        t = time.perf_counter()
        res = model.generate(ids, return_dict_in_generate=True, prompt_lookup_num_tokens=10, **gen)
        t_ours = time.perf_counter() - t
        row = {"case": name, "prompt_tokens": ids.shape[1], "new_tokens": res.sequences.shape[1] - ids.shape[1],
               "window": window, "identical": bool(torch.equal(res.sequences, ref)),
               "tau": res.stats.mean_accepted, "hf_tokens_per_s": args.new_tokens / t_hf,
               "ours_tokens_per_s": args.new_tokens / t_ours, "speedup": t_hf / t_ours}
        print(json.dumps(row), file=sys.stderr)
        rows.append(row)
    info = {"model": args.model, "heads": args.heads or "new (untrained)", "threads": args.threads,
            "cpu": _cpu(), "date": time.strftime("%Y-%m-%d"), "cases": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(info, indent=1) + "\n")
    if not all(r["identical"] for r in rows):
        raise SystemExit("window_check: an output differs from generate's")


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
