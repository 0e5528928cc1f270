"""Benchmark against transformers' own decoding, in one process, alternating the order per prompt."""
from __future__ import annotations

import json
import textwrap
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from medusa_heads import llamacpp
from medusa_heads.config import DEFAULT_TREE
from medusa_heads.corpus import PromptRow
from medusa_heads.engines.llamacpp import LlamaCppEngine
from medusa_heads.kernels.int8 import is_int8
from medusa_heads.kernels.prepack import is_prepacked, stock_kernels
from medusa_heads.llamacpp import METHODS as LLAMACPP_METHODS, plain_reference, split_method
from medusa_heads.machine import hardware
from medusa_heads.prompting import eos_ids, prompt_ids, prompt_text, user_turn
from medusa_heads.tree import list_presets


class ForwardCounter:
    """Counts target forwards (to get tau for any method, transformers' own included): the calls of its decoder,
    which every forward runs, the model's own and a greedy verify's without the LM head (medusa_heads/kernels/screen.py)."""

    def __init__(self, model) -> None:
        self.calls = 0
        decoder = getattr(model, "get_decoder", lambda: model)()
        self.handle = (decoder if isinstance(decoder, torch.nn.Module) else model).register_forward_pre_hook(self._count)

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


PLD_TOKENS = 10  # prompt lookup's continuation length: method "pld" and a bare "+pld"
PLAIN_METHODS = ("hf", "hf-stock", "pld")
MEDUSA_METHODS = ("medusa", "medusa-static", "medusa-preset")  # and medusa:PRESET; each may end in +pld / +pldN


def parse_method(method: str) -> tuple[str, int | None]:
    """A bench method -> (its name before any "+pld", prompt-lookup tokens: None = the heads' own lookup_tokens);
    ValueError naming the valid methods for anything else."""
    name, plus, lookup = method.partition("+pld")
    medusa = name in MEDUSA_METHODS or (name.startswith("medusa:") and name.split(":", 1)[1] in list_presets())
    if method in PLAIN_METHODS or (medusa and not plus):
        return method, None
    if medusa and (lookup == "" or lookup.isdigit()):
        return name, PLD_TOKENS if lookup == "" else int(lookup)
    raise ValueError(f"unknown bench method {method!r}; methods: {', '.join(PLAIN_METHODS + MEDUSA_METHODS)}, "
                     f"medusa:PRESET (PRESET: {', '.join(list_presets())}), a medusa method + '+pldN' "
                     f"(prompt lookup of N tokens; '+pld0': heads only), llamacpp (all of: "
                     f"{', '.join(LLAMACPP_METHODS)})")


def check_methods(methods: list[str]) -> list[str]:
    """The methods to run, checked, without repeats, hf (the reference) first; "llamacpp" stands for every
    llama.cpp method (medusa_heads/llamacpp.py), "llamacpp-ngram" for its n-gram modes."""
    methods = llamacpp.expand([m.strip() for m in methods if m.strip()])
    for m in methods:
        if m not in llamacpp.METHODS:
            parse_method(m)
    return list(dict.fromkeys(["hf", *methods]))


def method_label(method: str, heads_lookup: int, phrasebook: bool = False) -> str:
    """What a method runs, for tables and charts: e.g. "medusa (heads + lookup 10)", "medusa+pld0 (heads only)";
    phrasebook: the heads' phrasebook drafts in the per-step tree ("heads + phrasebook + lookup 10")."""
    if method in LLAMACPP_METHODS:
        weights, mode, heads = split_method(method)
        if heads:
            return f"heads on llama.cpp {weights.upper()}"
        return f"llama.cpp {weights.upper()}" + (f" + {mode} self-speculation" if mode else "")
    name, lookup = parse_method(method)
    if name == "hf":
        return "hf"
    if name == "hf-stock":
        return "hf-stock (stock kernels)"
    if name == "pld":
        return f"pld (lookup {PLD_TOKENS})"
    lookup = heads_lookup if lookup is None else lookup
    heads = "heads + phrasebook" if phrasebook and name == "medusa" else "heads"
    return f"{method} ({heads + ' only' if lookup == 0 else f'{heads} + lookup {lookup}'})"


def _sampling_text(sampling: dict | None) -> str:
    if not sampling:
        return "greedy"
    return "sampling (" + ", ".join(f"{k.replace('_', '-')} {v}" for k, v in sampling.items()) + ")"


LONG_PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle. Take your time."


def run_bench(model, tokenizer, rows: list[PromptRow], methods: list[str], max_new_tokens: int = 128,
              sampling: dict | None = None, preset: str = DEFAULT_TREE, long_tokens: int = 0) -> dict:
    """methods: hf, hf-stock, pld, medusa (as configured: the per-step tree for calibrated heads), medusa-static
    (the heads' fixed tree), medusa-preset (`preset`), medusa:NAME (preset NAME), each medusa method optionally
    with "+pld" / "+pldN" (prompt lookup of N tokens; "+pld0": heads only; default: the heads' lookup_tokens).
    long_tokens > 0 adds one open-writing prompt of that many new tokens, EOS ignored, timed apart.
    Returns {"overall": {method: stats}, "by_category": {cat: {method: stats}}, "by_prompt", "long", "profile"}."""
    base = model.base_model
    device = base.device
    counter = ForwardCounter(base)
    methods = check_methods(methods)
    trees = {"medusa": None, "medusa-static": model.tree, "medusa-preset": preset}  # None: the model's default
    gen = dict(do_sample=False) if sampling is None else dict(do_sample=True, **sampling)
    engines = llamacpp_engines(base, tokenizer, methods, sampling, max_new_tokens + long_tokens)
    llama_forwards = {}  # a llama.cpp method's target forwards at its last call (its own count; no hook sees them)
    on_llama = {m: model.on_engine(e) for m, e in engines.items() if split_method(m)[2]}  # the heads on llama.cpp

    def call(method: str, ids: torch.Tensor, max_new_tokens: int = max_new_tokens, **gen):
        if method in on_llama:
            res = on_llama[method].generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                            return_dict_in_generate=True, **gen)
            llama_forwards[method] = res.stats.steps
            return res.sequences, res.stats
        if method in engines:
            new, llama_forwards[method] = engines[method].generate(ids[0].tolist(), max_new_tokens,
                                                                   ignore_eos="eos_token_id" in gen)
            return torch.cat([ids, torch.tensor([new], dtype=ids.dtype, device=ids.device)], dim=1), None
        if method == "hf":
            return base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, **gen), None
        if method == "hf-stock":  # transformers' generate on PyTorch's stock kernels (differs from hf if prepacked)
            with stock_kernels(base):
                return base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, **gen), None
        if method == "pld":
            return base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 prompt_lookup_num_tokens=PLD_TOKENS, **gen), None
        name, lookup = parse_method(method)
        extra = {} if lookup is None else dict(prompt_lookup_num_tokens=lookup)
        res = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             tree=trees[name] if name in trees else name.split(":", 1)[1],
                             return_dict_in_generate=True, **gen, **extra)
        return res.sequences, res.stats

    warm = prompt_ids(tokenizer, "Hello").to(device)
    for m in methods:
        call(m, warm, **gen)
    by_prompt: dict[str, dict[str, float]] = {}

    acc = defaultdict(lambda: defaultdict(lambda: {"seconds": 0.0, "tokens": 0, "forwards": 0, "mismatches": 0, "mismatches_plain": 0,
                                                 "peak_mb": 0.0}))
    profile = defaultdict(lambda: defaultdict(float))  # a drafting method -> its seconds per part of a step
    verify_sizes = defaultdict(lambda: [0, 0])  # medusa's tree tokens verified at a step -> [steps, new tokens]
    for i, row in enumerate(tqdm(rows, desc="bench", unit="prompt")):
        messages = []
        for turn in row.turns:
            messages.append({"role": "user", "content": turn})
            ids = prompt_ids(tokenizer, messages).to(device)
            order = methods if i % 2 == 0 else methods[::-1]
            outs = {}
            for m in order:
                _reset_peak_rss()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats(device)
                calls0, t0 = counter.calls, time.perf_counter()
                seq, stats = call(m, ids, **gen)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                outs[m] = seq
                new = seq.shape[1] - ids.shape[1]
                by_prompt.setdefault(prompt_name(i, row, len(messages) // 2 + 1), {})[m] = new / dt
                for cat in ("overall", row.category or "uncategorised"):
                    a = acc[cat][m]
                    a["seconds"] += dt
                    a["tokens"] += new
                    a["forwards"] += llama_forwards[m] if m in engines else counter.calls - calls0
                    a["peak_mb"] = max(a["peak_mb"], _peak_mb(device))
                if stats is not None:
                    for k, v in stats.seconds.items():
                        profile[m][k] += v
                    profile[m]["total"] += dt
                    profile[m]["steps"] += stats.steps
                if stats is not None and m == "medusa":
                    for drafted, emitted in zip(stats.tree_sizes, stats.tokens_per_step[1:]):  # [0]: the prefill
                        verify_sizes[drafted + 1][0] += 1
                        verify_sizes[drafted + 1][1] += emitted
            for m in methods:
                ref = plain_reference(m)
                for key, other in (("mismatches", "hf"), ("mismatches_plain", ref)):
                    if sampling is None and other is not None and not torch.equal(outs[m], outs[other]):
                        for cat in ("overall", row.category or "uncategorised"):
                            acc[cat][m][key] += 1
            reply = tokenizer.decode(outs["hf"][0, ids.shape[1]:], skip_special_tokens=True)
            messages.append({"role": "assistant", "content": reply})
    long = {}
    if long_tokens:  # one long open-writing answer (EOS ignored): hf, then each method, in one go
        ids = prompt_ids(tokenizer, LONG_PROMPT).to(device)
        for m in methods:
            calls0, t0 = counter.calls, time.perf_counter()
            seq, _ = call(m, ids, max_new_tokens=long_tokens, eos_token_id=None, **gen)
            dt = time.perf_counter() - t0
            forwards = llama_forwards[m] if m in engines else counter.calls - calls0
            long[m] = {"tokens_per_s": (seq.shape[1] - ids.shape[1]) / dt, "tokens": seq.shape[1] - ids.shape[1],
                       "mean_accepted": (seq.shape[1] - ids.shape[1]) / max(forwards, 1), "seq": seq}
        for m in methods:
            long[m]["speedup_vs_hf"] = long[m]["tokens_per_s"] / long["hf"]["tokens_per_s"]
            long[m]["same_as_hf"] = bool(torch.equal(long[m].pop("seq"), long["hf"]["seq"])) if m != "hf" else True
        long["hf"].pop("seq")
    counter.handle.remove()
    for engine in engines.values():
        engine.close()

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
            if plain_reference(m) is not None:  # an n-gram mode of llama.cpp against llama.cpp's plain decoding
                out[m]["mismatches_vs_plain"] = a["mismatches_plain"]
        return out

    speedups = {p: {m: v[m] / v["hf"] for m in v} for p, v in by_prompt.items()}
    result = {
        "overall": summarise(acc.pop("overall")),
        "by_category": {cat: summarise(v) for cat, v in sorted(acc.items())},
        "by_prompt": speedups,  # "prompt N" (", turn T"): the N-th row of the bench's prompts file
        "prompts": {prompt_name(i, r): {"id": r.id, "category": r.category, "text": r.turns[0]} for i, r in enumerate(rows)},
        "long": {"max_new_tokens": long_tokens, "prompt": LONG_PROMPT, **long} if long else None,
        "labels": {m: method_label(m, model.config.lookup_tokens, model.adaptive and model.phrasebook() is not None)
                   for m in methods},
        "settings": {"model": base.name_or_path, "max_new_tokens": max_new_tokens, "sampling": sampling, "prompts": len(rows),
                     "prompts_run": sum(len(r.turns) for r in rows),
                     "tree": "adaptive" if model.adaptive else f"fixed, {model.tree.num_nodes} nodes",
                     "fixed_tree_nodes": model.tree.num_nodes, "preset": preset,
                     "threads": torch.get_num_threads(), "device": str(device), "dtype": str(base.dtype),
                     "prepacked_linears": is_prepacked(base), "int8_linears": is_int8(base), "hardware": hardware(device),
                     "cost_model": model.cost_model_key() if model.adaptive else None},
    }
    profiles = {}
    for m, seconds in profile.items():
        total, steps = seconds.pop("total"), seconds.pop("steps")
        parts = {k: v / total for k, v in seconds.items()}
        parts["python/other"] = 1.0 - sum(parts.values())
        profiles[m] = {"share_of_time": parts, "ms_per_step": {k: 1000 * v / steps for k, v in seconds.items()}}
    if "medusa" in profiles:
        result["profile"] = profiles["medusa"]
    if profiles:
        result["profiles"] = profiles
    if verify_sizes:  # what the per-step tree chose, and what each size yielded (prefill forwards not counted)
        total = sum(n for n, _ in verify_sizes.values())
        result["verify_sizes"] = {size: {"steps": n, "share": n / total, "tokens_per_step": emitted / n}
                                  for size, (n, emitted) in sorted(verify_sizes.items())}
    return result


def llamacpp_engines(base, tokenizer, methods: list[str], sampling: dict | None, n_tokens: int) -> dict:
    """The llama.cpp methods' engines, built (once per machine) and loaded before any timing."""
    wanted = [m for m in methods if m in LLAMACPP_METHODS]
    if not wanted:
        return {}
    if sampling is not None:
        raise ValueError("the llama.cpp methods decode greedily: leave out --do-sample or the llamacpp methods")
    folder = llamacpp.model_folder(base, tokenizer)
    threads = torch.get_num_threads()
    n_ctx = 4096 + n_tokens
    eos = eos_ids(getattr(base, "generation_config", None), base.config)
    engines = {}
    try:
        for m in wanted:
            weights, mode, heads = split_method(m)
            path = llamacpp.gguf(folder, weights)
            if heads:
                engines[m] = LlamaCppEngine(path, weights, threads, n_ctx)
            elif mode:
                engines[m] = llamacpp.Server(path, mode, threads, n_ctx, eos)
            else:
                engines[m] = llamacpp.Plain(path, threads, n_ctx)
    except BaseException:
        for engine in engines.values():
            engine.close()
        raise
    return engines


def prompt_name(i: int, row, turn: int | None = None) -> str:
    """A bench prompt's name in results: its place in the prompts file ("prompt 3", "prompt 3, turn 2"), not its
    id (which says where a prompt was drawn from, e.g. train_prompts:12104 for a held-out training prompt)."""
    return f"prompt {i + 1}" + (f", turn {turn}" if turn is not None and len(row.turns) > 1 else "")


def _setup_text(st: dict) -> str:
    """What a bench ran on, from its settings (a batch bench before this was recorded says less)."""
    kernels = "" if "prepacked_linears" not in st else f"{'prepacked' if st['prepacked_linears'] else 'stock'} kernels, "
    if st.get("int8_linears"):
        kernels = "int8 linears (oneDNN), "
    return (f"{st['prompts']} prompts, {st['dtype'].removeprefix('torch.')} on {st['device']}, {kernels}{st['threads']} threads"
            + (f", {st['hardware']}" if st.get("hardware") else "")
            + (f"; per-step trees sized by the cost model {st['cost_model']}" if st.get("cost_model") else ""))


def lookup_verdict(ours: float, pld: float, where: str = "here") -> str:
    """One line on whether the heads (`ours`× generate) beat transformers' prompt lookup (`pld`× generate), the
    baseline that needs no training; `bench` and `fit` open their reports with it."""
    verdict = "beat" if ours > pld else "do not beat"
    advice = "" if ours > pld else (" Use prompt lookup (`generate(..., prompt_lookup_num_tokens=10)`) or train "
                                    "longer (`fit` with a larger --budget).")
    return (f"**The heads {verdict} transformers' prompt lookup {where}**: {ours:.2f}× against {pld:.2f}× "
            f"`generate` ({ours / pld:.2f}× prompt lookup).{advice}")


def _against_lookup(result: dict) -> list[str]:
    overall = result["overall"]
    if "pld" not in overall or "medusa" not in overall:
        return []
    return [lookup_verdict(overall["medusa"]["speedup_vs_hf"], overall["pld"]["speedup_vs_hf"])]


def _against_llamacpp(result: dict) -> list[str]:
    """The heads against llama.cpp on the same prompts: llama.cpp's plain decoding per weight type, the heads on
    llama.cpp at each weight type against its plain decoding there, and its best n-gram self-speculation."""
    overall, runs = result["overall"], result["settings"].get("prompts_run", result["settings"].get("prompts"))
    ours = [m for m in LLAMACPP_METHODS if m in overall and split_method(m)[2]]
    plain = [m for m in LLAMACPP_METHODS if m in overall and plain_reference(m) is None]
    ngram = [m for m in LLAMACPP_METHODS if m in overall and split_method(m)[1]]
    lines = []
    if "medusa" in overall and plain:
        tps = overall["medusa"]["tokens_per_s"]
        rel = ", ".join(f"{tps / overall[m]['tokens_per_s']:.2f}× llama.cpp {split_method(m)[0].upper()} "
                        f"({overall[m]['tokens_per_s']:.1f} tokens/s)" for m in plain)
        lines.append(f"**Against llama.cpp**: the heads decode at {tps:.1f} tokens/s: {rel}.")
    for m in ours:
        r, ref = overall[m], plain_reference(m)
        vs = f", {r['tokens_per_s'] / overall[ref]['tokens_per_s']:.2f}× its plain decoding" if ref in overall else ""
        same = f"; {r['mismatches_vs_plain']} of {runs} outputs differ from it" if ref in overall else ""
        lines.append(f"**The heads on llama.cpp {split_method(m)[0].upper()}**: {r['tokens_per_s']:.1f} tokens/s{vs}, "
                     f"τ {r['mean_accepted']:.2f}{same}.")
    if ngram:
        best = max(ngram, key=lambda m: overall[m]["tokens_per_s"])
        b, ref = overall[best], plain_reference(best)
        vs = f", {b['tokens_per_s'] / overall[ref]['tokens_per_s']:.2f}× its plain decoding" if ref in overall else ""
        lines.append(f"llama.cpp's best n-gram self-speculation here is {best.removeprefix('llamacpp-')}: "
                     f"{b['tokens_per_s']:.1f} tokens/s{vs}, τ {b['mean_accepted']:.2f}; "
                     f"{b['mismatches_vs_plain']} of {runs} outputs differ from its plain decoding.")
    return lines


def write_results(result: dict, out: str | Path, methods: list[str]) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    st = result["settings"]
    labels = {m: result.get("labels", {}).get(m, m) for m in methods}
    title = (f"{st.get('model') or 'model'}: {st['max_new_tokens']} new tokens, {_sampling_text(st['sampling'])}, "
             f"tree {st['tree']}")
    lines = [f"# Benchmark: {title}", "", f"{_setup_text(st)}.", "", *_against_lookup(result),
             *_against_llamacpp(result), ""]
    header = "| category | method | tokens/s | tau | speed-up vs hf | mismatches | peak MB |"
    lines += [header, "|---|---|---|---|---|---|---|"]
    for cat, per in [("overall", result["overall"]), *result["by_category"].items()]:
        for m in methods:
            r = per[m]
            mm = "-" if r["mismatches_vs_hf"] is None else r["mismatches_vs_hf"]
            lines.append(f"| {cat} | {labels[m]} | {r['tokens_per_s']:.1f} | {r['mean_accepted']:.2f} | {r['speedup_vs_hf']:.2f} | {mm} | {r['peak_memory_mb']:.0f} |")
    main = "medusa" if "medusa" in methods else methods[-1]
    cats = result["by_category"]
    if cats:
        slow = min(cats, key=lambda c: cats[c][main]["speedup_vs_hf"])
        lines += ["", f"Slowest category for `{main}`: {slow} ({cats[slow][main]['speedup_vs_hf']:.2f}x)."]
    if result.get("by_prompt"):
        per = result["by_prompt"]
        worst = min(per, key=lambda p: per[p][main])
        about = result.get("prompts", {}).get(worst.split(",")[0])
        text = "" if not about else (f" ({about['category'] + ', ' if about.get('category') else ''}"
                                      f"\"{_clip(about['text'], 60)}\")")
        lines.append(f"Slowest single prompt for `{main}`: {worst}{text}: {per[worst][main]:.2f}x.")
    if result.get("long"):
        lg = result["long"]
        lines += ["", f"Long generation ({lg['max_new_tokens']} new tokens of open writing, EOS ignored):", "",
                  "| method | tokens/s | tau | speed-up vs hf | same as hf |", "|---|---|---|---|---|"]
        for m in methods:
            r = lg[m]
            lines.append(f"| {labels[m]} | {r['tokens_per_s']:.1f} | {r['mean_accepted']:.2f} | {r['speedup_vs_hf']:.2f} | {r['same_as_hf']} |")
    for m, prof in result.get("profiles", {"medusa": result["profile"]} if "profile" in result else {}).items():
        lines += ["", f"Per-step profile of `{m}` (share of wall time; ms a step): "
                  + ", ".join(f"{k} {v:.1%}" + (f" ({prof['ms_per_step'][k]:.2f})" if k in prof["ms_per_step"] else "")
                              for k, v in prof["share_of_time"].items())]
    if result.get("verify_sizes"):
        lines += ["", "Tree tokens verified per step by `medusa` (root included; share of steps, new tokens per step): "
                  + ", ".join(f"{size}: {v['share']:.1%}, {v['tokens_per_step']:.2f}" for size, v in result["verify_sizes"].items())]
    (out / "results.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = ["overall", *result["by_category"]]
    width_in = max(7, 1.2 * len(cats) * len(methods) / 2)
    fig, ax = plt.subplots(figsize=(width_in, 4.5))
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        vals = [(result["overall"] if c == "overall" else result["by_category"][c])[m]["speedup_vs_hf"] for c in cats]
        tau = result["overall"][m]["mean_accepted"]
        ax.bar([i + j * width for i in range(len(cats))], vals, width, label=f"{labels[m]}: \u03c4 {tau:.2f}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cats))], cats, rotation=30, ha="right")
    ax.set_ylabel("speed-up vs transformers generate")
    # the settings line wrapped to the figure (at 8 pt, ~15 characters an inch), never clipped at its edges
    wrap = max(40, int(width_in * 15))
    ax.set_title("\n".join(textwrap.fill(t, wrap) for t in (title, _setup_text(st))), fontsize=8)
    for j, m in enumerate(methods):
        tau = result["overall"][m]["mean_accepted"]
        ax.annotate(f"\u03c4 {tau:.2f}", (j * width, result["overall"][m]["speedup_vs_hf"]), fontsize=6, ha="center", va="bottom")
    top = max((result["overall"] if c == "overall" else result["by_category"][c])[m]["speedup_vs_hf"]
              for c in cats for m in methods)
    ax.set_ylim(0, max(top, 1.0) * 1.12)  # room for the tau labels above the tallest bar
    # the legend below the axes, where no bar is (inside, it covered the bars of some category)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=min(len(methods), 3), frameon=False)
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=100, bbox_inches="tight", pad_inches=0.15)
    plt.close(fig)


def _clip(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1].rstrip() + "\u2026"


def run_batch_bench(model, tokenizer, rows: list[PromptRow], batch_sizes: list[int], max_new_tokens: int = 128) -> dict:
    """Greedy throughput of transformers' batched generate against MedusaModel on the same left-padded batches,
    for each batch size; the same prompts (the first turns of as many rows as the largest size divides) for all
    sizes, alternating which method goes first. Returns {"by_batch": {B: {...}}, "settings": {...}}."""
    base = model.base_model
    device = base.device
    counter = ForwardCounter(base)
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    n = len(rows) // max(batch_sizes) * max(batch_sizes)
    if n == 0:
        raise ValueError(f"need at least {max(batch_sizes)} prompts for batch size {max(batch_sizes)}, got {len(rows)}")
    texts = [prompt_text(tokenizer, user_turn(r.turns[0])) for r in rows[:n]]
    eos = set(eos_ids(model.generation_config_for().eos_token_id))

    def new_tokens(seq: torch.Tensor, width: int) -> int:
        total = 0
        for row in seq[:, width:].tolist():
            total += next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        return total

    warm = tokenizer(texts[:2], return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    base.generate(**warm, max_new_tokens=4, do_sample=False, pad_token_id=pad)
    model.generate(warm["input_ids"], attention_mask=warm["attention_mask"], max_new_tokens=4, pad_token_id=pad)
    out = {}
    for size in batch_sizes:
        acc = {m: {"seconds": 0.0, "tokens": 0, "row_forwards": 0} for m in ("hf", "medusa")}
        mismatches = 0
        for i in tqdm(range(0, n, size), desc=f"batch {size}", unit="batch"):
            enc = tokenizer(texts[i : i + size], return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            outs = {}
            for m in (("hf", "medusa") if (i // size) % 2 == 0 else ("medusa", "hf")):
                calls0, t0 = counter.calls, time.perf_counter()
                if m == "hf":
                    seq = base.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
                    rows_fwd = (counter.calls - calls0) * size
                else:
                    res = model.generate(enc["input_ids"], attention_mask=enc["attention_mask"], max_new_tokens=max_new_tokens,
                                         pad_token_id=pad, return_dict_in_generate=True)
                    seq, rows_fwd = res.sequences, sum(res.stats.rows_per_step) or res.stats.steps
                if device.type == "cuda":
                    torch.cuda.synchronize()
                acc[m]["seconds"] += time.perf_counter() - t0
                acc[m]["tokens"] += new_tokens(seq, enc["input_ids"].shape[1])
                acc[m]["row_forwards"] += rows_fwd
                outs[m] = seq
            mismatches += sum(not torch.equal(a, b) for a, b in zip(outs["hf"], outs["medusa"])) if outs["hf"].shape == outs["medusa"].shape else size
        hf_tps = acc["hf"]["tokens"] / acc["hf"]["seconds"]
        md_tps = acc["medusa"]["tokens"] / acc["medusa"]["seconds"]
        out[size] = {"hf_tokens_per_s": hf_tps, "medusa_tokens_per_s": md_tps, "speedup_vs_hf": md_tps / hf_tps,
                     "mean_accepted": acc["medusa"]["tokens"] / max(acc["medusa"]["row_forwards"], 1),
                     "mismatched_rows": mismatches, "rows": n}
    counter.handle.remove()
    cost = model.cost_model() if model.adaptive else None
    tree = "per-step trees, one size per batch" if cost is not None and cost.batched else f"{model.tree.num_nodes}-node tree"
    return {"by_batch": out, "settings": {"model": base.name_or_path, "max_new_tokens": max_new_tokens, "prompts": n, "tree_nodes": model.tree.num_nodes,
                                          "tree": tree,
                                          "threads": torch.get_num_threads(), "device": str(device), "dtype": str(base.dtype),
                                          "prepacked_linears": is_prepacked(base), "int8_linears": is_int8(base), "hardware": hardware(device),
                                          "cost_model": model.cost_model_key() if cost is not None and cost.batched else None}}


def write_batch_results(result: dict, out: str | Path) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    st = result["settings"]
    title = (f"{st.get('model') or 'model'}: {st['max_new_tokens']} new tokens, greedy, batched, "
             f"{st.get('tree') or str(st['tree_nodes']) + '-node tree'}")
    lines = [f"# Batched throughput: {title}", "",
             f"{_setup_text(st)}.", "",
             "| batch | hf tokens/s | medusa tokens/s | speed-up | tau per row | mismatched rows |", "|---|---|---|---|---|---|"]
    for b, r in result["by_batch"].items():
        lines.append(f"| {b} | {r['hf_tokens_per_s']:.1f} | {r['medusa_tokens_per_s']:.1f} | {r['speedup_vs_hf']:.2f} | "
                     f"{r['mean_accepted']:.2f} | {r['mismatched_rows']}/{r['rows']} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(result["by_batch"])
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([int(s) for s in sizes], [result["by_batch"][s]["speedup_vs_hf"] for s in sizes], "o-")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("batch size")
    ax.set_title(title, fontsize=8)
    ax.set_ylabel("speed-up vs transformers generate")
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=100)
    plt.close(fig)
