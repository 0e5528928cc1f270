#!/usr/bin/env python
"""Which of the verify's kernels give a row the same bits whatever else is in the batch: why greedy output in bf16
leaves `generate`'s at near-ties while fp32 keeps it (in practice, not by construction).

A plain decoding step computes one row; a tree verify computes T rows, and each tree node attends over the cached
prefix plus the whole tree (the nodes it may not see masked out). For a node's logits to be bitwise the plain step's,
every kernel on the way must be batch-invariant: a row's result must not depend on how many rows are beside it,
nor (attention) on how many masked keys follow the ones it sees. This prints, for SmolLM2's product shapes and for
attention, whether row 0 of an M-row call equals the 1-row call (oneDNN with packed weights, as prepack runs them,
and PyTorch's stock product), and whether a tree row's attention equals the plain step's:

    python -m experiments.batch_invariance --out FILE.md"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from medusa_heads.kernels.prepack import PackedWeight
from scripts.common import emit, parser

SHAPES = ((576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152))  # SmolLM2-135M: q/o, k/v, up/gate, down, LM head
ROWS = (2, 3, 4, 6, 8, 12, 16, 32)


def product_rows(dtype: torch.dtype, k: int, n: int, packed: bool) -> str:
    """The M of ROWS whose row 0 differs from the 1-row product (or 'none')."""
    torch.manual_seed(0)
    w = torch.randn(n, k, dtype=dtype) * 0.05
    x = torch.randn(max(ROWS), k, dtype=dtype)
    if packed:
        pk = PackedWeight(w, 8)  # the library's oneDNN product (medusa_heads/kernels/prepack.py)
        run = lambda a: pk(a, w)  # noqa: E731
    else:
        run = lambda a: a @ w.T  # noqa: E731
    ref = run(x[:1])[0]
    differ = [m for m in ROWS if not torch.equal(run(x[:m])[0], ref)]
    return ", ".join(map(str, differ)) or "none"


def attention_rows(dtype: torch.dtype, past: int = 200, t: int = 8) -> list[str]:
    """For tree rows 0, 3 and t - 1 of a t-token chain: equal to the plain step's attention (q_len 1, no mask, the
    keys up to its own position)? And to a 1-row call over the tree's whole key length with its mask row?"""
    torch.manual_seed(0)
    q = torch.randn(1, 9, t, 64, dtype=dtype)
    k, v = (torch.randn(1, 3, past + t, 64, dtype=dtype) for _ in range(2))
    mask = torch.zeros(1, 1, t, past + t, dtype=dtype)
    mask[..., past:] = torch.triu(torch.full((t, t), torch.finfo(dtype).min, dtype=dtype), 1)
    tree = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out = []
    for i in (0, 3, t - 1):
        n = past + i + 1
        step = F.scaled_dot_product_attention(q[:, :, i : i + 1], k[:, :, :n], v[:, :, :n], enable_gqa=True)
        one = F.scaled_dot_product_attention(q[:, :, i : i + 1], k, v, attn_mask=mask[:, :, i : i + 1], enable_gqa=True)
        out.append(f"row {i} (masked keys after it: {t - 1 - i}): step {'=' if torch.equal(step[:, :, 0], tree[:, :, i]) else '≠'}, "
                   f"one row with the tree's keys {'=' if torch.equal(one[:, :, 0], tree[:, :, i]) else '≠'}")
    return out


def main() -> None:
    p = parser(__doc__, "threads", "out")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lines = [f"Row 0 of an M-row product against the 1-row product (M in {', '.join(map(str, ROWS))}): the M where it "
             f"differs; {args.threads} threads.", "",
             "| dtype | in → out | oneDNN, packed (prepack) | stock (`x @ W.T`) |", "|---|---|---|---|"]
    for dtype in (torch.float32, torch.bfloat16):
        for k, n in SHAPES:
            lines.append(f"| {str(dtype).removeprefix('torch.')} | {k} → {n} | {product_rows(dtype, k, n, True)} | "
                         f"{product_rows(dtype, k, n, False)} |")
    lines += ["", "Attention (SDPA, 9 query heads over 3 key/value heads, 200 cached tokens, an 8-token chain verified "
              "under a 4D mask), each tree row against the plain step's call:", ""]
    for dtype in (torch.float32, torch.bfloat16):
        lines += [f"- {str(dtype).removeprefix('torch.')}: " + "; ".join(attention_rows(dtype))]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
