"""What a bench writes into its folder: results.json as measured, results.md (the table, the verdict against prompt
lookup and llama.cpp, the slowest category and prompt, the long generation, the per-step profiles) and speedup.png."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

from medusa_heads.llamacpp import METHODS as LLAMACPP_METHODS, plain_reference, split_method


def _sampling_text(sampling: dict | None) -> str:
    if not sampling:
        return "greedy"
    return "sampling (" + ", ".join(f"{k.replace('_', '-')} {v}" for k, v in sampling.items()) + ")"


def _setup_text(st: dict) -> str:
    """What a bench ran on, from its settings (a batch bench before this was recorded says less)."""
    kernels = ("" if "prepacked_linears" not in st
               else f"{'prepacked' if st['prepacked_linears'] else 'stock'} kernels, ")
    if st.get("int8_linears"):
        kernels = "int8 linears (oneDNN), "
    return (f"{st['prompts']} prompts, {st['dtype'].removeprefix('torch.')} on {st['device']}, "
            f"{kernels}{st['threads']} threads"
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


def open_results(result: dict, out: str | Path) -> Path:
    """The results folder `out`, made, with results.json written into it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    return out


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only), imported on first use: an optional heavy dependency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_results(result: dict, out: str | Path, methods: list[str]) -> None:
    out = open_results(result, out)
    st = result["settings"]
    labels = {m: result.get("labels", {}).get(m, m) for m in methods}
    title = (f"{st.get('model') or 'model'}: {st['max_new_tokens']} new tokens, {_sampling_text(st['sampling'])}, "
             f"tree {st['tree']}")
    lines = [f"# Benchmark: {title}", "", f"{_setup_text(st)}.", "", *_against_lookup(result),
             *_against_llamacpp(result), ""]
    lines += [*_table(result, methods, labels), *_slowest(result, methods), *_long_table(result, methods, labels),
              *_profile_lines(result)]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    _speedup_chart(result, methods, labels, [title, _setup_text(st)], out / "speedup.png")


def _table(result: dict, methods: list[str], labels: dict[str, str]) -> list[str]:
    lines = ["| category | method | tokens/s | tau | speed-up vs hf | mismatches | peak MB |",
             "|---|---|---|---|---|---|---|"]
    for cat, per in [("overall", result["overall"]), *result["by_category"].items()]:
        for m in methods:
            r = per[m]
            mm = "-" if r["mismatches_vs_hf"] is None else r["mismatches_vs_hf"]
            lines.append(f"| {cat} | {labels[m]} | {r['tokens_per_s']:.1f} | {r['mean_accepted']:.2f} | "
                         f"{r['speedup_vs_hf']:.2f} | {mm} | {r['peak_memory_mb']:.0f} |")
    return lines


def _slowest(result: dict, methods: list[str]) -> list[str]:
    """The slowest category and the slowest single prompt for the main method (medusa, else the last)."""
    lines = []
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
    return lines


def _long_table(result: dict, methods: list[str], labels: dict[str, str]) -> list[str]:
    if not result.get("long"):
        return []
    lg = result["long"]
    lines = ["", f"Long generation ({lg['max_new_tokens']} new tokens of open writing, EOS ignored):", "",
             "| method | tokens/s | tau | speed-up vs hf | same as hf |", "|---|---|---|---|---|"]
    for m in methods:
        r = lg[m]
        lines.append(f"| {labels[m]} | {r['tokens_per_s']:.1f} | {r['mean_accepted']:.2f} | {r['speedup_vs_hf']:.2f} | "
                     f"{r['same_as_hf']} |")
    return lines


def _profile_lines(result: dict) -> list[str]:
    """Each drafting method's per-step profile, and the tree sizes medusa verified."""
    lines = []
    for m, prof in result.get("profiles", {"medusa": result["profile"]} if "profile" in result else {}).items():
        lines += ["", f"Per-step profile of `{m}` (share of wall time; ms a step): "
                  + ", ".join(f"{k} {v:.1%}" + (f" ({prof['ms_per_step'][k]:.2f})" if k in prof["ms_per_step"] else "")
                              for k, v in prof["share_of_time"].items())]
    if result.get("verify_sizes"):
        lines += ["", "Tree tokens verified per step by `medusa` (root included; share of steps, new tokens per step): "
                  + ", ".join(f"{size}: {v['share']:.1%}, {v['tokens_per_step']:.2f}"
                              for size, v in result["verify_sizes"].items())]
    return lines


def _speedup_chart(result: dict, methods: list[str], labels: dict[str, str], caption: list[str], png: Path) -> None:
    """Bars of each method's speed-up over hf by category, tau beside each; the caption's lines wrapped above."""
    plt = pyplot()
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
    ax.set_title("\n".join(textwrap.fill(t, wrap) for t in caption), fontsize=8)
    for j, m in enumerate(methods):
        tau = result["overall"][m]["mean_accepted"]
        ax.annotate(f"\u03c4 {tau:.2f}", (j * width, result["overall"][m]["speedup_vs_hf"]), fontsize=6,
                    ha="center", va="bottom")
    top = max((result["overall"] if c == "overall" else result["by_category"][c])[m]["speedup_vs_hf"]
              for c in cats for m in methods)
    ax.set_ylim(0, max(top, 1.0) * 1.12)  # room for the tau labels above the tallest bar
    # the legend below the axes, where no bar is (inside, it covered the bars of some category)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=min(len(methods), 3), frameon=False)
    fig.tight_layout()
    fig.savefig(png, dpi=100, bbox_inches="tight", pad_inches=0.15)
    plt.close(fig)


def _clip(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1].rstrip() + "\u2026"

