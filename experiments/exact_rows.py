"""Are a bf16 tree verify's rows the plain steps? For each attention (the row-exact one, transformers' eager and
SDPA), SmolLM2-135M-Instruct in bf16, prepacked: random trees of 2 to 16 nodes at 12 contexts from 1 to 1,024
tokens; each node's logits from the verify against those of plain steps along its path, bit for bit. Writes
results/transformers/exact/rows.md.

    python -m experiments.exact_rows [--trees 12]
"""
from __future__ import annotations

import random
import sys
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

CONTEXTS = (1, 7, 16, 31, 64, 127, 255, 256, 300, 511, 513, 1024)


def rows(base, trees: int) -> tuple[int, int, float]:
    """(rows differing, rows, largest |logit difference|)."""
    target, rng = Target(base), random.Random(0)
    ids = torch.randint(100, 20000, (1, max(CONTEXTS)), generator=torch.Generator().manual_seed(0))
    differ = total = 0
    worst = 0.0
    for past in CONTEXTS[:trees]:
        size = rng.randint(2, 16)
        buffers = from_parents((-1, *(rng.randrange(i) for i in range(1, size))))
        tokens = torch.randint(100, 20000, (size,), generator=torch.Generator().manual_seed(past))
        cache = new_cache(base, past + 32)
        target.prefill(ids[:, :past], cache)
        tree = target.verify(tokens, past, cache, buffers).logits
        crop_to(cache, past)
        for node in range(size):
            path = [j for j in range(size) if buffers.mask[node, j]]
            for d, j in enumerate(path):
                step = target.step(tokens[j : j + 1], past + d, cache).logits
            crop_to(cache, past)
            total += 1
            differ += not torch.equal(tree[node], step[-1])
            worst = max(worst, float((tree[node].float() - step[-1].float()).abs().max()))
    return differ, total, worst


def main() -> None:
    ap = parser(__doc__.split("\n\n")[0], out="results/transformers/exact/rows.md")
    ap.add_argument("--trees", type=int, default=len(CONTEXTS))
    args = ap.parse_args()
    torch.set_num_threads(2)
    register()
    lines = ["# bf16: tree rows against plain steps", "",
             f"SmolLM2-135M-Instruct, bf16, prepacked, {cpu_name()}, 2 threads; random trees of 2 to 16 nodes at "
             f"contexts {', '.join(map(str, CONTEXTS[:args.trees]))} (one tree each); a row counts as differing when "
             "any of its logits differs from the plain steps' along its path (`python -m experiments.exact_rows`).",
             "", "| attention | rows differing | largest logit difference |", "|---|---|---|"]
    with torch.no_grad():
        for attention in (NAME, "eager", "sdpa"):
            base = load_base(default_model_path(), dtype=torch.bfloat16, attn_implementation=attention)
            differ, total, worst = rows(base, args.trees)
            lines.append(f"| {attention} | {differ} of {total} | {worst:.3g} |")
            print(lines[-1], file=sys.stderr)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
