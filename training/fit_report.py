"""fit's report: report.json (what the budget bought, every number) and report.md (its table, led by whether the
training paid against prompt lookup)."""
from __future__ import annotations

import json
from pathlib import Path

from medusa_heads.bench import lookup_verdict
from medusa_heads.training.fit_plan import BENCH_TOKENS, PHASES
from medusa_heads.training.fit_sources import source_text


def write_report(state: dict, out: Path) -> dict:
    d = state["done"]
    report = {
        "model": state["model"], "budget_s": state["budget_s"], "spent_s": state.get("spent_s"),
        "phases_s": {p: d[p]["seconds"] for p in PHASES},
        "answers": {k: d["distill"][k] for k in ("greedy", "sampled")},
        "answers_source": {**d["distill"].get("source", {"kind": "transformers"}),
                           **{k: d["distill"][k] for k in ("tokenizer", "greedy_checked", "greedy_differ")
                              if k in d["distill"]}},
        "distill_parts_s": ({"answers": d["distill"]["answers_s"], "features": d["distill"]["features_s"]}
                            if "answers_s" in d["distill"] else None),
        "train_tokens": d["train"]["train_tokens"], "eval_tokens": d["train"]["eval_tokens"],
        "steps": d["train"]["steps"], "held_out_top1": d["train"]["top1"], "recipe": state["rules"],
        "calibration": {"untrusted_timings": d["calibrate"]["untrusted_timings"], "forced": d["calibrate"]["forced"]},
        "bench": {k: d["bench"].get(k) for k in ("prompts", "tau", "speedup", "differ", "file", "per_step_tree",
                                                  "pld_speedup", "pld_tau", "llamacpp")},
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    b, r = report["bench"], report["recipe"]["recipe"]
    tree = "the per-step tree (calibrated)" if b["per_step_tree"] else "the fixed tree (no trusted cost model: " \
        f"{report['calibration']['untrusted_timings'] or 'none measured'})"
    src, parts = report["answers_source"], report["distill_parts_s"]
    if src["kind"] == "transformers":
        origin = f"{source_text(src)}, features kept during generation"
    else:
        differ = (f"; {src['greedy_differ']} of {src['greedy_checked']} greedy answers checked differ from the "
                  "target's own" if src.get("greedy_checked") is not None else "")
        origin = f"{source_text(src)}{differ}; features in a separate pass"
    phases = ", ".join(f"{p} {s:.0f} s" + (f" (answers {parts['answers']:.0f} s, features {parts['features']:.0f} s)"
                                            if p == "distill" and parts else "") for p, s in report["phases_s"].items())
    verdict = []
    if b["pld_speedup"] is not None:  # the first lines say whether the training paid against the free baseline
        verdict = [lookup_verdict(b["speedup"], b["pld_speedup"], "on this model"), ""]
    md = [f"# fit: {state['model']}", "", *verdict,
          f"Budget {state['budget_s'] / 60:.1f} min, spent {report['spent_s'] / 60:.1f} min "
          f"({phases}; the rest: loading).", "",
          "| what the budget bought | |", "|---|---|",
          f"| answers | {report['answers']['greedy']} greedy + {report['answers']['sampled']} sampled (T 0.7) |",
          f"| answers from | {origin} |",
          f"| answer tokens | {report['train_tokens']:,} training, {report['eval_tokens']:,} held out |",
          f"| heads | {r['num_heads']} × {r['condition']}-conditioned, mlp {r['mlp_size']}, "
          f"draft vocabulary {r['draft_vocab_size']} |",
          f"| training steps | {report['steps']} |",
          f"| held-out top-1, heads 1–{r['num_heads']} | {' / '.join(f'{t:.3f}' for t in report['held_out_top1'])} |",
          f"| bench | {b['prompts']} prompts of {b['file']}, {BENCH_TOKENS} new tokens, greedy |",
          f"| τ (tokens a forward) | {b['tau']:.2f} |", f"| speed-up over generate | {b['speedup']:.2f}× |",
          *([f"| prompt lookup (transformers, 10 tokens): τ, speed-up | {b['pld_tau']:.2f}, {b['pld_speedup']:.2f}× |"]
            if b["pld_speedup"] is not None else []),
          f"| outputs that differ from generate | {b['differ']} |", f"| tree used | {tree} |",
          *_llamacpp_rows(b.get("llamacpp")), ""]
    (out / "report.md").write_text("\n".join(md))
    return report


def _llamacpp_rows(ll: dict | None) -> list[str]:
    """A GGUF model's rows: the heads on llama.cpp against its own plain decoding of the same file, or why not."""
    if ll is None:
        return []
    if "skipped" in ll:
        return [f"| on llama.cpp | not run: {ll['skipped']} |"]
    return [f"| on llama.cpp, {ll['file']} ({ll['weights'].upper()}) | the heads {ll['tokens_per_s']:.1f} tokens/s "
            f"against its plain decoding's {ll['plain_tokens_per_s']:.1f}: {ll['x_plain']:.2f}×, τ {ll['tau']:.2f}, "
            f"{ll['differ']} of {ll['prompts']} outputs differ from it |"]
