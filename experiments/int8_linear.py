"""Where an int8 linear's time goes, against oneDNN's packed bf16 product, for SmolLM2-135M's shapes: the int8 GEMM
alone (both levels of the rows already quantised: twice the rows), and the whole Int8Linear (each row quantised in
two levels, then scaled back; under inference mode, so no call reuses a sibling's levels). Microseconds a call,
median of 5 rounds of 200 calls, 2 threads, one process, the contenders alternating.

    python -m experiments.int8_linear > results/transformers/int8/linear.md
"""
from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from medusa_heads.machine import cpu_name
from medusa_heads.kernels.int8 import Int8Linear, quantize_rows

SHAPES = {"q, o (576 → 576)": (576, 576), "k, v (576 → 192)": (192, 576), "gate, up (576 → 1536)": (1536, 576),
          "down (1536 → 576)": (576, 1536), "LM head (576 → 49,152)": (49152, 576)}


def per_call(fn, x, calls: int = 200) -> float:
    for _ in range(10):
        fn(x)
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    torch.set_num_threads(2)
    print(f"# An int8 linear against a bf16 one\n\n{cpu_name()}, 2 threads, torch {torch.__version__}; "
          "microseconds a call, median of 5 rounds; the int8 GEMM takes both levels of the rows, twice the rows "
          "(`python -m experiments.int8_linear`).\n")
    print("| linear | rows | bf16, oneDNN packed | int8 GEMM alone | Int8Linear (quantise both levels, GEMM, scale) |")
    print("|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, (out_f, in_f) in SHAPES.items():
            lin = nn.Linear(in_f, out_f, bias=False).to(torch.bfloat16)
            lin.weight.copy_(torch.randn(out_f, in_f, generator=gen) * 0.05)
            packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight, 8)
            layer = Int8Linear(lin)
            for rows in (1, 8, 16):
                x = torch.randn(rows, in_f, generator=gen).to(torch.bfloat16)
                q, _ = quantize_rows(x)
                contenders = {
                    "bf16": (lambda a: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""), x),
                    "gemm": (layer.gemm, q),
                    "int8": (layer, x),
                }
                times = {k: [] for k in contenders}
                for _ in range(5):
                    for k, (fn, arg) in contenders.items():
                        times[k].append(per_call(fn, arg))
                med = {k: statistics.median(v) for k, v in times.items()}
                print(f"| {name} | {rows} | {med['bf16']:.0f} | {med['gemm']:.0f} | {med['int8']:.0f} |")


if __name__ == "__main__":
    main()
