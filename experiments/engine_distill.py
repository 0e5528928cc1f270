"""Answers per hour for distillation: today's `distill` (transformers' batched generate, features taken during
generation) against vLLM, as a server (`distill --engine vllm`, then the `features` pass) and in-process (vLLM's
offline LLM.generate in its own environment, then the same features pass); the same prompts, lengths and greedy
decoding; how many of vLLM's answers equal transformers'. Each contender runs alone, one after another, on an idle
machine; the answers and features stay in --out for training heads on each.

    python -m experiments.engine_distill --limit 256 --max-new-tokens 256 --out runs/engine [--features-dtype bf16]
"""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from scripts.common import parser

ROOT = Path(__file__).resolve().parent.parent
OFFLINE = r'''
import json, sys, time
from vllm import LLM, SamplingParams


def main():  # under __main__: vLLM starts its engine in a spawned process
    spec = json.load(open(sys.argv[1]))
    llm = LLM(model=spec["model"], dtype="float32", max_model_len=2048, enforce_eager=True, seed=0)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": ids} for ids in spec["prompts"]],
                        SamplingParams(temperature=0.0, max_tokens=spec["max_new_tokens"]), use_tqdm=True)
    seconds = time.perf_counter() - t0
    json.dump({"seconds": seconds,
               "answers": [[o.outputs[0].text, o.outputs[0].finish_reason != "length"] for o in outs]},
              open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
'''


def main() -> None:
    ap = parser(__doc__.split("\n\n")[0], limit=256, max_new_tokens=256, out="runs/engine")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--features-dtype", choices=["fp32", "bf16"], default="bf16",
                    help="the dtype of the features pass over vLLM's answers (`features --dtype`)")
    ap.add_argument("--table", default="results/vllm/distill/throughput.md")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")  # vLLM on both cores, as the other contenders
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    from medusa_heads.corpus import read_conversations, read_prompts
    from medusa_heads.default_model import default_model_path
    from medusa_heads.loading import load_base, load_tokenizer
    from medusa_heads.training.distill import distill
    from medusa_heads.training.features import features_from_conversations
    from medusa_heads.training.remote import prompt_token_ids

    torch.set_num_threads(2)
    prompts = out / "prompts.jsonl"
    with gzip.open(ROOT / "data" / "train_prompts.jsonl.gz", "rt") as f:
        lines = [line for line in f if line.strip()]
    rows = [json.loads(line) for line in lines]
    single = [r for r in rows if "prompt" in r][: args.limit]  # one-turn prompts: the same work for every contender
    prompts.write_text("".join(json.dumps(r) + "\n" for r in single))
    rows = read_prompts(prompts)
    model = str(default_model_path())
    base, tok = load_base(model), load_tokenizer(model)
    pass_base = base if args.features_dtype == "fp32" else load_base(model, dtype=torch.bfloat16)
    times: dict[str, dict] = json.loads((out / "times.json").read_text()) if (out / "times.json").is_file() else {}

    def save() -> None:
        (out / "times.json").write_text(json.dumps(times, indent=1))

    if "transformers" not in times:  # today's distill: features during generation
        t0 = time.perf_counter()
        distill(base, tok, rows, out / "hf.jsonl", max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                features=out / "hf-features")
        times["transformers"] = {"answers_s": time.perf_counter() - t0, "features_s": 0.0}
        save()
    if "vllm server" not in times:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "medusa_heads.cli", "distill", "--prompts", str(prompts), "--out",
                        str(out / "server.jsonl"), "--engine", "vllm", "--vllm-python", args.vllm_python,
                        "--vllm-args", "--dtype float32 --max-model-len 2048 --enforce-eager", "--concurrency",
                        str(args.concurrency), "--max-new-tokens", str(args.max_new_tokens)], check=True)
        answers = time.perf_counter() - t0
        t1 = time.perf_counter()
        features_from_conversations(pass_base, tok, read_conversations(out / "server.jsonl"), out / "server-features")
        times["vllm server"] = {"answers_s": answers, "features_s": time.perf_counter() - t1,
                                "features_dtype": args.features_dtype,
                                "note": "includes vLLM's start and the server check"}
        save()
    if "vllm in-process" not in times:
        spec = out / "offline_in.json"
        spec.write_text(json.dumps({"model": model, "max_new_tokens": args.max_new_tokens,
                                    "prompts": [prompt_token_ids(tok, [{"role": "user", "content": r.turns[0]}])
                                                for r in rows]}))
        (out / "offline.py").write_text(OFFLINE)
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
        t0 = time.perf_counter()
        subprocess.run([args.vllm_python, str(out / "offline.py"), str(spec), str(out / "offline_out.json")],
                       check=True, env=env)
        total = time.perf_counter() - t0
        res = json.loads((out / "offline_out.json").read_text())
        from medusa_heads.corpus import append_conversations

        (out / "offline.jsonl").unlink(missing_ok=True)
        append_conversations(out / "offline.jsonl", [
            {"id": r.id, "source": r.source, "messages": [{"role": "user", "content": r.turns[0]},
                                                           {"role": "assistant", "content": text, "finished": fin}]}
            for r, (text, fin) in zip(rows, res["answers"])])
        t1 = time.perf_counter()
        features_from_conversations(pass_base, tok, read_conversations(out / "offline.jsonl"),
                                    out / "offline-features")
        times["vllm in-process"] = {"answers_s": total, "generate_s": res["seconds"],
                                    "features_s": time.perf_counter() - t1, "features_dtype": args.features_dtype,
                                    "note": "answers_s includes vLLM's start"}
        save()
    ref = {c["id"]: c["messages"][-1]["content"] for c in read_conversations(out / "hf.jsonl")}
    n = len(rows)
    lines = ["# Distillation: answers per hour", "",
             f"SmolLM2-135M-Instruct, fp32, {n} one-turn training prompts (the first of data/train_prompts.jsonl.gz), "
             f"at most {args.max_new_tokens} new tokens, greedy; 2-core {_cpu()}, 2 threads; each contender alone "
             "(`python -m experiments.engine_distill`).", "",
             "| contender | answers | features | answers per hour, features included | × transformers | answers equal to transformers' |",
             "|---|---|---|---|---|---|"]
    base_rate = None
    for name, file in (("transformers", "hf.jsonl"), ("vllm server", "server.jsonl"), ("vllm in-process", "offline.jsonl")):
        t = times[name]
        total = t["answers_s"] + t["features_s"]
        rate = 3600 * n / total
        base_rate = base_rate or rate
        got = {c["id"]: c["messages"][-1]["content"] for c in read_conversations(out / file)}
        same = sum(got.get(k, "").strip() == v.strip() for k, v in ref.items())
        lines.append(f"| {name} | {t['answers_s']:.0f} s | {t['features_s']:.0f} s | {rate:,.0f} | "
                     f"{rate / base_rate:.2f}× | {same}/{len(ref)} |")
    lines += ["", "transformers keeps features while it generates (batch of "
              f"{args.batch_size}); vLLM's answers get theirs from `features --dtype {args.features_dtype}` after "
              "(padded batches; the target in that dtype for the pass, the features stored in bf16 either way). The server's "
              f"time includes starting vLLM and the server check; {args.concurrency} requests in flight."]
    Path(args.table).parent.mkdir(parents=True, exist_ok=True)
    Path(args.table).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _cpu() -> str:
    from medusa_heads.machine import cpu_name

    return cpu_name()


if __name__ == "__main__":
    main()
