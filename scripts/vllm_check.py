"""vLLM serves our heads losslessly through the plugin (vllm_plugin/): the check behind `make test-vllm` (see README
"Serving with vLLM"). An export of either layout works: `medusa-heads export --format vllm` (the plugin) or
`--format vllm-stock` (vLLM's own Medusa, Medusa-1 heads).

Three steps, each in its own interpreter (vLLM lives in .venv-vllm, with transformers < 5.20):
  .venv/bin/python scripts/vllm_check.py ours --heads DIR --out runs/vllm/ours.json
      our decoder with the same heads as a top-1 chain: greedy ids and tokens per verify step
  .venv-vllm/bin/python scripts/vllm_check.py check --export runs/vllm/heads --ours runs/vllm/ours.json
      vLLM offline with and without the heads: identical greedy ids, drafts inside the draft vocabulary, vLLM's own
      acceptance metrics next to ours; then `vllm serve` with the heads answers one chat request over HTTP
  .venv-vllm/bin/python scripts/vllm_check.py load --export runs/vllm/heads
      output tokens/s with and without the heads at 1, 4 and 16 concurrent requests (results/vllm/load.md)
Every step fails with a non-zero exit and one line naming what differed. Offline work stays under __main__ because
vLLM starts its engine in a spawned process."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "data" / "bench_prompts.jsonl"
# vLLM on this CPU: fp32 (greedy equality), eager, a small KV cache, both cores. vLLM 0.32's own Medusa registers the
# token_map tensor while loading but never reports it loaded, so its strict weight check must be off for a stock
# export with a draft vocabulary (the plugin needs no such setting; it does no harm there).
ENGINE = dict(dtype="float32", max_model_len=2048, enforce_eager=True, seed=0,
              model_loader_extra_config={"enable_weights_track": False})
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}


def prompts(n: int) -> list[str]:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    return [rows[i % len(rows)]["prompt"] for i in range(n)]


def fail(msg: str) -> None:
    raise SystemExit(f"vllm_check: FAIL: {msg}")


# ---- ours (project venv) --------------------------------------------------------------------------------------------
def run_ours(args: argparse.Namespace) -> None:
    import torch

    from medusa_heads import MedusaModel, default_model_path
    from medusa_heads.prompting import prompt_ids
    from transformers import AutoTokenizer

    torch.set_num_threads(2)
    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = MedusaModel.from_pretrained(path, heads=args.heads, tree="chain-4", draft_dtype=torch.float32)  # as vLLM
    rows, tokens, steps = [], 0, 0
    for p in prompts(args.n):
        ids = prompt_ids(tok, p)
        res = model.generate(ids, max_new_tokens=args.max_tokens, prompt_lookup_num_tokens=0, return_dict_in_generate=True)
        per_step = res.stats.tokens_per_step[1:]  # verify steps; [0] is the prefill, which vLLM does not count either
        tokens, steps = tokens + sum(per_step), steps + len(per_step)
        rows.append(res.sequences[0, ids.shape[1]:].tolist())
    out = {"heads": str(args.heads), "tree": "chain-4", "n": args.n, "max_tokens": args.max_tokens,
           "mean_acceptance_length": tokens / max(steps, 1), "ids": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out) + "\n")
    print(f"ours: chain-4, {args.n} prompts, {tokens / max(steps, 1):.3f} tokens per verify step")


# ---- vLLM (.venv-vllm) ----------------------------------------------------------------------------------------------
def base_dir() -> str:
    cache = os.environ.get("MEDUSA_HEADS_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "medusa-heads"
    path = Path(cache) / "smollm2-135m-instruct"
    if not (path / "model.safetensors").is_file():
        fail(f"{path} is missing: run `make setup && .venv/bin/python -c 'import medusa_heads; medusa_heads.default_model_path()'`")
    return str(path)


def spec_config(export: str, tokens: int | None = None) -> dict:
    """vLLM's speculative_config for an export: every head drafts unless `tokens` says fewer (the plugin only)."""
    n = json.loads((Path(export) / "config.json").read_text())["medusa_num_heads"]
    return {"method": "medusa", "model": str(export), "num_speculative_tokens": tokens or n}


def draft_vocabulary(export: str) -> set[int] | None:
    """The token ids an export may draft (None: all): the plugin's draft_vocab or stock vLLM's token_map."""
    from safetensors import safe_open

    with safe_open(str(Path(export) / "model.safetensors"), "pt") as f:
        key = next((k for k in ("draft_vocab", "token_map") if k in f.keys()), None)
        return None if key is None else set(f.get_tensor(key).tolist())


def chat_token_ids(base: str, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for t in texts]


def spec_metrics(llm) -> dict:
    m = {x.name: x for x in llm.get_metrics() if x.name.startswith("vllm:spec_decode")}
    drafts = m["vllm:spec_decode_num_drafts"].value
    accepted = m["vllm:spec_decode_num_accepted_tokens"].value
    per_pos = m["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    return {"drafts": drafts, "draft_tokens": m["vllm:spec_decode_num_draft_tokens"].value, "accepted_tokens": accepted,
            "accepted_per_position": list(per_pos), "mean_acceptance_length": 1 + accepted / max(drafts, 1),
            "acceptance_rate_per_position": [a / max(drafts, 1) for a in per_pos]}


def offline(base: str, ids: list[list[int]], max_tokens: int, export: str | None, record: bool = False):
    """Greedy ids of every prompt (one batch), the engine, and the drafts vLLM proposed (with `record`)."""
    from vllm import LLM, SamplingParams

    drafted: list = []
    if record:  # the engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, executor "uni"), so wrap its drafter
        from vllm.v1.spec_decode.medusa import MedusaProposer

        propose = MedusaProposer.propose

        def recording(self, *a, **kw):
            out = propose(self, *a, **kw)
            drafted.append(out.detach().cpu())
            return out

        MedusaProposer.propose = recording
    kw = dict(ENGINE, distributed_executor_backend="uni") if record else dict(ENGINE)
    llm = LLM(model=base, disable_log_stats=False, speculative_config=spec_config(export) if export else None, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], SamplingParams(temperature=0.0, max_tokens=max_tokens),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm, drafted


def serve_reply(base: str, export: str, prompt: str, max_tokens: int, timeout: float) -> str:
    """Start `vllm serve` on 127.0.0.1 with the heads, send one greedy chat-completions request, stop the server."""
    port = 8000 + os.getpid() % 1000
    # `vllm serve` itself stops at importlib.metadata.version("vllm") in the vllm-cpu distribution; this is the same
    # OpenAI-compatible server under its older module name
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", base, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "smollm2", "--dtype", ENGINE["dtype"], "--max-model-len", str(ENGINE["max_model_len"]),
           "--enforce-eager", "--seed", "0", "--speculative-config", json.dumps(spec_config(export)),
           "--model-loader-extra-config", json.dumps(ENGINE["model_loader_extra_config"])]
    (ROOT / "runs" / "vllm").mkdir(parents=True, exist_ok=True)
    log = open(ROOT / "runs" / "vllm" / "serve.log", "w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **ENV})
    try:
        deadline = time.monotonic() + timeout
        while True:
            if server.poll() is not None:
                fail(f"vllm serve exited with {server.returncode} before it was ready (runs/vllm/serve.log)")
            if time.monotonic() > deadline:
                fail(f"vllm serve was not ready within {timeout:.0f} s (runs/vllm/serve.log)")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(2)
        body = {"model": "smollm2", "messages": [{"role": "user", "content": prompt}], "temperature": 0.0,
                "max_tokens": max_tokens}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=max(60.0, deadline - time.monotonic())) as r:
            return json.loads(r.read())["choices"][0]["message"]["content"]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        log.close()


def run_check(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    t0 = time.monotonic()
    base = base_dir()
    texts = prompts(args.n)
    ids = chat_token_ids(base, texts)
    plain, llm, _ = offline(base, ids, args.max_tokens, None)
    del llm
    spec, llm, drafted = offline(base, ids, args.max_tokens, args.export, record=True)
    metrics = spec_metrics(llm)
    del llm
    differ = [i for i, (a, b) in enumerate(zip(plain, spec)) if a != b]
    allowed = draft_vocabulary(args.export)
    drafts = {t for d in drafted for t in d.flatten().tolist()}
    outside = sorted(drafts - allowed) if allowed is not None else []
    ours = json.loads(Path(args.ours).read_text()) if args.ours else None
    tok = AutoTokenizer.from_pretrained(base)
    offline_text = tok.decode(plain[0], skip_special_tokens=True)
    t_serve = time.monotonic()
    reply = serve_reply(base, args.export, texts[0], args.max_tokens, args.serve_timeout)
    report = {
        "prompts": args.n, "max_tokens": args.max_tokens, "engine": {k: v for k, v in ENGINE.items()}, "env": ENV,
        "export": str(args.export), "architecture": json.loads((Path(args.export) / "config.json").read_text())["architectures"],
        "outputs_differ": differ, "vllm": metrics, "distinct_drafted_tokens": len(drafts), "drafted_outside_vocabulary": outside,
        "ours": None if ours is None else {"mean_acceptance_length": ours["mean_acceptance_length"], "tree": ours["tree"],
                                           "ids_equal_to_vllm": sum(a == b for a, b in zip(ours["ids"], plain))},
        "serve": {"reply_equals_offline": reply == offline_text, "seconds": round(time.monotonic() - t_serve, 1)},
        "seconds": round(time.monotonic() - t0, 1),
    }
    out = ROOT / "results" / "vllm" / "check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"vllm_check: {args.n} prompts x {args.max_tokens} tokens, greedy, fp32: {args.n - len(differ)}/{args.n} identical "
          f"with and without the heads")
    print(f"vllm_check: vLLM drafted {metrics['draft_tokens']} tokens in {metrics['drafts']} drafts, accepted "
          f"{metrics['accepted_tokens']}; mean acceptance length {metrics['mean_acceptance_length']:.3f}"
          + ("" if ours is None else f", ours (chain-4, same heads and prompts) {ours['mean_acceptance_length']:.3f}"))
    print(f"vllm_check: per-position acceptance {[round(a, 3) for a in metrics['acceptance_rate_per_position']]}; "
          f"{len(drafts)} distinct drafted tokens, {len(outside)} outside the draft vocabulary")
    print(f"vllm_check: vllm serve chat reply {'equals' if reply == offline_text else 'DIFFERS FROM'} the offline greedy reply")
    if differ:
        fail(f"greedy ids differ with the heads on prompts {differ}")
    if not drafted or metrics["drafts"] == 0:
        fail("vLLM proposed no drafts: the heads did not run")
    if outside:
        fail(f"vLLM drafted {len(outside)} tokens outside the draft vocabulary, e.g. {outside[:5]}")
    if reply != offline_text:
        fail(f"vllm serve replied {reply[:80]!r}, offline greedy gave {offline_text[:80]!r}")
    print(f"vllm_check: OK ({report['seconds']:.0f} s; results/vllm/check.json)")


def run_load(args: argparse.Namespace) -> None:
    from vllm import SamplingParams

    base = base_dir()
    totals: dict[tuple[bool, int], list[float]] = {}
    metrics = None
    for rep in range(args.repeats):  # engines alternate, without and with the heads first, so drift hits both alike
        for export in (None, args.export) if rep % 2 == 0 else (args.export, None):
            _, llm, _ = offline(base, chat_token_ids(base, prompts(2)), 16, export)  # engine up and warm
            for c in (1, 4, 16):
                ids = chat_token_ids(base, prompts(c))
                params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
                t = time.perf_counter()
                outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
                dt = time.perf_counter() - t
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                tot = totals.setdefault((export is not None, c), [0, 0.0])
                tot[0], tot[1] = tot[0] + n, tot[1] + dt
                print({"heads": export is not None, "concurrency": c, "tokens": n, "seconds": round(dt, 2)}, flush=True)
            if export:
                metrics = spec_metrics(llm)
            del llm
    rows = [{"heads": h, "concurrency": c, "tokens": n, "seconds": round(s, 2), "tokens_per_s": round(n / s, 1)}
            for (h, c), (n, s) in sorted(totals.items())]
    rows.append({"heads": True, "metrics": metrics})
    out = ROOT / "results" / "vllm" / "load.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"max_tokens": args.max_tokens, "repeats": args.repeats, "engine": ENGINE, "env": ENV,
                               "rows": rows}, indent=1) + "\n")
    table = load_table(rows)
    (out.parent / "load.md").write_text(
        f"vLLM 0.32 (vllm-cpu), SmolLM2-135M-Instruct, fp32, eager, 2 cores; {args.max_tokens} new tokens per request "
        f"(ignore_eos), greedy; offline API, C prompts at once; {args.repeats} passes, engines alternating\n\n{table}\n")
    print(table)


def load_table(rows: list[dict]) -> str:
    """The README's load table: tokens/s without and with the heads at each concurrency, and their ratio."""
    by = {(r["heads"], r["concurrency"]): r["tokens_per_s"] for r in rows if "concurrency" in r}
    lines = ["| concurrent requests | tokens/s, vLLM | tokens/s, vLLM + serving heads | ratio |", "|---|---|---|---|"]
    lines += [f"| {c} | {by[False, c]} | {by[True, c]} | {by[True, c] / by[False, c]:.2f} |" for c in (1, 4, 16)]
    accept = [r["metrics"]["mean_acceptance_length"] for r in rows if "metrics" in r]
    return "\n".join(lines) + (f"\n\nvLLM's mean acceptance length in these runs: {accept[0]:.2f}" if accept else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("ours")
    o.add_argument("--heads", required=True)
    o.add_argument("--out", required=True)
    for s in (o, sub.add_parser("check"), sub.add_parser("load")):
        s.add_argument("--n", type=int, default=16)
        s.add_argument("--max-tokens", type=int, default=128)
        if s is not o:
            s.add_argument("--export", required=True, help="the heads exported with `medusa-heads export --format vllm`")
    c = sub.choices["check"]
    c.add_argument("--ours", default=None, help="the JSON `ours` wrote, to print our acceptance length beside vLLM's")
    c.add_argument("--serve-timeout", type=float, default=600.0, help="seconds for `vllm serve` to start and answer")
    sub.choices["load"].add_argument("--repeats", type=int, default=2, help="passes over both engines (order alternates)")
    args = p.parse_args()
    if args.cmd != "ours":
        os.environ.update(ENV)
        if args.cmd == "check":
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, to see its drafts
    {"ours": run_ours, "check": run_check, "load": run_load}[args.cmd](args)


if __name__ == "__main__":
    main()
