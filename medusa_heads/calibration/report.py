"""The report of `medusa-heads calibrate --report DIR`: what the per-step tree runs on, as measured (report.md,
reliability.png, calibration.json). A later run that measures only some parts keeps the others' details."""
from __future__ import annotations

import json
from pathlib import Path

from medusa_heads.config import MedusaConfig
from medusa_heads.tree.adaptive import CostModel, LookupAcceptance

REPORT_SIZES = (1, 2, 4, 8, 16, 32)


def write_report(config: MedusaConfig, details: dict, folder: str | Path) -> Path:
    """details: this run's measurements ("acceptance", "lookup", "cost" settings per kernels key), merged into
    DIR/calibration.json over an earlier run's; the cost tables themselves are read from config.adaptive."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "calibration.json"
    merged = json.loads(path.read_text()) if path.exists() else {}
    merged.update({k: v for k, v in details.items() if k != "cost"})
    merged["cost"] = {k: {**merged.get("cost", {}).get(k, {}), **v}
                      for k, v in {**merged.get("cost", {}), **details.get("cost", {})}.items()}
    path.write_text(json.dumps(merged, indent=1) + "\n")
    adaptive = config.adaptive or {}
    lines = ["# Calibration of the per-step tree", ""]
    if "acceptance" in merged:
        lines += _acceptance_md(merged["acceptance"])
        _plot_reliability(merged["acceptance"], folder / "reliability.png")
    if "lookup" in merged and "lookup" in adaptive:
        lines += _lookup_md(merged["lookup"], LookupAcceptance.from_dict(adaptive["lookup"]))
    if "ngrams" in merged and "ngrams" in adaptive:
        lines += ["## The phrasebook (n-gram store)", "", "```", ngram_table(merged["ngrams"]), "```", ""]
    for key, cost in sorted(adaptive.get("cost", {}).items()):
        lines += _cost_md(key, CostModel.from_dict(cost), merged["cost"].get(key, {}))
        lines += _greedy_md(key, CostModel.from_dict(cost))
        lines += _batch_md(key, CostModel.from_dict(cost))
        _plot_cost(key, CostModel.from_dict(cost), folder / f"cost-{key}.png")
    out = folder / "report.md"
    out.write_text("\n".join(lines) + "\n")
    return out


def _acceptance_md(a: dict) -> list[str]:
    s = a["summary"]
    lines = [
        "## Acceptance of a drafted token given its parent was accepted",
        "",
        f"Each head's top-{a['depths'][0]['topk']} candidates (softmax over the draft vocabulary; path-conditioned "
        "heads given the true path above) at every held-out answer position where the true tokens above are each in "
        "their head's top-k (so the parent is in the tree and accepted), labelled by the true token. Fitted on one "
        "half of the held-out conversations (split by prompt), scored on the other; the stored bins are refitted on "
        "both.",
        "",
        f"Stored: **{a['method']}** (temperature's log-loss {_relative(s)} isotonic's; isotonic is kept unless the "
        f"temperature is better by more than 1%). Log-loss on the test half: raw {s['raw']['log_loss']:.4f}, isotonic "
        f"{s['isotonic']['log_loss']:.4f}, temperature {s['temperature']['log_loss']:.4f}; Brier: raw "
        f"{s['raw']['brier']:.4f}, isotonic {s['isotonic']['brier']:.4f}, temperature {s['temperature']['brier']:.4f}.",
        "",
        "| depth | test positions | candidates | observed | raw mean | isotonic mean | temperature mean (T) | "
        "observed top-1 | isotonic top-1 | log-loss raw / iso / temp | Brier raw / iso / temp |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in a["depths"]:
        lines.append(
            f"| {r['depth']} | {r['test_positions']:,} | {r['test_positions'] * r['topk']:,} | {r['observed']:.4f} | "
            f"{r['raw']['mean']:.4f} | {r['isotonic']['mean']:.4f} | {r['temperature']['mean']:.4f} ({r['T']:.2f}) | "
            f"{r['observed_top1']:.3f} | {r['isotonic']['mean_top1']:.3f} | "
            f"{r['raw']['log_loss']:.4f} / {r['isotonic']['log_loss']:.4f} / {r['temperature']['log_loss']:.4f} | "
            f"{r['raw']['brier']:.4f} / {r['isotonic']['brier']:.4f} / {r['temperature']['brier']:.4f} |")
    edges = a["edges"]
    lines += ["", "Isotonic bins fitted on the first half (acceptance by head probability):", "",
              "| depth | " + " | ".join(f"[{lo:g}, {hi:g})" for lo, hi in zip(edges, edges[1:])) + " |",
              "|---" * len(edges) + "|"]
    lines += [f"| {r['depth']} | " + " | ".join(f"{x:.3f}" for x in r["isotonic_fit"]) + " |" for r in a["depths"]]
    lines += ["", "![reliability](reliability.png)", ""]
    return lines


def _relative(s: dict) -> str:
    iso, temp = s["isotonic"]["log_loss"], s["temperature"]["log_loss"]
    return f"{abs(1 - temp / iso):.1%} {'below' if temp < iso else 'above'}"


def _lookup_md(d: dict, lookup: LookupAcceptance) -> list[str]:
    n_max = d["max_tokens"]
    lines = [
        "## Prompt lookup",
        "",
        f"Held-out answers walked as decoding with prompt lookup alone would ({d['roots']:,} roots, each after the "
        f"tokens the step before accepted): prompt lookup (n-grams {d['min_ngram']}..{d['max_ngram']}, longest "
        f"first, up to {n_max} tokens) over the conversation so far; acceptance of continuation token j given token "
        f"j - 1 was accepted, by the length of the n-gram that matched ({d['max_ngram']}: at least {d['max_ngram']}). "
        "Stored. Counts in parentheses.",
        "",
    ]
    lines += _lookup_rows(d, lookup.ngrams, lookup.rates)
    dense = d.get("every_position")
    if dense:
        lines += ["", f"The same at every answer token ({dense['roots']:,} roots; not stored: positions deep inside a "
                  "copied run, which decoding crosses in a few steps, weigh in as often as the step after a miss):", ""]
        lines += _lookup_rows(dense, lookup.ngrams, dense["rates"])
    return lines + [""]


def _lookup_rows(d: dict, ngrams, rates) -> list[str]:
    n_max = d["max_tokens"]
    lines = ["| n-gram | matched | " + " | ".join(f"j={j + 1}" for j in range(n_max)) + " |",
             "|---|---|" + "---|" * n_max]
    for i, (n, row) in enumerate(zip(ngrams, rates)):
        cells = [f"{x:.3f} ({t:,})" for x, t in zip(row, d["tried"][i])]
        lines.append(f"| {n} | {d['matched'][i]:,} ({d['matched'][i] / d['roots']:.1%}) | " + " | ".join(cells) + " |")
    return lines


def _cost_md(key: str, cost: CostModel, settings: dict) -> list[str]:
    how = ", ".join(f"{k} {v}" for k, v in settings.items() if k not in ("batches", "greedy"))
    lines = [
        f"## Cost: {key}",
        "",
        f"Verify milliseconds (median; size 1 = a plain decoding step) by tree tokens and cached context ({how}). "
        f"One drafting level (a head's top-k for 4 parents, mean over the heads): {cost.draft_ms:.2f} ms; "
        f"the loop's own work {cost.loop_ms:.2f} ms a step, {cost.overhead_ms:.2f} ms more for a tree. Each cell: "
        f"measured, then (in brackets) what the tree "
        f"selection charges after the {cost.fit!r} fit.",
        "",
        "| tree tokens | " + " | ".join(f"ctx {c}" for c in cost.contexts) + " |",
        "|---|" + "---|" * len(cost.contexts),
    ]
    fitted = [cost.verify_ms(c) for c in cost.contexts]
    for s, size in enumerate(cost.sizes):
        lines.append(f"| {size} | "
                     + " | ".join(f"{row[s]:.1f} ({fit[size - 1]:.1f})" for row, fit in zip(cost.ms, fitted)) + " |")
    return lines + [""]


def _greedy_md(key: str, cost: CostModel) -> list[str]:
    """A greedy verify's milliseconds (the screen, no LM head) beside the full verify's; empty where not measured."""
    if cost.greedy is None:
        return []
    g = cost.for_greedy()
    lines = [f"## Cost of a greedy verify: {key}", "",
             "Verify milliseconds (median) when only each node's argmax is needed (medusa_heads/kernels/screen.py: "
             "no fp32 LM head), then (in brackets) the full verify's from the table above, both as the tree "
             "selection charges them; greedy calls are sized by the first.", "",
             "| tree tokens | " + " | ".join(f"ctx {c}" for c in g.contexts) + " |", "|---|" + "---|" * len(g.contexts)]
    greedy, full = [g.verify_ms(c) for c in g.contexts], [cost.verify_ms(c) for c in g.contexts]
    for size in g.sizes:
        lines.append(f"| {size} | "
                     + " | ".join(f"{a[size - 1]:.1f} ({b[size - 1]:.1f})" for a, b in zip(greedy, full)) + " |")
    return lines + [""]


def _batch_md(key: str, cost: CostModel) -> list[str]:
    """A batch's verify milliseconds by rows, tree tokens per row and cached context; empty without batches."""
    if not cost.batches:
        return []
    contexts = cost.batches[0][1].contexts
    lines = [f"## Cost of a batch: {key}", "",
             "Verify milliseconds (median) of one forward over every row's tree, by tree tokens per row (size 1: a "
             "batched plain step), for each batch size and cached context per row. One row is the table above.", "",
             "| tree tokens | " + " | ".join(f"{b} rows, ctx {c}" for b, _ in cost.batches for c in contexts) + " |",
             "|---|" + "---|" * (len(cost.batches) * len(contexts))]
    for s, size in enumerate(cost.batches[0][1].sizes):
        cells = [f"{row[s]:.1f}" if s < len(row) else "" for _, table in cost.batches for row in table.ms]
        lines.append(f"| {size} | " + " | ".join(cells) + " |")
    return lines + [""]


def batch_cost_table(key: str, cost: CostModel) -> str:
    return "\n".join(_batch_md(key, cost))


def _plot_cost(key: str, cost: CostModel, png: Path) -> None:
    """Measured verify milliseconds (points) and what the tree selection charges (lines), per cached context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    n = range(1, cost.max_size + 1)
    for c, row in zip(cost.contexts, cost.ms):
        line, = ax.plot(n, cost.verify_ms(c).tolist(), "-", lw=1.5, label=f"ctx {c} ({cost.fit} fit)")
        ax.plot(cost.sizes, row, "o", ms=3, color=line.get_color())
    ax.set_xlabel("tree tokens (1 = a plain decoding step)")
    ax.set_ylabel("verify ms")
    ax.set_title(f"cost model: {key}")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def _plot_reliability(a: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = a["depths"]
    fig, axes = plt.subplots(1, len(depths), figsize=(4 * len(depths), 4), squeeze=False)
    for ax, r in zip(axes[0], depths):
        ax.plot([0, 1], [0, 1], color="0.7", lw=1)
        for name, style in (("raw", "o:"), ("isotonic", "s-"), ("temperature", "^--")):
            pts = r[name]["reliability"]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, ms=4, label=name)
        ax.set_title(f"depth {r['depth']} (test half)")
        ax.set_xlabel("predicted acceptance")
        ax.set_ylabel("observed acceptance")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
    axes[0][0].legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def tree_table(result: dict, latency: dict[int, float], positions: int) -> str:
    """The fixed-tree calibration: predicted tau and speed-up by tree size, and the chosen tree."""
    best = result["best"]
    lines = [f"held-out positions: {positions}; drafting the chosen tree {1000 * best['draft_s']:.1f} ms; "
             f"t(1) {1000 * latency[1]:.1f} ms",
             f"{'nodes':>6}{'tau':>7}{'verify ms':>11}{'pred tok/s':>12}{'pred speed-up':>15}"]
    for row in result["table"]:
        if row["nodes"] in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64) or row is best:
            lines.append(f"{row['nodes']:>6}{row['tau']:>7.2f}{1000 * latency[row['nodes'] + 1]:>11.1f}"
                         f"{row['tokens_per_s']:>12.1f}{row['speedup']:>15.2f}")
    lines.append(f"chosen: {best['nodes']} nodes, predicted tau {best['tau']:.2f}, "
                 f"predicted speed-up {best['speedup']:.2f}")
    return "\n".join(lines)


def brief(part: str, detail: dict) -> dict:
    """What the heads' config keeps of a part's measurement (the report keeps all of it)."""
    if part == "acceptance":
        return {"method": detail["method"], "summary": detail["summary"],
                "held_out_positions": detail["held_out_positions"], "temperatures": [r["T"] for r in detail["depths"]]}
    if part == "ngrams":
        return {k: detail[k]
                for k in ("roots", "entries", "min_n", "max_n", "tried", "accepted", "first_by_order", "test")}
    return {k: detail[k] for k in ("roots", "matched", "max_tokens", "max_ngram", "min_ngram", "walk")}


def acceptance_table(detail: dict) -> str:
    lines = [f"acceptance given the parent accepted, second half of the held-out conversations (fitted on the first); "
             f"stored: {detail['method']}",
             f"{'depth':>6}{'cands':>9}{'observed':>10}{'raw':>8}{'isotonic':>10}{'temp.':>8}{'T':>6}"
             f"{'logloss raw':>13}{'iso':>8}{'temp.':>8}"]
    for r in detail["depths"]:
        lines.append(f"{r['depth']:>6}{r['test_positions'] * r['topk']:>9}{r['observed']:>10.3f}"
                     f"{r['raw']['mean']:>8.3f}{r['isotonic']['mean']:>10.3f}{r['temperature']['mean']:>8.3f}"
                     f"{r['T']:>6.2f}{r['raw']['log_loss']:>13.4f}{r['isotonic']['log_loss']:>8.4f}"
                     f"{r['temperature']['log_loss']:>8.4f}")
    s = detail["summary"]
    lines.append(f"{'all':>6}{'':>63}{s['raw']['log_loss']:>13.4f}{s['isotonic']['log_loss']:>8.4f}{s['temperature']['log_loss']:>8.4f}")
    return "\n".join(lines)


def lookup_table(detail: dict, lookup) -> str:
    lines = [f"prompt lookup: {detail['roots']} roots ({detail['walk']}); acceptance of token j given j - 1 accepted, "
             "by matched n-gram",
             f"{'n':>3}{'matched':>9}" + "".join(f"{'j=' + str(j + 1):>7}" for j in range(detail["max_tokens"]))]
    for n, matched, row in zip(lookup.ngrams, detail["matched"], lookup.rates):
        lines.append(f"{n:>3}{matched:>9}" + "".join(f"{x:>7.3f}" for x in row))
    return "\n".join(lines)


def ngram_table(detail: dict) -> str:
    """Per depth: the chains that reached it where the rates were fitted, and predicted against observed acceptance
    (given the depth above accepted) on the test answers."""
    t = detail["test"]
    lines = [f"phrasebook: {detail['entries']} n-grams ({detail['min_n']}..{detail['max_n']} tokens); acceptance of "
             f"token j given j - 1 accepted, fitted on {detail['roots']} held-out roots, tested on {t['answers']} "
             f"({t['roots']} roots)",
             f"{'j':>3}{'fit: tried':>12}{'accepted':>10}{'test: tried':>13}{'observed':>10}{'predicted':>11}"]
    for j, (tried, accepted) in enumerate(zip(detail["tried"], detail["accepted"])):
        if tried or t["tried"][j]:
            lines.append(f"{j + 1:>3}{tried:>12}{accepted:>10}{t['tried'][j]:>13}{t['observed'][j]:>10.3f}"
                         f"{t['predicted'][j]:>11.3f}")
    first = ", ".join(f"{n}-grams {a / max(c, 1):.3f} of {c}" for n, (c, a) in detail["first_by_order"].items())
    lines.append(f"j = 1 by the matched n-gram (fit): {first}; rates are fitted per matched length")
    return "\n".join(lines)


def cost_table(key: str, cost) -> str:
    lines = [f"verify ms ({key}); one drafting level {cost.draft_ms:.2f} ms, the loop {cost.loop_ms:.2f} ms a step, "
             f"{cost.overhead_ms:.2f} ms more for a tree",
             f"{'size':>5}" + "".join(f"{'ctx ' + str(c):>11}" for c in cost.contexts)]
    for s, size in enumerate(cost.sizes):
        lines.append(f"{size:>5}" + "".join(f"{row[s]:>11.1f}" for row in cost.ms))
    return "\n".join(lines)
