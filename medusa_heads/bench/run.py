"""The bench: each method on every turn of every prompt in one process, the methods' order alternating per prompt
(calibration/timing.py), against transformers' own decoding; tokens/s, tau, outputs differing from hf, peak memory,
a per-step profile of the drafting methods, and one long generation timed apart."""
from __future__ import annotations

from collections import defaultdict
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from medusa_heads import bench
from medusa_heads.bench.methods import MethodRunner, check_methods, method_label
from medusa_heads.calibration.timing import device_sync, run_round
from medusa_heads.config import DEFAULT_TREE
from medusa_heads.corpus import PromptRow
from medusa_heads.kernels.int8 import is_int8
from medusa_heads.kernels.prepack import is_prepacked
from medusa_heads.llamacpp import plain_reference
from medusa_heads.machine import hardware
from medusa_heads.prompting import prompt_ids

LONG_PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle. Take your time."


class ForwardCounter:
    """Counts target forwards (to get tau for any method, transformers' own included): the calls of its decoder,
    which every forward runs, the model's own and a greedy verify's without the LM head
    (medusa_heads/kernels/screen.py)."""

    def __init__(self, model) -> None:
        self.calls = 0
        decoder = getattr(model, "get_decoder", lambda: model)()
        self.handle = (decoder if isinstance(decoder, torch.nn.Module) else model).register_forward_pre_hook(
            self._count)

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


def runtime_settings(base, device: torch.device) -> dict:
    """What a bench ran on besides the model and the tree: threads, device, dtype, kernels, hardware."""
    return {"threads": torch.get_num_threads(), "device": str(device), "dtype": str(base.dtype),
            "prepacked_linears": is_prepacked(base), "int8_linears": is_int8(base), "hardware": hardware(device)}


def prompt_name(i: int, row, turn: int | None = None) -> str:
    """A bench prompt's name in results: its place in the prompts file ("prompt 3", "prompt 3, turn 2"), not its
    id (which says where a prompt was drawn from, e.g. train_prompts:12104 for a held-out training prompt)."""
    return f"prompt {i + 1}" + (f", turn {turn}" if turn is not None and len(row.turns) > 1 else "")


def run_bench(model, tokenizer, rows: list[PromptRow], methods: list[str], max_new_tokens: int = 128,
              sampling: dict | None = None, preset: str = DEFAULT_TREE, long_tokens: int = 0,
              gguf_files: dict | None = None) -> dict:
    """methods: hf, hf-stock, pld, medusa (as configured: the per-step tree for calibrated heads), medusa-static
    (the heads' fixed tree), medusa-preset (`preset`), medusa:NAME (preset NAME), each medusa method optionally
    with "+pld" / "+pldN" (prompt lookup of N tokens; "+pld0": heads only; default: the heads' lookup_tokens).
    long_tokens > 0 adds one open-writing prompt of that many new tokens, EOS ignored, timed apart. gguf_files:
    {weights: GGUF file} the llama.cpp methods of those weights run (default: made from the model's folder).
    Returns {"overall": {method: stats}, "by_category": {cat: {method: stats}}, "by_prompt", "long", "profile"}."""
    bench = _Bench(model, tokenizer, methods, max_new_tokens, sampling, preset, long_tokens, gguf_files)
    for i, row in enumerate(tqdm(rows, desc="bench", unit="prompt")):
        bench.conversation(i, row)
    long = bench.long_generation() if long_tokens else {}
    bench.close()
    return bench.result(rows, long, preset)


class _Bench:
    """One bench run: its methods' runner (warmed up), the forward counter, and what the prompts measured."""

    def __init__(self, model, tokenizer, methods, max_new_tokens, sampling, preset, long_tokens, gguf_files) -> None:
        self.model, self.tokenizer, self.base, self.device = model, tokenizer, model.base_model, model.base_model.device
        self.counter = ForwardCounter(self.base)
        self.methods = check_methods(methods)
        self.max_new_tokens, self.sampling, self.long_tokens = max_new_tokens, sampling, long_tokens
        self.gen = dict(do_sample=False) if sampling is None else dict(do_sample=True, **sampling)
        # the llama.cpp methods' engines, read from the package (where tests stand others in)
        engines = bench.llamacpp_engines(self.base, tokenizer, self.methods, sampling, max_new_tokens + long_tokens,
                                         gguf_files)
        self.runner = MethodRunner(model, engines, max_new_tokens, preset)
        warm = prompt_ids(tokenizer, "Hello").to(self.device)
        for m in self.methods:
            self.runner(m, warm, **self.gen)
        self.by_prompt: dict[str, dict[str, float]] = {}
        self.acc = defaultdict(lambda: defaultdict(lambda: {"seconds": 0.0, "tokens": 0, "forwards": 0, "mismatches": 0,
                                                            "mismatches_plain": 0, "peak_mb": 0.0}))
        self.profile = defaultdict(lambda: defaultdict(float))  # a drafting method -> its seconds per part of a step
        # medusa's tree tokens verified at a step -> [steps, new tokens]
        self.verify_sizes = defaultdict(lambda: [0, 0])

    def conversation(self, i: int, row: PromptRow) -> None:
        """Every turn of the i-th prompt, each turn's context ending in hf's reply to the turn before."""
        messages = []
        cats = ("overall", row.category or "uncategorised")
        for turn in row.turns:
            messages.append({"role": "user", "content": turn})
            ids = prompt_ids(self.tokenizer, messages).to(self.device)
            outs = self.turn(ids, i, prompt_name(i, row, len(messages) // 2 + 1), cats)
            self.compare(outs, cats)
            reply = self.tokenizer.decode(outs["hf"][0, ids.shape[1]:], skip_special_tokens=True)
            messages.append({"role": "assistant", "content": reply})

    def turn(self, ids: torch.Tensor, i: int, name: str, cats: tuple[str, str]) -> dict[str, torch.Tensor]:
        """Every method on `ids`, in the order of the i-th prompt (timing.run_round), each call's peak memory and
        target forwards read off its clock; returns each method's output ids."""
        calls0, forwards, peaks = {}, {}, {}

        def before(m: str) -> None:
            _reset_peak_rss()
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            calls0[m] = self.counter.calls

        def after(m: str) -> None:
            forwards[m] = self.runner.forwards(m, self.counter.calls - calls0[m])
            peaks[m] = _peak_mb(self.device)

        arms = {m: partial(self.runner, m, **self.gen) for m in self.methods}
        outs = {}
        for m, ((seq, stats), dt) in run_round(arms, ids, i, device_sync(self.device), before, after).items():
            outs[m] = seq
            self.add(m, cats, name, seq.shape[1] - ids.shape[1], dt, forwards[m], peaks[m], stats)
        return outs

    def add(self, m: str, cats, name: str, new: int, dt: float, forwards: int, peak: float, stats) -> None:
        self.by_prompt.setdefault(name, {})[m] = new / dt
        for cat in cats:
            a = self.acc[cat][m]
            a["seconds"] += dt
            a["tokens"] += new
            a["forwards"] += forwards
            a["peak_mb"] = max(a["peak_mb"], peak)
        if stats is not None:
            for k, v in stats.seconds.items():
                self.profile[m][k] += v
            self.profile[m]["total"] += dt
            self.profile[m]["steps"] += stats.steps
        if stats is not None and m == "medusa":
            for drafted, emitted in zip(stats.tree_sizes, stats.tokens_per_step[1:]):  # [0]: the prefill
                self.verify_sizes[drafted + 1][0] += 1
                self.verify_sizes[drafted + 1][1] += emitted

    def compare(self, outs: dict[str, torch.Tensor], cats) -> None:
        """Greedy outputs that differ from hf's, and from llama.cpp's plain decoding for its n-gram modes."""
        for m in self.methods:
            ref = plain_reference(m)
            for key, other in (("mismatches", "hf"), ("mismatches_plain", ref)):
                if self.sampling is None and other is not None and not torch.equal(outs[m], outs[other]):
                    for cat in cats:
                        self.acc[cat][m][key] += 1

    def long_generation(self) -> dict:
        """One long open-writing answer (EOS ignored): hf, then each method, in one go."""
        ids = prompt_ids(self.tokenizer, LONG_PROMPT).to(self.device)
        calls0, forwards, long = {}, {}, {}
        arms = {m: partial(self.runner, m, max_new_tokens=self.long_tokens, eos_token_id=None, **self.gen)
                for m in self.methods}
        results = run_round(arms, ids, 0, before=lambda m: calls0.__setitem__(m, self.counter.calls),
                            after=lambda m: forwards.__setitem__(
                                m, self.runner.forwards(m, self.counter.calls - calls0[m])))
        for m, ((seq, _), dt) in results.items():
            long[m] = {"tokens_per_s": (seq.shape[1] - ids.shape[1]) / dt, "tokens": seq.shape[1] - ids.shape[1],
                       "mean_accepted": (seq.shape[1] - ids.shape[1]) / max(forwards[m], 1), "seq": seq}
        for m in self.methods:
            long[m]["speedup_vs_hf"] = long[m]["tokens_per_s"] / long["hf"]["tokens_per_s"]
            long[m]["same_as_hf"] = bool(torch.equal(long[m].pop("seq"), long["hf"]["seq"])) if m != "hf" else True
        long["hf"].pop("seq")
        return long

    def close(self) -> None:
        self.counter.handle.remove()
        self.runner.close()

    def summarise(self, per_method: dict) -> dict:
        hf = per_method["hf"]
        out = {}
        for m, a in per_method.items():
            tps = a["tokens"] / a["seconds"]
            out[m] = {
                "tokens_per_s": tps,
                "mean_accepted": a["tokens"] / max(a["forwards"], 1),
                "speedup_vs_hf": tps / (hf["tokens"] / hf["seconds"]),
                "mismatches_vs_hf": a["mismatches"] if self.sampling is None else None,
                "peak_memory_mb": a["peak_mb"],
            }
            if plain_reference(m) is not None:  # an n-gram mode of llama.cpp against llama.cpp's plain decoding
                out[m]["mismatches_vs_plain"] = a["mismatches_plain"]
        return out

    def result(self, rows: list[PromptRow], long: dict, preset: str) -> dict:
        model, base = self.model, self.base
        speedups = {p: {m: v[m] / v["hf"] for m in v} for p, v in self.by_prompt.items()}
        result = {
            "overall": self.summarise(self.acc.pop("overall")),
            "by_category": {cat: self.summarise(v) for cat, v in sorted(self.acc.items())},
            "by_prompt": speedups,  # "prompt N" (", turn T"): the N-th row of the bench's prompts file
            "prompts": {prompt_name(i, r): {"id": r.id, "category": r.category, "text": r.turns[0]}
                        for i, r in enumerate(rows)},
            "long": {"max_new_tokens": self.long_tokens, "prompt": LONG_PROMPT, **long} if long else None,
            "labels": {m: method_label(m, model.config.lookup_tokens, model.adaptive and model.phrasebook() is not None)
                       for m in self.methods},
            "settings": {"model": base.name_or_path, "max_new_tokens": self.max_new_tokens, "sampling": self.sampling,
                         "prompts": len(rows), "prompts_run": sum(len(r.turns) for r in rows),
                         "tree": "adaptive" if model.adaptive else f"fixed, {model.tree.num_nodes} nodes",
                         "fixed_tree_nodes": model.tree.num_nodes, "preset": preset,
                         **runtime_settings(base, self.device),
                         "cost_model": model.cost_model_key() if model.adaptive else None},
        }
        return {**result, **self.profiles()}

    def profiles(self) -> dict:
        """Each drafting method's share of wall time and ms a step per part ("profile": medusa's), and the tree
        sizes the per-step tree verified with what each yielded ("verify_sizes"; prefill forwards not counted)."""
        out, profiles = {}, {}
        for m, seconds in self.profile.items():
            total, steps = seconds.pop("total"), seconds.pop("steps")
            parts = {k: v / total for k, v in seconds.items()}
            parts["python/other"] = 1.0 - sum(parts.values())
            profiles[m] = {"share_of_time": parts, "ms_per_step": {k: 1000 * v / steps for k, v in seconds.items()}}
        if "medusa" in profiles:
            out["profile"] = profiles["medusa"]
        if profiles:
            out["profiles"] = profiles
        if self.verify_sizes:
            total = sum(n for n, _ in self.verify_sizes.values())
            out["verify_sizes"] = {size: {"steps": n, "share": n / total, "tokens_per_step": emitted / n}
                                   for size, (n, emitted) in sorted(self.verify_sizes.items())}
        return out
