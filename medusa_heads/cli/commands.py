"""The bodies of the medusa-heads commands; medusa_heads.cli holds their arguments."""
from __future__ import annotations

import argparse
import sys
import time

from medusa_heads.prompting import prompt_ids


DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _load_base(name: str, dtype: str = "fp32", prepack: bool = True):
    """The model (CPU) and its tokenizer; with `prepack`, its linears run through oneDNN where this CPU can."""
    import torch

    from medusa_heads.loading import load_base, load_tokenizer

    return load_base(name, dtype=getattr(torch, DTYPES[dtype]), prepack=None if prepack else False), load_tokenizer(name)


def _load_medusa(args: argparse.Namespace):
    """Base model, tokenizer and MedusaModel for the generating commands (--model, --heads, --tree)."""
    import torch

    from medusa_heads.loading import load_tokenizer
    from medusa_heads.model import MedusaModel

    # from_pretrained prepacks (where this CPU can) after merging a Medusa-2 adapter into the base, heads too
    model = MedusaModel.from_pretrained(args.model, heads=args.heads or "auto", tree=getattr(args, "tree", None),
                                        dtype=getattr(torch, DTYPES[args.dtype]), prepack=None if args.prepack else False)
    return model, load_tokenizer(args.model)


def cmd_generate(args: argparse.Namespace) -> None:
    from transformers import TextStreamer

    model, tok = _load_medusa(args)
    ids = prompt_ids(tok, args.prompt)
    t = time.perf_counter()
    res = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature,
                         top_p=args.top_p, return_dict_in_generate=True, streamer=TextStreamer(tok, skip_prompt=True))
    dt = time.perf_counter() - t
    print(f"\n[{res.stats.new_tokens} tokens, {res.stats.new_tokens / dt:.1f} tokens/s, tau {res.stats.mean_accepted:.2f}]", file=sys.stderr)


def cmd_chat(args: argparse.Namespace) -> None:
    """Interactive chat with the chat template; replies stream as they are accepted, then tokens/s and tau."""
    from transformers import TextStreamer

    model, tok = _load_medusa(args)
    messages: list[dict] = []
    print("medusa-heads chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        ids = prompt_ids(tok, messages)
        t = time.perf_counter()
        sampling = dict(do_sample=True, temperature=args.temperature) if args.do_sample else {}
        res = model.generate(ids, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True,
                             streamer=TextStreamer(tok, skip_prompt=True, skip_special_tokens=True), **sampling)
        dt = time.perf_counter() - t
        messages.append({"role": "assistant", "content": tok.decode(res.sequences[0, ids.shape[1]:], skip_special_tokens=True)})
        print(f"[{res.stats.new_tokens} tokens, {res.stats.new_tokens / dt:.1f} tokens/s, tau {res.stats.mean_accepted:.2f}]", file=sys.stderr)


DEMO_PROMPTS = [
    "Explain in a few sentences why the sky is blue.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Give me three tips for a job interview.",
]


def cmd_demo(args: argparse.Namespace) -> None:
    """Greedy generation with plain generate and with Medusa, alternating; prints tokens/s, tau and equality.
    With prepacked linears (the default on a CPU) transformers' generate also runs on the stock kernels."""
    import torch

    from medusa_heads.inference.prepack import is_prepacked, stock_kernels

    torch.set_num_threads(args.threads)
    model, tok = _load_medusa(args)
    base = model.base_model
    packed = is_prepacked(base)
    tree = "chosen at each step" if model.adaptive else f"fixed, {model.tree.num_nodes} nodes"
    print(f"heads: {'trained' if model.config.extra else 'untrained (zero-initialised)'}; tree: {tree}; "
          f"linears: {'oneDNN prepacked (both methods)' if packed else 'stock kernels'}")

    def hf_stock(ids):
        with stock_kernels(base):
            return base.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)

    ids = prompt_ids(tok, "Hi")
    base.generate(ids, max_new_tokens=4, do_sample=False), model.generate(ids, max_new_tokens=4)  # warm-up
    seconds = dict.fromkeys(["hf", "medusa"] + (["hf_stock"] if packed else []), 0.0)
    n_tok = same = 0
    taus = []
    for i, prompt in enumerate(DEMO_PROMPTS):
        ids = prompt_ids(tok, prompt)
        runs = [("hf", lambda: base.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)),
                ("medusa", lambda: model.generate(ids, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True))]
        if packed:
            runs.append(("hf_stock", lambda: hf_stock(ids)))
        out = {}
        for name, fn in runs if i % 2 == 0 else runs[::-1]:  # alternate the order
            t = time.perf_counter()
            out[name] = fn()
            seconds[name] += time.perf_counter() - t
        n_tok += out["hf"].shape[1] - ids.shape[1]
        same += int(torch.equal(out["hf"], out["medusa"].sequences))
        taus.append(out["medusa"].stats.mean_accepted)
        print(f"[{i + 1}] {prompt}\n    {tok.decode(out['hf'][0, ids.shape[1]:], skip_special_tokens=True)[:160]!r}...")
    print(f"\n{'method':<36}{'tokens/s':>10}{'tau':>7}{'speed-up':>10}")
    if packed:
        print(f"{'transformers, stock kernels':<36}{n_tok / seconds['hf_stock']:>10.1f}{1.0:>7.2f}{seconds['hf'] / seconds['hf_stock']:>10.2f}")
    print(f"{'transformers' + (', prepacked' if packed else ''):<36}{n_tok / seconds['hf']:>10.1f}{1.0:>7.2f}{1.0:>10.2f}")
    print(f"{'medusa-heads' + (', prepacked' if packed else ''):<36}{n_tok / seconds['medusa']:>10.1f}{sum(taus) / len(taus):>7.2f}"
          f"{seconds['hf'] / seconds['medusa']:>10.2f}")
    print(f"identical outputs (medusa vs transformers on the same kernels): {same}/{len(DEMO_PROMPTS)}")


def cmd_distill(args: argparse.Namespace) -> None:
    import torch

    from medusa_heads.model import MedusaModel
    from medusa_heads.training.data import as_variant, read_prompts, subsample
    from medusa_heads.training.distill import distill

    if args.variant and args.temperature <= 0:
        raise SystemExit("--variant asks for a further answer to each prompt: give it a --temperature > 0, "
                         "or it would repeat the greedy answers")
    if args.threads:
        torch.set_num_threads(args.threads)
    caps = {}
    for c in args.cap:
        source, _, n = c.partition("=")
        if not n.isdigit():
            raise SystemExit(f"--cap expects SOURCE=N, got {c!r}")
        caps[source] = int(n)
    rows = subsample(read_prompts(args.prompts), caps, seed=args.seed)[: args.limit]
    if args.variant:
        rows = as_variant(rows, args.variant)
    base, tok = _load_base(args.model, prepack=args.prepack)
    medusa = MedusaModel.from_pretrained(base, heads=args.heads) if args.heads else None
    counts = distill(base, tok, rows, args.out, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                     temperature=args.temperature, medusa=medusa, seed=args.seed, features=args.features)
    print(f"distill: {counts}", file=sys.stderr)


def cmd_features(args: argparse.Namespace) -> None:
    import torch

    from medusa_heads.training.data import read_conversations
    from medusa_heads.training.features import features_from_conversations

    torch.set_num_threads(args.threads)
    base, tok = _load_base(args.model, prepack=args.prepack)
    n = features_from_conversations(base, tok, read_conversations(args.data), args.features)
    print(f"features: added {n} conversations to {args.features}", file=sys.stderr)


def cmd_train(args: argparse.Namespace) -> None:
    import torch

    from medusa_heads.training.recipe import TrainRecipe
    from medusa_heads.training.trainer import train

    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = list(args.set)
    for key in ("data", "out", "features", "max_steps"):
        if getattr(args, key) is not None:
            overrides.append(f"{key}={getattr(args, key)}")
    recipe = TrainRecipe.load(args.config, overrides)
    out = train(recipe, resume=args.resume)
    print(f"heads written to {out}", file=sys.stderr)


def cmd_calibrate(args: argparse.Namespace) -> None:
    """Measure on held-out data and this machine, and write into the heads' config: the fixed tree that maximises
    predicted tokens/s (part "tree"), and what the per-step tree runs on (config.adaptive): calibrated acceptance
    ("acceptance"), prompt lookup's acceptance ("lookup"), verify and drafting time for these kernels ("cost")."""
    import torch

    from medusa_heads.checkpoint import load_config, save_config
    from medusa_heads.inference.prepack import is_prepacked
    from medusa_heads.model import MedusaModel
    from medusa_heads.training.data import read_conversations
    from medusa_heads.training.features import load_segments
    from medusa_heads.training.data import is_eval
    from medusa_heads.tree.adaptive import kernels_key
    from medusa_heads.calibration.measure import PARTS, calibrate_acceptance, candidate_samples, choose_tree, correct_ranks, draft_latency
    from medusa_heads.calibration.measure import lookup_acceptance, measure_cost, merge_adaptive, tokenized_answers, verify_latency
    from medusa_heads.tree.calibrate import rank_paths

    parts = [p for p in args.parts.split(",") if p]
    if not parts or set(parts) - set(PARTS):
        raise SystemExit(f"--parts takes a comma-separated list of {', '.join(PARTS)}, got {args.parts!r}")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, DTYPES[args.dtype])
    config = load_config(args.heads)
    prepack = args.prepack and args.device in (None, "cpu")
    model = MedusaModel.from_pretrained(args.model, heads=args.heads, dtype=dtype, device_map=args.device, prepack=prepack)
    fraction = config.extra.get("recipe", {}).get("eval_fraction", 0.05)
    conversations = [c for c in read_conversations(args.data) if is_eval(c["id"], fraction)]
    if not conversations:
        raise SystemExit(f"no held-out conversations (eval fraction {fraction}) in {args.data}")
    held_out = []
    if {"tree", "acceptance"} & set(parts):
        ids = {c["id"] for c in conversations}
        held_out = load_segments(args.features, keep_ids=ids)
        if not held_out:
            raise SystemExit(f"no features for the {len(ids)} held-out conversations of {args.data} in {args.features} "
                             f"(compute them with: medusa-heads features --data ... --features {args.features})")
    details = {}
    if "tree" in parts:
        ranks = correct_ranks(model.heads, held_out, topk=args.topk)
        paths = rank_paths(ranks)
        latency = verify_latency(model.target, list(range(1, args.max_nodes + 2)), context=args.context, repeats=args.repeats)
        t_heads = lambda spec: draft_latency(model.heads, spec)  # noqa: E731
        t_overhead = args.overhead_ms / 1000
        result = choose_tree(paths, latency, t_heads, t_overhead, args.max_nodes)
        best = result["best"]
        print(f"held-out positions: {len(ranks)}; drafting the chosen tree {1000 * best['draft_s']:.1f} ms; t(1) {1000 * latency[1]:.1f} ms")
        print(f"{'nodes':>6}{'tau':>7}{'verify ms':>11}{'pred tok/s':>12}{'pred speed-up':>15}")
        for row in result["table"]:
            if row["nodes"] in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64) or row is best:
                print(f"{row['nodes']:>6}{row['tau']:>7.2f}{1000 * latency[row['nodes'] + 1]:>11.1f}{row['tokens_per_s']:>12.1f}{row['speedup']:>15.2f}")
        print(f"chosen: {best['nodes']} nodes, predicted tau {best['tau']:.2f}, predicted speed-up {best['speedup']:.2f}")
        config.tree = best["paths"]
        config.extra["calibration"] = {
            "nodes": best["nodes"], "predicted_tau": best["tau"], "predicted_speedup": best["speedup"],
            "dtype": args.dtype, "device": str(model.base_model.device), "threads": args.threads, "prepack": prepack,
            "latency_ms": {n: 1000 * t for n, t in latency.items()}, "heads_ms": 1000 * best["draft_s"],
            "overhead_ms": args.overhead_ms, "held_out_positions": len(ranks),
        }
    acceptance = lookup = cost = None
    if "acceptance" in parts:
        acceptance, details["acceptance"] = calibrate_acceptance(candidate_samples(model.heads, held_out, topk=args.accept_topk))
        print(_acceptance_table(details["acceptance"]))
    if "lookup" in parts:
        from transformers import AutoTokenizer

        from medusa_heads.default_model import resolve_model

        tok = AutoTokenizer.from_pretrained(resolve_model(args.model))
        answers = tokenized_answers(tok, conversations)
        lookup, details["lookup"] = lookup_acceptance(answers, max_tokens=args.lookup_tokens)
        dense, details["lookup"]["every_position"] = lookup_acceptance(answers, args.lookup_tokens, every_position=True)
        details["lookup"]["every_position"]["rates"] = [list(r) for r in dense.rates]
        print(_lookup_table(details["lookup"], lookup))
    if "cost" in parts:
        import os

        key = kernels_key(model.base_model, is_prepacked(model.base_model))
        contexts = tuple(int(c) for c in args.contexts.split(","))
        load = os.getloadavg()[0]  # other work on the machine slows every timing: kept beside them
        cost = (key, measure_cost(model.target, model.heads, contexts=contexts, repeats=args.repeats,
                                  topk=args.accept_topk, overhead_ms=args.overhead_ms))
        details["cost"] = {key: {"threads": args.threads, "repeats": args.repeats, "parents": 4, "topk": args.accept_topk,
                                 "load average": f"{load:.1f} -> {os.getloadavg()[0]:.1f}"}}
        print(_cost_table(*cost))
    if acceptance or lookup or cost:
        config.adaptive = merge_adaptive(config.adaptive, acceptance, lookup, cost)
        old = config.extra.get("adaptive_calibration", {})
        config.extra["adaptive_calibration"] = {**old, **{k: _brief(k, v) for k, v in details.items() if k != "cost"}}
        if "cost" in details:
            config.extra["adaptive_calibration"]["cost"] = {**old.get("cost", {}), **details["cost"]}
    save_config(args.heads, config)
    if args.report:
        from medusa_heads.calibration.report import write_report

        out = write_report(config, details, args.report)
        print(f"report written to {out}", file=sys.stderr)


def _brief(part: str, detail: dict) -> dict:
    """What the heads' config keeps of a part's measurement (the report keeps all of it)."""
    if part == "acceptance":
        return {"method": detail["method"], "summary": detail["summary"], "held_out_positions": detail["held_out_positions"],
                "temperatures": [r["T"] for r in detail["depths"]]}
    return {k: detail[k] for k in ("roots", "matched", "max_tokens", "max_ngram", "min_ngram", "walk")}


def _acceptance_table(detail: dict) -> str:
    lines = [f"acceptance given the parent accepted, second half of the held-out conversations (fitted on the first); "
             f"stored: {detail['method']}",
             f"{'depth':>6}{'cands':>9}{'observed':>10}{'raw':>8}{'isotonic':>10}{'temp.':>8}{'T':>6}"
             f"{'logloss raw':>13}{'iso':>8}{'temp.':>8}"]
    for r in detail["depths"]:
        lines.append(f"{r['depth']:>6}{r['test_positions'] * r['topk']:>9}{r['observed']:>10.3f}{r['raw']['mean']:>8.3f}"
                     f"{r['isotonic']['mean']:>10.3f}{r['temperature']['mean']:>8.3f}{r['T']:>6.2f}"
                     f"{r['raw']['log_loss']:>13.4f}{r['isotonic']['log_loss']:>8.4f}{r['temperature']['log_loss']:>8.4f}")
    s = detail["summary"]
    lines.append(f"{'all':>6}{'':>63}{s['raw']['log_loss']:>13.4f}{s['isotonic']['log_loss']:>8.4f}{s['temperature']['log_loss']:>8.4f}")
    return "\n".join(lines)


def _lookup_table(detail: dict, lookup) -> str:
    lines = [f"prompt lookup: {detail['roots']} roots ({detail['walk']}); acceptance of token j given j - 1 accepted, "
             "by matched n-gram",
             f"{'n':>3}{'matched':>9}" + "".join(f"{'j=' + str(j + 1):>7}" for j in range(detail["max_tokens"]))]
    for n, matched, row in zip(lookup.ngrams, detail["matched"], lookup.rates):
        lines.append(f"{n:>3}{matched:>9}" + "".join(f"{x:>7.3f}" for x in row))
    return "\n".join(lines)


def _cost_table(key: str, cost) -> str:
    lines = [f"verify ms ({key}); one drafting level {cost.draft_ms:.2f} ms, overhead {cost.overhead_ms:.1f} ms",
             f"{'size':>5}" + "".join(f"{'ctx ' + str(c):>11}" for c in cost.contexts)]
    for s, size in enumerate(cost.sizes):
        lines.append(f"{size:>5}" + "".join(f"{row[s]:>11.1f}" for row in cost.ms))
    return "\n".join(lines)


def cmd_bench(args: argparse.Namespace) -> None:
    import torch

    from medusa_heads.cli.bench import run_batch_bench, run_bench, write_batch_results, write_results
    from medusa_heads.training.data import read_prompts

    torch.set_num_threads(args.threads)
    model, tok = _load_medusa(args)
    rows = read_prompts(args.prompts)[: args.limit]
    if args.batch_sizes:
        result = run_batch_bench(model, tok, rows, [int(b) for b in args.batch_sizes.split(",")], args.max_new_tokens)
        write_batch_results(result, args.out)
        print((__import__("pathlib").Path(args.out) / "results.md").read_text())
        return
    methods = args.methods.split(",")
    if "hf" not in methods:
        methods = ["hf", *methods]
    sampling = dict(temperature=args.temperature, top_p=args.top_p) if args.do_sample else None
    if sampling is not None:
        torch.manual_seed(0)
    result = run_bench(model, tok, rows, methods, args.max_new_tokens, sampling, preset=args.preset,
                       long_tokens=args.long_tokens)
    cal = model.config.extra.get("calibration")
    if cal:
        result["predicted"] = {"tau": cal["predicted_tau"], "speedup": cal["predicted_speedup"]}
    write_results(result, args.out, methods)
    print((__import__("pathlib").Path(args.out) / "results.md").read_text())
    if cal:
        m = result["overall"]["medusa"]
        print(f"calibrated tree: predicted tau {cal['predicted_tau']:.2f} / speed-up {cal['predicted_speedup']:.2f}; "
              f"measured tau {m['mean_accepted']:.2f} / speed-up {m['speedup_vs_hf']:.2f}")


def cmd_export(args: argparse.Namespace) -> None:
    """Write heads in another layout: --format medusa, the reference layout (medusa_lm_head.safetensors +
    config.json); --format vllm, everything vLLM 0.32's Medusa reads (biases, draft vocabulary, shared LM head)."""
    from medusa_heads.checkpoint import export_reference, export_vllm, is_reference_dir, load_config, vllm_exportable
    from medusa_heads.model import MedusaModel

    try:
        if args.format == "vllm" and not is_reference_dir(args.heads_dir):
            vllm_exportable(load_config(args.heads_dir))  # refuse before loading the model
        model = MedusaModel.from_pretrained(args.model, heads=args.heads_dir, prepack=False)
        export = export_vllm if args.format == "vllm" else export_reference
        out = export(model.heads, model.target.lm_head.weight, args.out, base_name=args.model)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"medusa-heads export: {e}") from None
    print(f"exported to {out}", file=sys.stderr)
