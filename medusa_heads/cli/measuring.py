"""The commands on trained heads: calibrate and bench measure them on this machine, export writes them for serving."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from medusa_heads.cli.common import (
    _check_device, _check_gguf, _check_heads, _check_model, _check_sampling, _data_file, _dtype_kwargs, _load_medusa,
    _note, _read_prompts,
)


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    """"2,4,8" -> (2, 4, 8): increasing integers of 2 or more, or a clear exit naming the flag."""
    try:
        values = tuple(int(v) for v in text.split(",") if v)
    except ValueError:
        values = ()
    if not values or list(values) != sorted(set(values)) or values[0] < 2:
        raise SystemExit(f"{flag} takes increasing batch sizes of 2 or more, e.g. 2,4,8; got {text!r}")
    return values


def cmd_calibrate(args: argparse.Namespace) -> None:
    """Measure on held-out data and this machine, and write into the heads' config (medusa_heads.calibration)."""
    import torch

    from medusa_heads.calibration import PARTS, TIMED_PARTS, Settings, calibrate, cpu_count, held_out_conversations
    from medusa_heads.loading import load_tokenizer
    from medusa_heads.model import MedusaModel
    from medusa_heads.corpus import read_conversations

    parts = [p for p in args.parts.split(",") if p]
    if not parts or set(parts) - set(PARTS):
        raise SystemExit(f"--parts takes a comma-separated list of {', '.join(PARTS)}, got {args.parts!r}")
    _check_heads(args.heads)
    needs_data = bool(set(parts) - {"cost", "batch", "ngrams"})  # timings need no conversations (but a greedy verify's:
    # it runs on the target's own text); the phrasebook reads its own
    data = args.data
    if needs_data or ("ngrams" in parts and not args.ngram_data):
        data = _data_file(args.data, "--data")
    if {"tree", "acceptance"} & set(parts) and not Path(args.features).is_dir():
        raise SystemExit(f"--features {args.features}: no such folder; the tree and acceptance parts read the held-out "
                         f"conversations' features: compute them with `medusa-heads features --data {data} --features "
                         f"{args.features}`")
    _check_model(args.model)
    _check_device(args.device)
    torch.set_num_threads(args.threads)
    timed = [p for p in parts if p in TIMED_PARTS]
    load, cores = os.getloadavg()[0], cpu_count()
    if timed and not args.force_cost and load > cores + 0.5:
        _note(f"the load average is {load:.1f} on {cores} cores: other work is running, and timings "
              f"({', '.join(timed)}) taken now will not be stored unless the load falls (--force-cost stores them "
              "anyway)")
    conversations = held_out_conversations(read_conversations(data), args.heads) if needs_data else []
    phrase_data = None
    if "ngrams" in parts:  # the heads' held-out prompts are the phrasebook's too
        files = [_data_file(f, "--ngram-data") for f in args.ngram_data] if args.ngram_data else [data]
        every = [c for f in files for c in read_conversations(f)]
        held = held_out_conversations(every, args.heads)
        ids = {c["id"] for c in held}
        phrase_data = ([c for c in every if c["id"] not in ids], held)
    prepack = args.prepack and args.device in (None, "cpu")
    model = MedusaModel.from_pretrained(args.model, heads=args.heads, device_map=args.device, gguf=_check_gguf(args),
                                        prepack=None if prepack else False,
                                        allow_base_mismatch=args.allow_base_mismatch,
                                        **_dtype_kwargs(args.dtype, args.device))
    settings = Settings(max_nodes=args.max_nodes, topk=args.topk, context=args.context, repeats=args.repeats,
                        overhead_ms=args.overhead_ms, accept_topk=args.accept_topk, lookup_tokens=args.lookup_tokens,
                        contexts=tuple(int(c) for c in args.contexts.split(",")),
                        batch_rows=_int_list(args.batch_rows, "--batch-rows"))
    calibrate(model, load_tokenizer(args.model), args.heads, parts, conversations,
              args.features, settings, args.report, phrase_data=phrase_data, force_cost=args.force_cost)


def cmd_bench(args: argparse.Namespace) -> None:
    import torch

    from medusa_heads.bench import check_methods, run_batch_bench, run_bench, write_batch_results, write_results

    _check_sampling(args)
    rows = _read_prompts(args.prompts)[: args.limit]
    out = Path(args.out or time.strftime("runs/bench-%Y%m%d-%H%M%S"))
    if out.exists() and not out.is_dir():
        raise SystemExit(f"--out {out}: is a file; give a folder for the results")
    if args.batch_sizes:
        if args.do_sample:
            raise SystemExit("--batch-sizes measures greedy throughput: leave out --do-sample")
        try:
            sizes = [int(b) for b in args.batch_sizes.split(",")]
        except ValueError:
            raise SystemExit(f"--batch-sizes takes comma-separated positive integers, e.g. 1,4,8; "
                             f"got {args.batch_sizes!r}") from None
        if min(sizes) < 1:
            raise SystemExit(f"--batch-sizes takes positive integers, got {args.batch_sizes!r}")
        if len(rows) < max(sizes):
            raise SystemExit(f"--batch-sizes {args.batch_sizes} needs at least {max(sizes)} prompts, {args.prompts} "
                             f"gives {len(rows)}")
    else:
        try:
            methods = check_methods(args.methods.split(","))
        except ValueError as e:
            raise SystemExit(f"--methods: {e}") from None
        _prepare_llamacpp(methods, args)
    torch.set_num_threads(args.threads)
    model, tok = _load_medusa(args)
    cal = model.config.extra.get("calibration")
    if args.batch_sizes:
        result = run_batch_bench(model, tok, rows, sizes, args.max_new_tokens)
        result["settings"]["model"] = args.model
        write_batch_results(result, out)
    else:
        sampling = dict(temperature=args.temperature, top_p=args.top_p) if args.do_sample else None
        if sampling is not None:
            torch.manual_seed(args.seed)
        result = run_bench(model, tok, rows, methods, args.max_new_tokens, sampling, preset=args.preset,
                           long_tokens=args.long_tokens, gguf_files=_gguf_files(args))
        result["settings"]["model"] = args.model
        if sampling is not None:
            result["settings"]["seed"] = args.seed
        if cal:
            result["predicted"] = {"tau": cal["predicted_tau"], "speedup": cal["predicted_speedup"]}
        write_results(result, out, methods)
    print((out / "results.md").read_text())
    if cal and not args.batch_sizes and "medusa" in methods:
        m = result["overall"]["medusa"]
        print(f"calibrated tree: predicted tau {cal['predicted_tau']:.2f} / speed-up {cal['predicted_speedup']:.2f}; "
              f"measured tau {m['mean_accepted']:.2f} / speed-up {m['speedup_vs_hf']:.2f}")
    print(f"results written to {out}", file=sys.stderr)


def _gguf_files(args: argparse.Namespace) -> dict[str, Path]:
    """The user's own GGUF files (--model FILE.gguf, --gguf FILE) by weight type: the llama.cpp methods of that type
    run on them, not on a file converted from --model (which a GGUF-only model cannot give)."""
    from medusa_heads import llamacpp

    files = [Path(f) for f in (args.model, getattr(args, "gguf", None)) if f and str(f).endswith(".gguf")]
    return {llamacpp.file_weights(f): f for f in files if f.is_file()}


def _prepare_llamacpp(methods: list[str], args: argparse.Namespace) -> None:
    """llama.cpp built for this CPU (once) before the model loads, so a failed build costs no load."""
    from medusa_heads import llamacpp

    wanted = [m for m in methods if m in llamacpp.METHODS]
    if not wanted:
        return
    if args.do_sample:
        raise SystemExit("--methods: the llama.cpp methods decode greedily; "
                         "leave out --do-sample or the llamacpp methods")
    try:
        llamacpp.python_binding()
        if any(llamacpp.plain_reference(m) for m in wanted):
            llamacpp.server_binary()
    except llamacpp.LlamaCppError as e:
        raise SystemExit(f"llamacpp: {e}") from None


def cmd_export(args: argparse.Namespace) -> None:
    """Write heads in another layout: --format vllm, for the project's vLLM plugin (any heads); vllm-stock, what
    vLLM 0.32's own Medusa reads (Medusa-1 heads only, no plugin); medusa, the reference layout
    (medusa_lm_head.safetensors + config.json)."""
    import torch

    from medusa_heads.checkpoint import (CONFIG_NAME, REFERENCE_WEIGHTS, VLLM_WEIGHTS, export_reference, export_vllm,
                                         export_vllm_plugin, is_reference_dir, load_config, vllm_exportable)
    from medusa_heads.model import MedusaModel

    _check_heads(args.heads_dir, flag="heads directory")
    layouts = _check_export_target(args.heads_dir, args.out, args.force)
    _check_model(args.model)
    if args.format == "vllm-stock" and not is_reference_dir(args.heads_dir):
        vllm_exportable(load_config(args.heads_dir))  # refuse before loading the model
    model = MedusaModel.from_pretrained(args.model, heads=args.heads_dir, prepack=False, draft_dtype=torch.float32,
                                        allow_base_mismatch=args.allow_base_mismatch)  # the weights as stored, fp32
    if args.format == "vllm":
        out = export_vllm_plugin(model.heads, model.base_model, args.out, base_name=args.model, root=args.root,
                                 draft_dtype={"fp32": "float32", "bf16": "bfloat16", "engine": None}[args.draft_dtype])
    else:
        export = export_vllm if args.format == "vllm-stock" else export_reference
        out = export(model.heads, model.target.lm_head.weight, args.out, base_name=args.model)
    written = {REFERENCE_WEIGHTS if args.format == "medusa" else VLLM_WEIGHTS, CONFIG_NAME}
    for name in sorted(set(layouts) - written):  # --force: the folder ends with one layout, the one just written
        (out / name).unlink(missing_ok=True)
    print(f"exported to {out}" + (f" (replaced {', '.join(sorted(layouts))})" if layouts else ""), file=sys.stderr)


def _check_export_target(heads_dir: str, out: str, force: bool) -> list[str]:
    """Refuse an export folder that is a file, the heads directory itself, or that holds files already (unless
    --force). Returns the heads files of any layout there (--force replaces them all: one layout is left)."""
    from medusa_heads.checkpoint import CONFIG_NAME, NGRAMS_NAME, REFERENCE_WEIGHTS, VLLM_WEIGHTS, WEIGHTS_NAME

    target = Path(out)
    if target.exists() and not target.is_dir():
        raise SystemExit(f"{out}: is a file; give a folder to export the heads to")
    if not target.is_dir() or not any(target.iterdir()):
        return []
    if target.resolve() == Path(heads_dir).resolve():
        raise SystemExit(f"{out}: is the heads directory being exported; give another folder")
    names = sorted(p.name for p in target.iterdir())
    if not force:
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise SystemExit(f"{out}: exists and holds files ({shown}); give a new or empty folder, or pass --force to "
                         "replace the heads there (only one layout is left)")
    return [n for n in names if n in (CONFIG_NAME, WEIGHTS_NAME, NGRAMS_NAME, REFERENCE_WEIGHTS, VLLM_WEIGHTS)]
