"""Benchmark against transformers' own decoding, in one process, alternating the order per prompt."""
from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from .training.data import PromptRow, chat_input_ids


class ForwardCounter:
    """Counts target forwards (to get tau for any method, transformers' own included)."""

    def __init__(self, model) -> None:
        self.calls = 0
        self.handle = model.register_forward_pre_hook(self._count)

    def _count(self, module, args) -> None:
        self.calls += 1


def _reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_bench(model, tokenizer, rows: list[PromptRow], methods: list[str], max_new_tokens: int = 128,
              sampling: dict | None = None, preset: str = "cpu-16") -> dict:
    """Returns {"overall": {method: stats}, "by_category": {cat: {method: stats}}, "profile": {...}}."""
    base = model.base_model
    device = base.device
    counter = ForwardCounter(base)
    calibrated = model.tree
    gen = dict(do_sample=False) if sampling is None else dict(do_sample=True, **sampling)

    def call(method: str, ids: torch.Tensor):
        if method == "hf":
            return base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, **gen), None
        if method == "pld":
            return base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 prompt_lookup_num_tokens=10, **gen), None
        model.set_tree(calibrated if method == "medusa" else preset)
        res = model.generate(ids, max_new_tokens=max_new_tokens, return_dict_in_generate=True, **gen)
        return res.sequences, res.stats

    warm = chat_input_ids(tokenizer, [{"role": "user", "content": "Hello"}]).to(device)
    for m in methods:
        call(m, warm)

    acc = defaultdict(lambda: defaultdict(lambda: {"seconds": 0.0, "tokens": 0, "forwards": 0, "mismatches": 0, "peak_mb": 0.0}))
    profile = defaultdict(float)
    for i, row in enumerate(tqdm(rows, desc="bench", unit="prompt")):
        messages = []
        for turn in row.turns:
            messages.append({"role": "user", "content": turn})
            ids = chat_input_ids(tokenizer, messages).to(device)
            order = methods if i % 2 == 0 else methods[::-1]
            outs = {}
            for m in order:
                _reset_peak_rss()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats(device)
                calls0, t0 = counter.calls, time.perf_counter()
                seq, stats = call(m, ids)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                outs[m] = seq
                new = seq.shape[1] - ids.shape[1]
                for cat in ("overall", row.category or "uncategorised"):
                    a = acc[cat][m]
                    a["seconds"] += dt
                    a["tokens"] += new
                    a["forwards"] += counter.calls - calls0
                    a["peak_mb"] = max(a["peak_mb"], _peak_mb(device))
                if stats is not None and m == "medusa":
                    for k, v in stats.seconds.items():
                        profile[k] += v
                    profile["total"] += dt
                    profile["steps"] += stats.steps
            for m in methods:
                if sampling is None and not torch.equal(outs[m], outs["hf"]):
                    for cat in ("overall", row.category or "uncategorised"):
                        acc[cat][m]["mismatches"] += 1
            reply = tokenizer.decode(outs["hf"][0, ids.shape[1]:], skip_special_tokens=True)
            messages.append({"role": "assistant", "content": reply})
    model.set_tree(calibrated)
    counter.handle.remove()

    def summarise(per_method: dict) -> dict:
        hf = per_method["hf"]
        out = {}
        for m, a in per_method.items():
            tps = a["tokens"] / a["seconds"]
            out[m] = {
                "tokens_per_s": tps,
                "mean_accepted": a["tokens"] / max(a["forwards"], 1),
                "speedup_vs_hf": tps / (hf["tokens"] / hf["seconds"]),
                "mismatches_vs_hf": a["mismatches"] if sampling is None else None,
                "peak_memory_mb": a["peak_mb"],
            }
        return out

    result = {
        "overall": summarise(acc.pop("overall")),
        "by_category": {cat: summarise(v) for cat, v in sorted(acc.items())},
        "settings": {"max_new_tokens": max_new_tokens, "sampling": sampling, "prompts": len(rows),
                     "calibrated_tree_nodes": calibrated.num_nodes, "preset": preset,
                     "threads": torch.get_num_threads(), "device": str(device), "dtype": str(base.dtype)},
    }
    if profile:
        total = profile.pop("total")
        steps = profile.pop("steps")
        parts = {k: v / total for k, v in profile.items()}
        parts["python/other"] = 1.0 - sum(parts.values())
        result["profile"] = {"share_of_time": parts, "ms_per_step": {k: 1000 * v / steps for k, v in profile.items()}}
    return result


def write_results(result: dict, out: str | Path, methods: list[str]) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Benchmark ({result['settings']})", ""]
    header = "| category | method | tokens/s | tau | speed-up vs hf | mismatches | peak MB |"
    lines += [header, "|---|---|---|---|---|---|---|"]
    for cat, per in [("overall", result["overall"]), *result["by_category"].items()]:
        for m in methods:
            r = per[m]
            mm = "-" if r["mismatches_vs_hf"] is None else r["mismatches_vs_hf"]
            lines.append(f"| {cat} | {m} | {r['tokens_per_s']:.1f} | {r['mean_accepted']:.2f} | {r['speedup_vs_hf']:.2f} | {mm} | {r['peak_memory_mb']:.0f} |")
    if "profile" in result:
        lines += ["", "Per-step profile of `medusa` (share of wall time): "
                  + ", ".join(f"{k} {v:.1%}" for k, v in result["profile"]["share_of_time"].items())]
    (out / "results.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = ["overall", *result["by_category"]]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cats) * len(methods) / 2), 4))
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        vals = [(result["overall"] if c == "overall" else result["by_category"][c])[m]["speedup_vs_hf"] for c in cats]
        ax.bar([i + j * width for i in range(len(cats))], vals, width, label=m)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cats))], cats, rotation=30, ha="right")
    ax.set_ylabel("speed-up vs transformers generate")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=100)
    plt.close(fig)
