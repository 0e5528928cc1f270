"""One target forward with its RMS norms on ATen's rms_norm (inference/norms.py) against the model's own norms, by
the number of new tokens (1: a plain step; more: a verify), 300 cached tokens, one model whose norms are switched
between steps, alternating step by step; the median of 55 steps after 5 warm-ups. The logits of both are compared
bit for bit at every size.

    python experiments/norms_ab.py [--dtypes fp32,bf16,int8] [--tokens 1,4,8,12]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from medusa_heads import MedusaModel
from medusa_heads.calibration.machine import cpu_name
from medusa_heads.inference.norms import fused_norms

from siblings_ab import LOAD  # noqa: E402  (experiments/ is the script's folder)
from siblings_step_ab import CONTEXT, step_of  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from common import emit  # noqa: E402  scripts/common.py


class own_norms:
    """`with own_norms(model):` the norms' own forwards (fuse_norms' forwards restored on exit)."""

    def __init__(self, model) -> None:
        self.norms = [(m, m.forward) for m in fused_norms(model)]

    def __enter__(self):
        for m, _ in self.norms:
            del m.forward

    def __exit__(self, *exc) -> None:
        for m, fused in self.norms:
            m.forward = fused


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="fp32,bf16,int8")
    ap.add_argument("--tokens", default="1,4,8,12")
    ap.add_argument("--out", default="results/ab/norms_step_ab.md")
    args = ap.parse_args()
    torch.set_num_threads(2)
    ids = torch.randint(100, 20000, (1, CONTEXT), generator=torch.Generator().manual_seed(0))
    rows = []
    for dtype in args.dtypes.split(","):
        base = MedusaModel.from_pretrained(**LOAD[dtype]).base_model
        n = len(fused_norms(base))
        for tokens in [int(t) for t in args.tokens.split(",")]:
            step = step_of(base, tokens, ids)
            times = {False: [], True: []}
            for r in range(60):
                for fused in ((False, True) if r % 2 else (True, False)):
                    t0 = time.perf_counter()
                    if fused:
                        step()
                    else:
                        with own_norms(base):
                            step()
                    times[fused].append(time.perf_counter() - t0)
            x = torch.randint(100, 20000, (1, tokens + CONTEXT), generator=torch.Generator().manual_seed(tokens))
            with torch.no_grad():
                got = base(x).logits
                with own_norms(base):
                    same = torch.equal(got, base(x).logits)
            own, fused = (1000 * statistics.median(times[s][5:]) for s in (False, True))
            rows.append(f"| {dtype} | {n} | {tokens} | {own:.1f} | {fused:.1f} | {own / fused:.3f}× | {same} |")
            print(rows[-1], flush=True)
        del base
    emit(["# RMS norms on ATen's rms_norm against the model's own, one forward", "",
          f"{cpu_name()}, 2 threads, SmolLM2-135M-Instruct, {CONTEXT} cached tokens, median ms of 55 steps, the two "
          "alternating step by step on one model (`python experiments/norms_ab.py`). Logits equal: a forward over "
          "the context and the new tokens, both ways, bit for bit.", "",
          "| dtype | norms fused | new tokens | own norms, ms | rms_norm, ms | speed-up | logits equal |",
          "|---|---|---|---|---|---|---|", *rows], args.out)


if __name__ == "__main__":
    main()
