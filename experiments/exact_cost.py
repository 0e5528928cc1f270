"""What the row-exact attention costs: a plain step and a 12-token greedy verify of SmolLM2-135M-Instruct in bf16
with SDPA, eager and the row-exact attention (fp32 SDPA beside them), prepacked, in one process, alternating, medians.
Writes results/transformers/exact/cost.md.

    python -m experiments.exact_cost [--context 300] [--repeats 8]
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from medusa_heads import default_model_path
from medusa_heads.machine import cpu_name
from medusa_heads.engines.hf_cache import crop_to, new_cache
from medusa_heads.kernels.exact_attention import NAME, register
from medusa_heads.engines.hf import Target
from medusa_heads.loading import load_base
from medusa_heads.tree.buffers import from_parents
from scripts.common import parser

CONFIGS = [("fp32, SDPA", torch.float32, "sdpa"), ("bf16, SDPA", torch.bfloat16, "sdpa"),
           ("bf16, eager", torch.bfloat16, "eager"), ("bf16, row-exact", torch.bfloat16, NAME)]


def main() -> None:
    ap = parser(__doc__.split("\n\n")[0], out="results/transformers/exact/cost.md")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(2)
    register()
    targets = {name: Target(load_base(default_model_path(), dtype=dtype, attn_implementation=attention))
               for name, dtype, attention in CONFIGS}
    ids = torch.randint(100, 20000, (1, args.context), generator=torch.Generator().manual_seed(0))
    tree = from_parents((-1, 0, 0, 1, 1, 2, 3, 5, 0, 4, 6, 7))  # 12 tokens, 5 deep, cousins between ancestors
    tokens = torch.randint(100, 20000, (tree.size,), generator=torch.Generator().manual_seed(1))
    caches = {}
    for name, target in targets.items():
        caches[name] = new_cache(target.model, args.context + 32)
        target.prefill(ids, caches[name])
    times = {name: ([], []) for name in targets}
    for _ in range(args.repeats + 1):  # the first round warms up
        for name, target in targets.items():
            cache = caches[name]
            t0 = time.perf_counter()
            target.step(tokens[:1], args.context, cache)
            t1 = time.perf_counter()
            crop_to(cache, args.context)
            t2 = time.perf_counter()
            target.verify(tokens, args.context, cache, tree, greedy=True)
            t3 = time.perf_counter()
            crop_to(cache, args.context)
            times[name][0].append(t1 - t0)
            times[name][1].append(t3 - t2)
    lines = ["# What the row-exact attention costs", "",
             f"SmolLM2-135M-Instruct, prepacked, {cpu_name()}, 2 threads, {args.context} cached tokens; medians of "
             f"{args.repeats}, the four alternating in one process (`python -m experiments.exact_cost`).", "",
             "| dtype, attention | plain step | 12-token greedy verify |", "|---|---|---|"]
    for name, (plain, verify) in times.items():
        lines.append(f"| {name} | {1000 * statistics.median(plain[1:]):.1f} ms | "
                     f"{1000 * statistics.median(verify[1:]):.1f} ms |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
