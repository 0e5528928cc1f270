"""fp32 linears packed for MKL's SGEMM (`inference/prepack.py: MklPackedLinear`) against oneDNN's packed product,
two copies of the model in one process:
1. one target forward by the number of new tokens (1: a plain step; more: a verify), 300 cached tokens, the two
   builds alternating step by step, the median of 55 steps after 5 warm-ups;
2. whole calls on the prompts, alternating per prompt, greedy: each build's own `generate` as its yardstick, each
   build's outputs compared with it.

    python experiments/fp32_kernel_ab.py [--prompts data/bench_prompts.jsonl] [--tokens 1,4,8,12]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from medusa_heads import MedusaModel, default_model_path, prompt_ids
from medusa_heads.calibration.machine import cpu_name
from medusa_heads.cli.commands import _read_prompts

from ab_loop import alternate  # noqa: E402  (experiments/ is the script's folder)
from siblings_step_ab import CONTEXT, step_of  # noqa: E402

KERNELS = {"oneDNN": "onednn", "MKL (kept)": "mkl"}


def load(kernel: str) -> MedusaModel:
    kept = os.environ.get("MEDUSA_HEADS_FP32_KERNEL")
    os.environ["MEDUSA_HEADS_FP32_KERNEL"] = kernel
    try:
        return MedusaModel.from_pretrained()
    finally:
        if kept is None:
            del os.environ["MEDUSA_HEADS_FP32_KERNEL"]
        else:
            os.environ["MEDUSA_HEADS_FP32_KERNEL"] = kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default="data/bench_prompts.jsonl")
    ap.add_argument("--tokens", default="1,4,8,12,16")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="results/ab/fp32_kernel_ab.md")
    ap.add_argument("--steps-only", action="store_true", help="only the one-forward table")
    args = ap.parse_args()
    torch.set_num_threads(2)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path())
    models = {name: load(kernel) for name, kernel in KERNELS.items()}
    names = list(models)
    lines = ["# fp32 linears on MKL's packed SGEMM against oneDNN's packed product", "",
             f"{cpu_name()}, 2 threads, fp32, SmolLM2-135M-Instruct, shipped heads, both builds in one process "
             "(`python experiments/fp32_kernel_ab.py`).", "",
             f"## One forward ({CONTEXT} cached tokens, median ms of 55 steps, alternating step by step)", "",
             f"| new tokens | {names[0]}, ms | {names[1]}, ms | speed-up |", "|---|---|---|---|"]
    ids = torch.randint(100, 20000, (1, CONTEXT), generator=torch.Generator().manual_seed(0))
    for tokens in [int(t) for t in args.tokens.split(",")]:
        steps = {n: step_of(m.base_model, tokens, ids) for n, m in models.items()}
        times = {n: [] for n in names}
        for r in range(60):
            for n in (names if r % 2 else names[::-1]):
                t0 = time.perf_counter()
                steps[n]()
                times[n].append(time.perf_counter() - t0)
        a, b = (1000 * statistics.median(times[n][5:]) for n in names)
        lines.append(f"| {tokens} | {a:.1f} | {b:.1f} | {a / b:.3f}× |")
        print(lines[-1], flush=True)

    if args.steps_only:
        print("\n".join(lines))
        return
    arms = {}
    for name, model in models.items():
        arms[(name, "generate")] = lambda ids, m=model: m.base_model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, do_sample=False)
        arms[(name, "heads")] = lambda ids, m=model: m.generate(ids, max_new_tokens=args.max_new_tokens)
    rows = _read_prompts(args.prompts)
    print(f"{len(rows)} prompts x {len(arms)} arms, {args.max_new_tokens} tokens each: about "
          f"{len(rows) * len(arms) * 4 // 60 + 1} minutes")
    for model in models.values():
        model.generate(prompt_ids(tok, "Hello"), max_new_tokens=8)
    with torch.no_grad():
        tps, differ = alternate(tok, rows, arms, reference=lambda arm: (arm[0], "generate"))
    a, b = names
    lines += ["", f"## Whole calls ({len(rows)} prompts of `{args.prompts}`, {args.max_new_tokens} new tokens, "
              "greedy, alternating per prompt)", "",
              "| arm | tokens/s | outputs differing from its build's `generate` |", "|---|---|---|"]
    lines += [f"| {n}, {kind} | {tps[(n, kind)]:.1f} | {differ[(n, kind)]}/{len(rows)} |"
              for n in names for kind in ("generate", "heads")]
    lines += ["", f"MKL over oneDNN: the heads {tps[(b, 'heads')] / tps[(a, 'heads')]:.3f}×, `generate` "
              f"{tps[(b, 'generate')] / tps[(a, 'generate')]:.3f}×. The heads over their own build's `generate`: "
              f"oneDNN {tps[(a, 'heads')] / tps[(a, 'generate')]:.2f}×, MKL {tps[(b, 'heads')] / tps[(b, 'generate')]:.2f}×."]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
