"""vLLM serves our heads losslessly through the plugin (vllm_plugin/): the check behind `make test-vllm` (see README
"Serving with vLLM"). An export of either layout works: `medusa-heads export --format vllm` (the plugin) or
`--format vllm-stock` (vLLM's own Medusa, Medusa-1 heads).

Three steps, each in its own interpreter (vLLM lives in .venv-vllm, with transformers < 5.20):
  .venv/bin/python -m scripts.vllm_check ours --heads DIR --out runs/vllm/ours.json
      our decoder with the same heads as a top-1 chain: greedy ids and tokens per verify step
  .venv-vllm/bin/python -m scripts.vllm_check check --export runs/vllm/heads --ours runs/vllm/ours.json
      vLLM offline with and without the heads: identical greedy ids, drafts inside the draft vocabulary, vLLM's own
      acceptance metrics next to ours; then `vllm serve` with the heads answers one chat request over HTTP
  .venv-vllm/bin/python -m scripts.vllm_check load --export runs/vllm/heads --stock runs/vllm/stock --max-tokens 64
      output tokens/s at 1, 4 and 16 concurrent requests without speculation, with the plugin, stock Medusa-1 heads,
      vLLM's ngram and suffix methods (results/vllm/serving/load.md)
Every step fails with a non-zero exit and one line naming what differed. Offline work stays under __main__ because
vLLM starts its engine in a spawned process. Run from the repository's root, which puts the project's own modules on
the path in .venv-vllm too (it does not install them)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

from medusa_heads.calibration.timing import arm_order, timed, timings  # imports torch alone
from scripts.common import REQUIRED, Option, parser, shared

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

    torch.set_num_threads(args.threads)
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
    """Start vLLM's OpenAI server on 127.0.0.1 with the heads (the README's command), send one greedy
    chat-completions request, stop the server."""
    from medusa_heads.local_server import LocalServer, free_port

    port = free_port()
    # `vllm serve` itself stops at importlib.metadata.version("vllm") in the vllm-cpu distribution; this is the same
    # OpenAI-compatible server under its older module name
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", base, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "smollm2", "--dtype", ENGINE["dtype"], "--max-model-len", str(ENGINE["max_model_len"]),
           "--enforce-eager", "--seed", "0", "--speculative-config", json.dumps(spec_config(export)),
           "--model-loader-extra-config", json.dumps(ENGINE["model_loader_extra_config"])]
    server = LocalServer(cmd, port, ROOT / "runs" / "vllm" / "serve.log", "vllm serve", RuntimeError,
                         env={**os.environ, **ENV})
    try:
        server.start(timeout)
    except RuntimeError as e:
        fail(str(e))
    try:
        body = {"model": "smollm2", "messages": [{"role": "user", "content": prompt}], "temperature": 0.0,
                "max_tokens": max_tokens}
        req = urllib.request.Request(f"{server.url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=max(60.0, timeout)) as r:
            return json.loads(r.read())["choices"][0]["message"]["content"]
    finally:
        server.stop()


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
    out = ROOT / "results" / "vllm" / "serving" / "check.json"
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
    print(f"vllm_check: OK ({report['seconds']:.0f} s; results/vllm/serving/check.json)")


# The load table's contenders: name -> speculative_config (None: no speculation). "plugin" runs the export given
# with --export (the shipped heads through vllm_plugin/), "plugin-N" the same with N draft tokens, "stock" a
# `--format vllm-stock` export (Medusa-1 heads on vLLM's own Medusa) given with --stock; ngram and suffix are vLLM's
# own draft-free methods on the same prompts (suffix needs the arctic-inference package).
def contenders(args: argparse.Namespace) -> dict[str, dict | None]:
    found = {"none": None, "plugin": spec_config(args.export),
             **{f"plugin-{n}": spec_config(args.export, n) for n in (3, 2, 1)},
             "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
             "suffix": {"method": "suffix", "num_speculative_tokens": 8}}
    if args.stock:
        found["stock"] = spec_config(args.stock)
    if args.fast:
        found |= {"fast": spec_config(args.fast), **{f"fast-{n}": spec_config(args.fast, n) for n in (3, 2, 1)}}
    return {k: v for k, v in found.items() if k in args.methods.split(",")}


def engine(base: str, spec: dict | None):
    from vllm import LLM

    return LLM(model=base, disable_log_stats=spec is None, speculative_config=spec, **ENGINE)


def run_load(args: argparse.Namespace) -> None:
    from vllm import SamplingParams

    base = base_dir()
    runs = contenders(args)
    totals: dict[tuple[str, int], list[float]] = {}
    metrics: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    for rep in range(args.repeats):  # the order reverses each pass, so drift hits every contender alike
        for name in arm_order(runs, rep):
            if name in skipped:
                continue
            try:
                llm = engine(base, runs[name])
            except Exception as e:  # noqa: BLE001 - a method this vLLM cannot run is a row saying why, not a crash
                skipped[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                print({"method": name, "skipped": skipped[name]}, flush=True)
                continue
            llm.generate([{"prompt_token_ids": p} for p in chat_token_ids(base, prompts(2))],
                         SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)  # warm
            for c in args.concurrency:
                ids = chat_token_ids(base, prompts(c))
                params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
                outs, dt = timed(lambda llm=llm: llm.generate([{"prompt_token_ids": p} for p in ids], params,
                                                              use_tqdm=False))
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                tot = totals.setdefault((name, c), [0, 0.0])
                tot[0], tot[1] = tot[0] + n, tot[1] + dt
                print({"method": name, "concurrency": c, "tokens": n, "seconds": round(dt, 2)}, flush=True)
            if runs[name] is not None:
                metrics[name] = spec_metrics(llm)
            del llm
    rows = [{"method": m, "concurrency": c, "tokens": n, "seconds": round(s, 2), "tokens_per_s": round(n / s, 1)}
            for (m, c), (n, s) in totals.items()]
    out = ROOT / "results" / "vllm" / "serving" / "load.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"max_tokens": args.max_tokens, "repeats": args.repeats, "engine": ENGINE, "env": ENV,
                               "contenders": runs, "rows": rows, "metrics": metrics, "skipped": skipped}, indent=1) + "\n")
    table = load_table(rows, metrics, skipped, args.concurrency)
    (out.parent / "load.md").write_text(
        f"vLLM 0.32 (vllm-cpu), SmolLM2-135M-Instruct, fp32, eager, 2 cores; {args.max_tokens} new tokens per request "
        f"(ignore_eos), greedy, bench prompts; offline API, C requests at once; {args.repeats} passes, contenders "
        f"alternating; `{' '.join(sys.argv[1:])}`\n\n{table}\n")
    print(table)


def run_root_cost(args: argparse.Namespace) -> None:
    """What deriving the root token costs the plugin per step (the export's `root`: the target's whole LM head, or its
    draft-vocabulary rows), beside the whole draft (every head), both timed alternately in this process (plain torch)."""
    import torch

    from safetensors.torch import load_file
    from vllm_plugin.medusa_heads_vllm.heads import DraftHeads  # the plugin's source (installed in .venv-vllm alone)

    torch.set_num_threads(args.threads)
    cfg = json.loads((Path(args.export) / "config.json").read_text())
    heads = DraftHeads(cfg["medusa_heads"], cfg["hidden_size"], cfg["vocab_size"])
    heads.load_state(load_file(Path(args.export) / "model.safetensors").items())
    rows = []
    with torch.no_grad():
        for n in args.concurrency:
            h = torch.randn(n, cfg["hidden_size"])
            # alternating, the draft first on even rounds; the first 4 rounds warm up
            times = timings({"draft": heads.draft, "root": heads.root_token}, [h] * (args.repeats * 2 + 4), skip=4).seconds
            med = {k: 1000 * sorted(v)[len(v) // 2] for k, v in times.items()}
            rows.append({"rows": n, "root_ms": round(med["root"], 3), "draft_ms": round(med["draft"], 3)})
            print(rows[-1], flush=True)
    load = ROOT / "results" / "vllm" / "serving" / "load.json"
    step = None
    if load.is_file():
        plain = {r["concurrency"]: r["tokens_per_s"] for r in json.loads(load.read_text())["rows"] if r["method"] == "none"}
        step = {c: 1000 * c / tps for c, tps in plain.items()}  # ms a vLLM step takes at c requests, no speculation
    lines = [f"| rows (requests in the step) | root ({heads.root}): LM head rows + argmax, ms | whole draft (root + 4 heads), ms | root / draft |"
             + (" root / a vLLM step without speculation |" if step else ""), "|---|---|---|---|" + ("---|" if step else "")]
    for r in rows:
        extra = f" {r['root_ms'] / step[r['rows']]:.1%} |" if step and r["rows"] in step else (" – |" if step else "")
        lines.append(f"| {r['rows']} | {r['root_ms']:.2f} | {r['draft_ms']:.2f} | {r['root_ms'] / r['draft_ms']:.0%} |" + extra)
    out = Path(args.out)
    out.write_text(f"The plugin's root token ({heads.root} root: the target's LM head, {len(heads._rows) if heads.root == 'draft' else cfg['vocab_size']:,} "
                   f"× {cfg['hidden_size']} rows, over each request's hidden state), heads in {heads._rows.dtype}, engine fp32, {args.threads} threads, median of {args.repeats} alternating timings; "
                   f"`{' '.join(sys.argv[1:])}`\n\n" + "\n".join(lines) + "\n")
    print(out.read_text())


NAMES = {"none": "vLLM, no speculation", "plugin": "plugin, shipped heads, 4 tokens",
         **{f"plugin-{n}": f"plugin, shipped heads, {n} token{'s' * (n > 1)}" for n in (3, 2, 1)}, "stock": "stock Medusa-1 (serving heads)",
         "fast": "plugin, draft root, bf16 heads, 4 tokens",
         **{f"fast-{n}": f"plugin, draft root, bf16 heads, {n} token{'s' * (n > 1)}" for n in (3, 2, 1)},
         "ngram": "vLLM ngram (4 tokens)", "suffix": "vLLM suffix"}


def load_table(rows: list[dict], metrics: dict, skipped: dict, concurrency: list[int]) -> str:
    """Tokens/s of each contender at each concurrency, as a ratio to no speculation, and its acceptance length."""
    by = {(r["method"], r["concurrency"]): r["tokens_per_s"] for r in rows}
    head = "| method | " + " | ".join(f"{c} request{'s' * (c > 1)}" for c in concurrency) + " | mean acceptance length |"
    lines = [head, "|---" * (len(concurrency) + 2) + "|"]
    for m in dict.fromkeys(r["method"] for r in rows):
        cells = [f"{by[m, c]} tok/s" if m == "none" else f"{by[m, c] / by['none', c]:.2f}× ({by[m, c]})" for c in concurrency]
        accept = f"{metrics[m]['mean_acceptance_length']:.2f}" if m in metrics else "–"
        lines.append(f"| {NAMES.get(m, m)} | " + " | ".join(cells) + f" | {accept} |")
    lines += [f"| {NAMES.get(m, m)} | not run: {why} |" + " |" * len(concurrency) for m, why in skipped.items()]
    return "\n".join(lines)


def main() -> None:
    p = parser(__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    o = shared(sub.add_parser("ours"), out=REQUIRED,
               threads=Option(2, "torch threads (1 while other work shares the cores)"))
    o.add_argument("--heads", required=True)
    rc = shared(sub.add_parser("root-cost"), "threads", out=str(ROOT / "results" / "vllm" / "serving" / "root_cost.md"))
    rc.add_argument("--export", required=True)
    rc.add_argument("--repeats", type=int, default=30)
    rc.add_argument("--concurrency", type=lambda t: [int(x) for x in t.split(",")], default=[1, 4, 16])
    for s in (o, sub.add_parser("check"), sub.add_parser("load")):
        s.add_argument("--n", type=int, default=16)
        s.add_argument("--max-tokens", type=int, default=128)
        if s is not o:
            s.add_argument("--export", required=True, help="the heads exported with `medusa-heads export --format vllm`")
    c = sub.choices["check"]
    c.add_argument("--ours", default=None, help="the JSON `ours` wrote, to print our acceptance length beside vLLM's")
    c.add_argument("--serve-timeout", type=float, default=600.0, help="seconds for `vllm serve` to start and answer")
    ld = sub.choices["load"]
    ld.add_argument("--repeats", type=int, default=2, help="passes over the contenders (the order reverses each pass)")
    ld.add_argument("--stock", default=None, help="a `--format vllm-stock` export, for vLLM's own Medusa")
    ld.add_argument("--fast", default=None, help="a `--format vllm --root draft --draft-dtype bf16` export")
    ld.add_argument("--methods", default="none,plugin,plugin-3,plugin-2,plugin-1,stock,ngram,suffix", help="contenders (see contenders())")
    ld.add_argument("--concurrency", type=lambda t: [int(x) for x in t.split(",")], default=[1, 4, 16])
    args = p.parse_args()
    if args.cmd not in ("ours", "root-cost"):
        os.environ.update(ENV)
        if args.cmd == "check":
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, to see its drafts
    {"ours": run_ours, "check": run_check, "load": run_load, "root-cost": run_root_cost}[args.cmd](args)


if __name__ == "__main__":
    main()
