"""fp32 linears packed for MKL's SGEMM (`medusa_heads/kernels/prepack.py: MklPackedLinear`) against oneDNN's packed product,
two copies of the model in one process:
1. one target forward by the number of new tokens (1: a plain step; more: a verify), 300 cached tokens, the two
   builds alternating step by step, the median of 55 steps after 5 warm-ups;
2. whole calls on the prompts, alternating per prompt, greedy: each build's own `generate` as its yardstick, each
   build's outputs compared with it;
3. with --batch-sizes: the same for left-padded batches (16 prompts), new tokens up to each row's EOS.

    python -m experiments.fp32_kernel_ab [--prompts data/bench_prompts.jsonl] [--tokens 1,4,8,12,16]
    python -m experiments.fp32_kernel_ab --batch-sizes 4,8 --out results/ab/fp32_kernel_ab_batch.md
"""
from __future__ import annotations

import os
import statistics
from functools import partial
from pathlib import Path

import torch

from medusa_heads import MedusaModel, default_model_path
from medusa_heads.calibration.timing import alternate, timings
from medusa_heads.machine import cpu_name
from medusa_heads.cli.commands import _read_prompts

from experiments.ab_loop import builds_ab
from experiments.siblings_step_ab import CONTEXT, step_of
from scripts.common import parser

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
    ap = parser(__doc__.split("\n\n")[0], "prompts", "max_new_tokens", out="results/ab/fp32_kernel_ab.md")
    ap.add_argument("--tokens", default="1,4,8,12,16")
    ap.add_argument("--steps-only", action="store_true", help="only the one-forward table")
    ap.add_argument("--batch-sizes", default=None, help="e.g. 4,8: batched calls only")
    args = ap.parse_args()
    torch.set_num_threads(2)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path())
    models = {name: load(kernel) for name, kernel in KERNELS.items()}
    names = list(models)
    if args.batch_sizes:
        return batches(models, tok, _read_prompts(args.prompts)[:16], [int(b) for b in args.batch_sizes.split(",")],
                       args.max_new_tokens, args.out)
    lines = ["# fp32 linears on MKL's packed SGEMM against oneDNN's packed product", "",
             f"{cpu_name()}, 2 threads, fp32, SmolLM2-135M-Instruct, shipped heads, both builds in one process "
             "(`python -m experiments.fp32_kernel_ab`).", "",
             f"## One forward ({CONTEXT} cached tokens, median ms of 55 steps, alternating step by step)", "",
             f"| new tokens | {names[0]}, ms | {names[1]}, ms | speed-up |", "|---|---|---|---|"]
    ids = torch.randint(100, 20000, (1, CONTEXT), generator=torch.Generator().manual_seed(0))
    for tokens in [int(t) for t in args.tokens.split(",")]:
        steps = {n: step_of(m.base_model, tokens, ids) for n, m in models.items()}
        arms = {n: (lambda _, step=steps[n]: step()) for n in names[::-1]}  # the last build first at step 0
        times = timings(arms, range(60), skip=5).seconds  # the first 5 steps warm up
        a, b = (1000 * statistics.median(times[n]) for n in names)
        lines.append(f"| {tokens} | {a:.1f} | {b:.1f} | {a / b:.3f}× |")
        print(lines[-1], flush=True)

    if args.steps_only:
        print("\n".join(lines))
        return
    rows = _read_prompts(args.prompts)
    tps, differ = builds_ab(tok, rows, models, args.max_new_tokens)
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


def batches(models: dict, tok, rows, sizes: list[int], max_new_tokens: int, out: str) -> None:
    from medusa_heads.prompting import prompt_text, user_turn

    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    texts = [prompt_text(tok, user_turn(r.turns[0])) for r in rows]
    eos = tok.eos_token_id
    names = list(models)
    lines = ["# fp32 linears on MKL's packed SGEMM against oneDNN's packed product: batches", "",
             f"{cpu_name()}, 2 threads, fp32, shipped heads, {len(texts)} prompts, {max_new_tokens} new tokens, greedy, "
             "left-padded batches, both builds in one process, the arms alternating per batch "
             "(`python -m experiments.fp32_kernel_ab --batch-sizes ...`).", "",
             "| batch | arm | tokens/s | rows differing from its build's `generate` |", "|---|---|---|---|"]
    def call(arm: tuple[str, str], enc):
        m = models[arm[0]]
        if arm[1] == "generate":
            return m.base_model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
        return m.generate(enc["input_ids"], attention_mask=enc["attention_mask"], max_new_tokens=max_new_tokens,
                          pad_token_id=pad)

    arms = [(n, kind) for n in names for kind in ("generate", "heads")]
    for size in sizes:
        secs, toks, differ = {}, {}, {}
        encs = (tok(texts[i : i + size], return_tensors="pt", padding=True, add_special_tokens=False)
                for i in range(0, len(texts) - size + 1, size))
        for enc, results in alternate({arm: partial(call, arm) for arm in arms}, encs):
            outs = {}
            for arm, (seq, seconds) in results.items():
                secs[arm] = secs.get(arm, 0.0) + seconds
                new = seq[:, enc["input_ids"].shape[1]:].tolist()
                toks[arm] = toks.get(arm, 0) + sum(next((j + 1 for j, t in enumerate(r) if t == eos), len(r)) for r in new)
                outs[arm] = seq
            for arm in arms:
                ref = outs[(arm[0], "generate")]
                same = outs[arm].shape == ref.shape and all(torch.equal(a, b) for a, b in zip(outs[arm], ref))
                differ[arm] = differ.get(arm, 0) + (0 if same else sum(
                    not torch.equal(a, b) for a, b in zip(outs[arm], ref)) if outs[arm].shape == ref.shape else size)
        for arm in secs:
            lines.append(f"| {size} | {arm[0]}, {arm[1]} | {toks[arm] / secs[arm]:.1f} | {differ[arm]} |")
        a, b = names
        lines.append(f"| {size} | MKL over oneDNN | heads {secs[(a, 'heads')] / secs[(b, 'heads')] * toks[(b, 'heads')] / toks[(a, 'heads')]:.3f}×, "
                     f"`generate` {secs[(a, 'generate')] / secs[(b, 'generate')] * toks[(b, 'generate')] / toks[(a, 'generate')]:.3f}× | |")
        print("\n".join(lines[-5:]), flush=True)
    Path(out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
