"""Many callers at once: N threads share one model and send R greedy requests; every output must equal the
sequential one, no call may fail. The same load through transformers' generate on the same model gives the
throughput and peak-RSS baseline.

    python -m scripts.load_check [--threads 1,4,8,16] [--requests 200] [--max-new-tokens 32] [--out results/transformers/load]

Resumable: each (method, threads) row is written to OUT/load.json as it finishes, and a rerun skips it."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from medusa_heads import MedusaModel, default_model_path
from medusa_heads.prompting import prompt_ids
from medusa_heads.corpus import read_prompts
from scripts.common import parser


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current RSS


def main() -> None:
    p = parser(__doc__.split("\n\n")[0], "prompts", max_new_tokens=32, out="results/transformers/load")
    p.add_argument("--threads", default="1,4,8,16")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--torch-threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.torch_threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table_path = out / "load.json"
    rows = json.loads(table_path.read_text()) if table_path.exists() else []
    done = {(r["method"], r["threads"]) for r in rows}

    model = MedusaModel.from_pretrained("smollm2-135m-instruct", prepack=True)  # shipped heads, prompt lookup on
    tok = AutoTokenizer.from_pretrained(default_model_path())
    prompts = [prompt_ids(tok, r.turns[0]) for r in read_prompts(args.prompts)]
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    methods = {
        "hf": lambda ids: model.base_model.generate(ids, attention_mask=torch.ones_like(ids), **gen),
        "medusa": lambda ids: model.generate(ids, **gen),
    }
    reference = [methods["hf"](ids) for ids in tqdm(prompts, desc="sequential reference")]

    for n in [int(t) for t in args.threads.split(",")]:
        for name, fn in methods.items():
            if (name, n) in done:
                continue
            requests = [i % len(prompts) for i in range(args.requests)]

            def one(i: int):
                try:
                    return fn(prompts[i]), None
                except Exception as e:  # noqa: BLE001 - counted: the check is that there are none
                    return None, f"{type(e).__name__}: {e}"

            reset_peak_rss()
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=n) as pool:
                results = list(tqdm(pool.map(one, requests), total=len(requests), desc=f"{name} x{n} threads"))
            seconds = time.perf_counter() - t0
            errors = [e for _, e in results if e is not None]
            same = sum(1 for i, (o, e) in zip(requests, results) if e is None and torch.equal(o, reference[i]))
            tokens = sum(o.shape[1] - prompts[i].shape[1] for i, (o, e) in zip(requests, results) if e is None)
            rows.append(dict(method=name, threads=n, requests=len(requests), errors=len(errors),
                             error_examples=errors[:3], identical=same, tokens=tokens, seconds=round(seconds, 1),
                             tokens_per_s=round(tokens / seconds, 2), peak_rss_mb=round(peak_rss_mb())))
            table_path.write_text(json.dumps(rows, indent=1) + "\n")
            print(rows[-1], flush=True)

    by = {(r["method"], r["threads"]): r for r in rows}
    lines = [f"# Load check: one model shared by threads ({args.requests} greedy requests of {args.max_new_tokens} "
             f"new tokens over {len(prompts)} prompts of {args.prompts}, torch threads {args.torch_threads})", "",
             "| threads | method | errors | identical to sequential | tokens/s | throughput vs hf | peak RSS, MB |",
             "|---|---|---|---|---|---|---|"]
    for (name, n), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ratio = r["tokens_per_s"] / by[("hf", n)]["tokens_per_s"] if ("hf", n) in by else float("nan")
        lines.append(f"| {n} | {name} | {r['errors']} | {r['identical']} / {r['requests']} | {r['tokens_per_s']:.1f} | "
                     f"{ratio:.2f} | {r['peak_rss_mb']} |")
    (out / "load.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
