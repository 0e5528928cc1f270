"""One target forward with sibling linears as one product against each linear's own product, by the number of new
tokens (1: a plain step; more: a verify), 300 cached tokens, two copies of the model in one process, alternating
step by step; the median of 55 steps after 5 warm-ups. Companion of `siblings_ab.py`, which times whole calls.

    python -m experiments.siblings_step_ab [--dtypes fp32,bf16,int8] [--tokens 1,4,8,12]
"""
from __future__ import annotations

import statistics
from pathlib import Path

import torch

from medusa_heads.calibration.timing import timings
from medusa_heads.machine import cpu_name
from medusa_heads.engines.hf_cache import crop_to, new_cache
from medusa_heads.engines.hf import target_cache_kw

from experiments.siblings_ab import load
from scripts.common import parser

CONTEXT = 300


def step_of(base, tokens: int, ids: torch.Tensor):
    kw = target_cache_kw(base)
    cache = new_cache(base, CONTEXT + tokens + 8)
    with torch.no_grad():
        base(input_ids=ids, **{kw: cache}, use_cache=True)
    x = torch.randint(100, 20000, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    pos = torch.arange(CONTEXT, CONTEXT + tokens)[None]

    def step():
        with torch.no_grad():
            base(input_ids=x, position_ids=pos, **{kw: cache}, use_cache=True, logits_to_keep=tokens)
        crop_to(cache, CONTEXT)
    return step


def main() -> None:
    ap = parser(__doc__.split("\n\n")[0], out="results/ab/siblings_step_ab.md")
    ap.add_argument("--dtypes", default="fp32,bf16,int8")
    ap.add_argument("--tokens", default="1,4,8,12")
    args = ap.parse_args()
    torch.set_num_threads(2)
    ids = torch.randint(100, 20000, (1, CONTEXT), generator=torch.Generator().manual_seed(0))
    lines = ["# One forward: sibling linears as one product against their own products", "",
             f"{cpu_name()}, 2 threads, SmolLM2-135M-Instruct, {CONTEXT} cached tokens, median ms of 55 steps, "
             "the two builds alternating step by step in one process (`python -m experiments.siblings_step_ab`).", "",
             "| dtype | new tokens | own products, ms | siblings as one product, ms | speed-up |", "|---|---|---|---|---|"]
    for dtype in args.dtypes.split(","):
        bases = {s: load(dtype, s).base_model for s in (False, True)}
        for tokens in [int(t) for t in args.tokens.split(",")]:
            steps = {s: step_of(b, tokens, ids) for s, b in bases.items()}
            arms = {s: (lambda _, step=steps[s]: step()) for s in (True, False)}  # siblings first at step 0
            times = timings(arms, range(60), skip=5).seconds  # the first 5 steps warm up
            own, sib = (1000 * statistics.median(times[s]) for s in (False, True))
            lines.append(f"| {dtype} | {tokens} | {own:.1f} | {sib:.1f} | {own / sib:.3f}× |")
            print(lines[-1], flush=True)
        del bases
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
