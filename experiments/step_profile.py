"""Where a decoding step's time goes, against the floor the memory bus sets: transformers' plain step and the heads'
verify of a tree, on the embedded model, fp32, prepacked linears as `generate` runs them.

The floor: the bytes of weights a step must read (every linear once, the tied LM head once), over this machine's
read bandwidth (a 1 GiB tensor summed, best of 5). The profile: torch.profiler over 32 steps of each kind at a
300-token context, the self time of every op grouped (linear products, attention, the rest of ATen), and what is
left of the wall time outside ATen (Python, module calls, dispatch). Writes results/transformers/profile/step_profile.md.

    python -m experiments.step_profile [--threads 2] [--steps 32] [--tree-tokens 6]
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch

from medusa_heads import MedusaModel
from medusa_heads.machine import cpu_name
from medusa_heads.engines.hf_cache import crop_to, new_cache
from medusa_heads.kernels.prepack import PackedLinear
from medusa_heads.engines.hf import target_cache_kw
from scripts.common import emit, parser

GROUPS = [("linear (weights)", ("linear", "addmm", "mm", "matmul", "bmm")),
          ("attention", ("scaled_dot_product", "attention", "softmax")),
          ("cache and masks", ("cat", "copy_", "index", "slice", "narrow", "where", "masked", "scatter", "select", "arange", "ones", "zeros", "full", "empty", "triu", "tril")),
          ("norms, rope, activations", ("mul", "add", "pow", "mean", "rsqrt", "silu", "neg", "cos", "sin", "sub", "div", "embedding"))]


def bandwidth_gbs(repeats: int = 5) -> float:
    x = torch.ones(2**28, dtype=torch.float32)  # 1 GiB
    x.sum()
    best = min(_timed(lambda: x.sum()) for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(m, torch.nn.Embedding):
            continue  # an embedding row is read per token, not the table; its tied LM head is counted below
        if isinstance(w, torch.Tensor) and w.dim() == 2 and id(w) not in seen:
            seen.add(id(w))
            total += w.numel() * w.element_size()
    head = model.get_output_embeddings().weight
    if id(head) not in seen:
        total += head.numel() * head.element_size()
    return total


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "other ATen"


def profile(step, steps: int) -> tuple[float, dict[str, float]]:
    """(median wall ms of a step, {group: ms per step of ATen self time, plus 'outside ATen'})."""
    walls = []
    for _ in range(3):
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            walls.append(time.perf_counter() - t0)
    per = defaultdict(float)
    for e in prof.key_averages():
        if e.key.startswith(("aten::", "mkldnn::", "mkl::")):
            per[group_of(e.key)] += e.self_cpu_time_total / 1000 / steps
    # the profiler's own cost per op inflates the walls: times without it give the step, shares come from with it
    bare = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        bare.append(time.perf_counter() - t0)
    wall_prof = 1000 * statistics.median(walls)
    aten = sum(per.values())
    per["outside ATen (Python, modules, dispatch)"] = max(wall_prof - aten, 0.0)
    scale = 1000 * statistics.median(bare) / wall_prof
    return 1000 * statistics.median(bare), {k: v * scale for k, v in per.items()}


def main() -> None:
    ap = parser(__doc__.split("\n\n")[0], "threads", out="results/transformers/profile/step_profile.md")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--tree-tokens", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = MedusaModel.from_pretrained()  # the embedded model, shipped heads, prepacked as generate runs it
    base = model.base_model
    bw = bandwidth_gbs()
    nbytes = weight_bytes(base)
    floor_ms = nbytes / (bw * 1e9) * 1000
    ids = torch.randint(100, 20000, (1, args.context), generator=torch.Generator().manual_seed(0))
    kw = target_cache_kw(base)

    def one(tokens: int):
        cache = new_cache(base, args.context + tokens + 4)
        with torch.no_grad():
            base(input_ids=ids, **{kw: cache}, use_cache=True)
        x = torch.randint(100, 20000, (1, tokens))
        pos = torch.arange(args.context, args.context + tokens)[None]

        def step():
            with torch.no_grad():
                base(input_ids=x, position_ids=pos, **{kw: cache}, use_cache=True, logits_to_keep=tokens)
            crop_to(cache, args.context)
        return step

    rows = []
    for name, tokens in (("plain step (1 token)", 1), (f"verify of {args.tree_tokens} tokens", args.tree_tokens)):
        wall, parts = profile(one(tokens), args.steps)
        rows.append((name, wall, parts))
    groups = [g for g, _ in GROUPS] + ["other ATen", "outside ATen (Python, modules, dispatch)"]
    kernel = next(m.kernel for m in base.modules() if isinstance(m, PackedLinear))
    lines = ["# Where a step's time goes", "",
             f"{cpu_name()}, {args.threads} threads, fp32, prepacked linears ({kernel}), SmolLM2-135M-Instruct, "
             f"{args.context} cached tokens; median of {args.steps} steps each (`python -m experiments.step_profile`).",
             "", f"Weights read per step: {nbytes / 2**20:.0f} MiB; read bandwidth here {bw:.1f} GB/s (a 1 GiB sum, "
             f"best of 5): **floor {floor_ms:.1f} ms a step**.", "",
             "| step | wall ms | × floor | " + " | ".join(groups) + " |", "|---|---|---|" + "---|" * len(groups)]
    for name, wall, parts in rows:
        lines.append(f"| {name} | {wall:.1f} | {wall / floor_ms:.2f} | "
                     + " | ".join(f"{parts.get(g, 0.0):.1f}" for g in groups) + " |")
    lines += ["", "Milliseconds a step per group: ATen ops' self time from torch.profiler, scaled to the wall time "
              "without the profiler; 'outside ATen' is the wall time the ops do not account for."]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
