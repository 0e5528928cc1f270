"""The commands that make heads: distill, features, train, and fit (all of them within a time budget)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from medusa_heads.cli.common import (
    _check_device, _check_file, _check_heads, _check_model, _data_file, _load_base, _read_prompts,
)


def cmd_distill(args: argparse.Namespace) -> None:
    import torch

    from medusa_heads.model import MedusaModel
    from medusa_heads.training.distill import distill, reusable_answers

    caps = _caps(args.cap)
    if Path(args.out).is_dir():
        raise SystemExit(f"--out {args.out}: is a directory; give the JSONL file to append conversations to")
    if args.reuse:
        _check_file(args.reuse, "--reuse")
    rows = _distill_rows(args, caps)
    if args.features and Path(args.features).is_file():
        raise SystemExit(f"--features {args.features}: is a file; give the folder to keep feature shards in")
    _check_heads(args.heads)
    _check_model(args.model)
    vllm_py = _check_answer_source(args)
    _check_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    base, tok = _load_base(args.model, prepack=args.prepack and args.device in (None, "cpu"))
    if args.device:
        base.to(args.device)
    if args.server:
        _distill_from_server(args, base, tok, rows)
        return
    if args.engine:
        _distill_from_vllm(args, base, tok, rows, vllm_py)
        return
    medusa = (MedusaModel.from_pretrained(base, heads=args.heads, allow_base_mismatch=args.allow_base_mismatch)
              if args.heads else None)
    counts = distill(base, tok, rows, args.out, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                     temperature=args.temperature, top_p=args.top_p, medusa=medusa, seed=args.seed,
                     features=args.features, reuse=reusable_answers(args.reuse) if args.reuse else None)
    print(f"distill: {counts}", file=sys.stderr)


def _caps(given: list[str]) -> dict[str, int]:
    """--cap SOURCE=N, each given: {SOURCE: N}."""
    caps = {}
    for c in given:
        source, _, n = c.partition("=")
        if not n.isdigit():
            raise SystemExit(f"--cap expects SOURCE=N, got {c!r}")
        caps[source] = int(n)
    return caps


def _distill_rows(args: argparse.Namespace, caps: dict[str, int]) -> list:
    """The prompt rows distill answers: --prompts less --cap, up to --limit, as --variant rows where one is named."""
    from medusa_heads.corpus import as_variant, subsample

    rows = subsample(_read_prompts(args.prompts), caps, seed=args.seed)[: args.limit]
    if not rows:
        raise SystemExit(f"--cap {' --cap '.join(args.cap)} leaves none of the prompts in {args.prompts}")
    if args.variant:
        single = sum(len(r.turns) == 1 for r in rows)
        if args.temperature <= 0 and single:
            # a greedy variant is new only where a row asks more than its prompt: follow-up turns
            raise SystemExit(f"--variant asks for a further answer to each prompt, but {single} of the {len(rows)} "
                             "rows have a single turn, whose greedy answer would repeat the first: give it a "
                             "--temperature > 0, or rows with follow-up turns")
        rows = as_variant(rows, args.variant)
    return rows


def _check_answer_source(args: argparse.Namespace) -> str | None:
    """Refuse --server / --engine with what they cannot take; the python that runs vLLM for --engine, else None."""
    remote = "--server" if args.server else "--engine" if args.engine else None
    if remote and (args.heads or args.reuse):
        raise SystemExit(f"{remote} answers every turn on the server: "
                         f"leave out {'--heads' if args.heads else '--reuse'}")
    if args.server and args.engine:
        raise SystemExit("--server and --engine both name where the answers come from: give one")
    if not args.engine:
        return None
    from medusa_heads.training.remote import ServerError, vllm_python

    try:
        return vllm_python(args.vllm_python)
    except ServerError as e:
        raise SystemExit(str(e)) from None


def _distill_from_vllm(args: argparse.Namespace, base, tok, rows, vllm_py: str) -> None:
    """--engine vllm: start vLLM on the target for this run, and distill from it as from a --server."""
    import shlex

    from medusa_heads.default_model import resolve_model
    from medusa_heads.training.remote import ServerError, VllmEngine

    log = Path(args.out).with_suffix(".vllm.log")
    print(f"distill: starting vLLM ({vllm_py}) on {args.model}; its log: {log}", file=sys.stderr)
    try:
        with VllmEngine(str(resolve_model(args.model)), vllm_py, log, shlex.split(args.vllm_args or "")) as server:
            args.server, args.server_model = server.url, server.model
            _distill_from_server(args, base, tok, rows)
    except ServerError as e:
        raise SystemExit(f"--engine vllm: {e}") from None


def _distill_from_server(args: argparse.Namespace, base, tok, rows) -> None:
    from medusa_heads.corpus import read_conversations
    from medusa_heads.training.features import features_from_conversations
    from medusa_heads.training.remote import Server, ServerError, check_server, distill_from_server

    server = Server(args.server, args.server_model)
    try:
        check_server(server, base, tok, rows, log=lambda m: print(m, file=sys.stderr))
        counts = distill_from_server(server, tok, rows, args.out, max_new_tokens=args.max_new_tokens,
                                     temperature=args.temperature, top_p=args.top_p, concurrency=args.concurrency,
                                     seed=args.seed)
    except ServerError as e:
        raise SystemExit(f"--server: {e}") from None
    print(f"distill: {counts}", file=sys.stderr)
    if counts["failed"] and not counts["written"]:
        raise SystemExit(f"--server: every request failed ({counts['failed']}; the first: {counts['first_error']})")
    if counts["failed"]:
        print(f"distill: {counts['failed']} requests failed (the first: {counts['first_error']}); rerun the same "
              "command to retry them", file=sys.stderr)
    if args.features:
        n = features_from_conversations(base, tok, read_conversations(args.out), args.features)
        print(f"features: added {n} conversations to {args.features}", file=sys.stderr)


def cmd_features(args: argparse.Namespace) -> None:
    import torch

    from medusa_heads.corpus import read_conversations
    from medusa_heads.training.features import features_from_conversations, process_shard

    data = _data_file(args.data, "--data")
    if Path(args.features).exists() and not Path(args.features).is_dir():
        raise SystemExit(f"--features {args.features}: is a file; give the folder of feature shards")
    _check_model(args.model)
    _check_device(args.device)
    conversations = read_conversations(data)
    torch.set_num_threads(args.threads)
    rank, world = process_shard()
    device = args.device
    if device == "cuda" and world > 1:  # one GPU a process, as accelerate launches them
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
    base, tok = _load_base(args.model, dtype=args.dtype, prepack=args.prepack and device in (None, "cpu"))
    if device:
        base.to(device)
    n = features_from_conversations(base, tok, conversations, args.features, batch_tokens=args.batch_tokens,
                                    shard=(rank, world))
    who = f" (process {rank} of {world})" if world > 1 else ""
    print(f"features{who}: added {n} conversations to {args.features}", file=sys.stderr)


def cmd_train(args: argparse.Namespace) -> None:
    import torch

    from medusa_heads.training.recipe import TrainRecipe
    from medusa_heads.training.trainer import train

    if args.config is not None:
        _check_file(args.config, "--config")
    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = list(args.set)
    for key in ("data", "out", "features", "max_steps"):
        if getattr(args, key) is not None:
            overrides.append(f"{key}={getattr(args, key)}")
    recipe = TrainRecipe.load(args.config, overrides)
    # before any work: the data files (NAME.gz where only it exists) and the model's name
    flag = "--data" if args.data is not None else "the recipe's data"
    data = ",".join(_data_file(p.strip(), flag) for p in recipe.data.split(",") if p.strip())
    if data != recipe.data:
        recipe = TrainRecipe.load(args.config, [*overrides, f"data={data}"])
    _check_model(recipe.model, "the recipe's model")
    out = train(recipe, resume=args.resume)
    print(f"heads written to {out}", file=sys.stderr)


def cmd_fit(args: argparse.Namespace) -> None:
    from medusa_heads.training.fit import answer_source, fit, parse_budget, process_start

    budget = parse_budget(args.budget)
    remote = dict(server=args.server, server_model=args.server_model, concurrency=args.concurrency,
                  engine=args.engine, vllm_python=args.vllm_python, vllm_args=args.vllm_args)
    answer_source(**remote)  # options that do not go together: one line before anything else
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise SystemExit(f"--out {args.out}: is a file; give a folder for the heads")
    prompts = [_data_file(f, "--prompts") for f in args.prompts] if args.prompts else None
    for f in prompts or []:
        _read_prompts(f)
    _check_file(args.bench_prompts, "--bench-prompts")
    _check_model(args.model)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    fit(args.model, budget, args.out, seed=args.seed, force_cost=args.force_cost, prompts=prompts,
        bench_prompts=args.bench_prompts, max_answers=args.max_answers or 0, max_steps=args.max_steps or 0,
        stop_after=args.stop_after, started=process_start(), log=lambda m: print(m, file=sys.stderr), **remote)
