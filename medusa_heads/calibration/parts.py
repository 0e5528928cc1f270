"""One calibration run (`calibrate`): each part asked for measured in turn into the heads' config, timings judged
(timing_problem) before they are stored, the report written. The package's __init__ names calibrate without
importing this module (or torch) until it is called."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Callable

import torch

from medusa_heads import calibration  # its timing_problem read at each call (tests replace it)
from medusa_heads.calibration import PARTS, Settings, UntrustedTimings, measure, report
from medusa_heads.calibration.machine import machine_record
from medusa_heads.checkpoint import load_config, save_config, save_ngrams
from medusa_heads.corpus import is_eval
from medusa_heads.kernels.prepack import is_prepacked
from medusa_heads.shards import load_segments
from medusa_heads.tree.adaptive import CostModel
from medusa_heads.tree.calibrate import rank_paths
from medusa_heads.tree.ngrams import NgramStore, max_order

CHAINED = {"cost", "batch", "greedy", "loop"}  # one cost model: refused together


def calibrate(model, tokenizer, heads_dir: str | os.PathLike, parts: list[str], conversations: list[dict],
              features: str | os.PathLike, settings: Settings = Settings(), report_dir: str | os.PathLike | None = None,
              log=print, phrase_data: tuple[list[dict], list[dict]] | None = None, force_cost: bool = False) -> None:
    """Measure `parts` (PARTS) for `model` (a MedusaModel with the heads of heads_dir) on the held-out
    `conversations` and this machine, and write into heads_dir's config: the fixed tree that maximises predicted
    tokens/s ("tree"), and what the per-step tree runs on (config.adaptive): calibrated acceptance ("acceptance"),
    prompt lookup's acceptance ("lookup"), verify and drafting time for these kernels ("cost"), the verify of a
    batch of rows for them ("batch": added to the kernels' cost model, which "cost" measures now or did before), a
    greedy verify's cost where it skips the LM head ("greedy", likewise added; medusa_heads/kernels/screen.py); and the
    target's phrasebook ("ngrams", tree/ngrams.py) from phrase_data = (conversations it learns, held-out ones): a store
    of the first, written beside the heads (ngrams.safetensors), its acceptance measured on the second.

    Timings ("tree", "cost", "batch", "greedy") taken while other work loaded the machine (the load average above
    its cores) or that are implausible (a verify of 2-4 tokens costing over 3x a plain step) are not stored, since
    every later call sizes its trees from them: the other parts are, and UntrustedTimings (a ValueError) says why
    at the end. force_cost=True stores them anyway (the reason stays in the config, beside them)."""
    _check_parts(model, parts)
    run = _Run(model, settings, log, force_cost)
    if {"tree", "acceptance"} & set(parts):
        run.held_out = _held_out_features(conversations, features, log)
    if "tree" in parts:
        _tree(run)
    # the held-out answers as token ids: the lookup's acceptance and the greedy verify's timing both read them
    run.answers = measure.tokenized_answers(tokenizer, conversations) if {"lookup", "greedy"} & set(parts) else []
    for part, measure_part in (("acceptance", _acceptance), ("lookup", _lookup), ("cost", _cost), ("batch", _batch),
                               ("greedy", _greedy)):
        if part in parts:
            measure_part(run)
    if "ngrams" in parts:
        _ngrams(run, tokenizer, heads_dir, phrase_data)
    if "loop" in parts:  # last: it runs the per-step tree on what the other parts measured
        _loop(run, tokenizer, conversations)
    refused = {part: why for part, why in run.problems.items() if why} if not force_cost else {}
    if refused and run.cost is not None and refused.keys() & CHAINED:
        run.cost = None  # measured in this run on a loaded machine: the stored cost models stay as they were
    _store(run, "cost" in parts)
    save_config(heads_dir, model.config)
    if report_dir:
        out = report.write_report(model.config, run.details, report_dir)
        log(f"report written to {out}")
    if refused:
        raise _untrusted(parts, refused)


@dataclass
class _Run:
    """What the parts of one calibrate call share: the model, its settings, and what they measured."""

    model: Any
    settings: Settings
    log: Callable[[str], Any]
    force: bool
    held_out: list = field(default_factory=list)  # the held-out conversations' features (tree, acceptance)
    answers: list = field(default_factory=list)  # their answers as token ids (lookup, greedy)
    details: dict = field(default_factory=dict)  # part -> its report
    problems: dict[str, str | None] = field(default_factory=dict)  # timed part -> why its timings cannot be trusted
    acceptance: Any = None
    lookup: Any = None
    cost: tuple[str, CostModel] | None = None  # (kernels key, its cost model)
    phrases: Any = None


def _check_parts(model, parts: list[str]) -> None:
    unknown = set(parts) - set(PARTS)
    if not parts or unknown:
        raise ValueError(f"calibrate takes parts among {', '.join(PARTS)}, got {', '.join(parts) or 'none'}")
    if model.engine is not model.target and {"tree", "batch"} & set(parts):
        raise ValueError(f"--parts {','.join(sorted({'tree', 'batch'} & set(parts)))} times transformers' verify: on "
                         "llama.cpp (--gguf) calibrate cost, and the engine-free parts (acceptance, lookup, ngrams)")


def _held_out_features(conversations: list[dict], features: str | os.PathLike, log) -> list:
    ids = {c["id"] for c in conversations}
    held_out = load_segments(features, keep_ids=ids)
    if not held_out:
        raise ValueError(f"no features for the {len(ids)} held-out conversations in {features} (compute them with: "
                         f"medusa-heads features --data ... --features {features})")
    have = {seg.conv_id for seg in held_out}
    if len(have) < len(ids):  # said, not silently dropped
        log(f"calibrate: {len(have)} of the {len(ids)} held-out conversations have features in {features}; the "
            f"other {len(ids) - len(have)} are left out (medusa-heads features --data ... --features {features})")
    return held_out


def _tree(run: _Run) -> None:
    """The fixed tree that maximises predicted tokens/s, from rank accuracies and verify latency."""
    model, s = run.model, run.settings
    ranks = measure.correct_ranks(model.heads, run.held_out, topk=s.topk)
    load = os.getloadavg()[0]
    latency = measure.verify_latency(model.target, list(range(1, s.max_nodes + 2)), context=s.context,
                                     repeats=s.repeats)
    problem = run.problems["tree"] = calibration.timing_problem(
        load, os.getloadavg()[0], torch.get_num_threads(), [(s.context, {n: 1000 * t for n, t in latency.items()})])
    result = measure.choose_tree(rank_paths(ranks), latency, lambda spec: measure.draft_latency(model.heads, spec),
                                 s.overhead_ms / 1000, s.max_nodes)
    best = result["best"]
    run.log(report.tree_table(result, latency, len(ranks)))
    if problem and not run.force:
        run.log(f"calibrate: the tree is not stored: {problem}")
        return
    model.config.tree = best["paths"]
    model.config.extra["calibration"] = {
        "nodes": best["nodes"], "predicted_tau": best["tau"], "predicted_speedup": best["speedup"],
        "dtype": str(model.base_model.dtype).removeprefix("torch."), "device": str(model.base_model.device),
        "threads": torch.get_num_threads(), "prepack": is_prepacked(model.base_model),
        "latency_ms": {n: 1000 * t for n, t in latency.items()}, "heads_ms": 1000 * best["draft_s"],
        "overhead_ms": s.overhead_ms, "held_out_positions": len(ranks),
        **({"untrusted timings": problem} if problem else {}),
    }


def _acceptance(run: _Run) -> None:
    samples = measure.candidate_samples(run.model.heads, run.held_out, topk=run.settings.accept_topk)
    run.acceptance, run.details["acceptance"] = measure.calibrate_acceptance(samples)
    run.log(report.acceptance_table(run.details["acceptance"]))


def _lookup(run: _Run) -> None:
    tokens = run.settings.lookup_tokens
    run.lookup, details = measure.lookup_acceptance(run.answers, lookup_tokens=tokens)
    run.details["lookup"] = details
    dense, details["every_position"] = measure.lookup_acceptance(run.answers, tokens, every_position=True)
    details["every_position"]["rates"] = [list(r) for r in dense.rates]
    run.log(report.lookup_table(details, run.lookup))


def _cost(run: _Run) -> None:
    """Verify and drafting time for these kernels: transformers' target, or the engine it runs on (llama.cpp)."""
    model, s = run.model, run.settings
    key = model.engine.kernels()
    kw = dict(contexts=s.contexts, repeats=s.repeats, topk=s.accept_topk, overhead_ms=s.overhead_ms)
    if model.engine is model.target:
        timed = partial(measure.measure_cost, model.target, model.heads, **kw)
    else:
        timed = partial(measure.measure_engine_cost, model.engine, model.heads, model.config.vocab_size, **kw)
    info = {"threads": torch.get_num_threads(), "repeats": s.repeats, "parents": 4, "topk": s.accept_topk}
    cost, info = _judged(run, "cost", timed, info, _rows)
    run.details["cost"] = {key: info}
    run.cost = (key, cost)
    run.log(report.cost_table(*run.cost))


def _batch(run: _Run) -> None:
    """A batch's verify, added to the kernels' one-row cost model."""
    s = run.settings
    key, one_row = _one_row_cost(run.cost, run.model, "a batch's cost", "batch")
    timed = partial(measure.measure_batch_cost, run.model.target, one_row, s.batch_rows, repeats=s.batch_repeats)
    cost, info = _judged(run, "batch", timed, {"rows": list(s.batch_rows), "repeats": s.batch_repeats})
    run.details.setdefault("cost", {}).setdefault(key, {})["batches"] = info
    run.cost = (key, cost)
    run.log(report.batch_cost_table(*run.cost))


def _greedy(run: _Run) -> None:
    """A greedy verify's cost where it skips the LM head, added to the kernels' one-row cost model."""
    s = run.settings
    key, one_row = _one_row_cost(run.cost, run.model, "a greedy verify's cost", "greedy")
    if not run.model.engine.greedy_choices:  # greedy verifies run the LM head here: ms holds their cost already
        run.log(f"calibrate: greedy verifies run the whole LM head on these kernels ({key}): no greedy cost to measure")
        return
    timed = partial(measure.measure_greedy_cost, run.model.target, one_row, run.answers, repeats=s.repeats)
    info = {"repeats": s.repeats, "load average": None,
            "how": "the table above less the median milliseconds a greedy verify saves, full and greedy "
                   "verifies timed alternately on held-out answers"}
    cost, info = _judged(run, "greedy", timed, info, lambda c: _rows(c.for_greedy()))
    run.details.setdefault("cost", {}).setdefault(key, {})["greedy"] = info
    run.cost = (key, cost)
    run.log(report.cost_table(f"{key}, greedy", cost.for_greedy()))


def _loop(run: _Run, tokenizer, conversations: list[dict]) -> None:
    """The decode loop's own work a step, what a tree adds to it and a drafting level in it (measure.measure_loop),
    into the kernels' one-row cost model: greedy calls with the per-step tree on the first held-out prompts."""
    from medusa_heads.prompting import prompt_ids

    model = run.model
    key, one_row = _one_row_cost(run.cost, model, "the loop's cost", "loop")
    drafting = model.drafting()
    found = {"acceptance": run.acceptance, "lookup": run.lookup, "phrase_acceptance": run.phrases,
             "phrases": model.phrases if run.phrases is not None else None}  # measured in this run, not yet stored
    drafting = replace(drafting, cost=one_row, **{k: v for k, v in found.items() if v is not None})
    if drafting.acceptance is None:
        raise ValueError("the loop's cost is measured on the per-step tree, which needs the heads' acceptance: "
                         "calibrate --parts acceptance,loop")
    firsts = [turns[:1] for c in conversations if (turns := [m for m in c["messages"] if m["role"] == "user"])]
    prompts = [prompt_ids(tokenizer, m) for m in firsts[: measure.LOOP_PROMPTS]]  # only those it runs, tokenized
    if not prompts:
        raise ValueError("the loop's cost needs held-out conversations with a user turn (--data)")
    fitted = {}

    def timed():
        values, fitted["seen"] = measure.measure_loop(model, drafting, prompts)
        batches = tuple((b, replace(c, **values)) for b, c in one_row.batches)  # a batch's model carries the row's
        return replace(one_row, **values, batches=batches)

    info = {"prompts": len(prompts), "new tokens": measure.LOOP_TOKENS}
    cost, info = _judged(run, "loop", timed, info)
    info.update(fitted["seen"], fitted={k: getattr(cost, k) for k in ("loop_ms", "overhead_ms", "draft_ms")})
    run.details.setdefault("cost", {}).setdefault(key, {})["loop"] = info
    run.cost = (key, cost)
    run.log(f"calibrate: the loop ({key}): {cost.loop_ms:.2f} ms a step besides the verify, {cost.overhead_ms:.2f} "
            f"ms more for a tree, {cost.draft_ms:.2f} ms a drafting level ({info['steps']} steps of "
            f"{len(prompts)} greedy calls)")


def _judged(run: _Run, part: str, timed, info: dict, tables=lambda cost: ()) -> tuple[CostModel, dict]:
    """timed()'s cost model, measured between two readings of the load average, and `info` with the load ("load
    average", where info places it, else last) and why the timings cannot be trusted, if so (run.problems[part])."""
    load = os.getloadavg()[0]  # other work on the machine slows every timing: kept beside them
    cost = timed()
    after = os.getloadavg()[0]
    info = {**info, "load average": f"{load:.1f} -> {after:.1f}"}
    problem = run.problems[part] = calibration.timing_problem(load, after, torch.get_num_threads(), tables(cost))
    if problem:
        info["untrusted timings"] = problem
    return cost, info


def _ngrams(run: _Run, tokenizer, heads_dir, phrase_data: tuple[list[dict], list[dict]] | None) -> None:
    """The target's phrasebook: a store learned from phrase_data[0], its acceptance measured on phrase_data[1]."""
    if not phrase_data or not phrase_data[0] or not phrase_data[1]:
        raise ValueError("the phrasebook needs distilled conversations to learn and held-out ones to measure on")
    learn, held = phrase_data  # held: the heads' held-out prompts, which a bench draws on: never learned
    vocab = run.model.config.vocab_size
    # n-grams up to 4 tokens, fewer where their keys would not fit an int64 (3 for a 262K vocabulary)
    store = NgramStore.build(measure.tokenized_answers(tokenizer, learn), vocab, max_n=min(4, max_order(vocab)))
    fit = [c for c in held if not measure.second_half(c["id"])]  # fitted on one half, tested on the other
    test = [c for c in held if measure.second_half(c["id"])]
    if not fit or not test:
        fit, test = held, []
    run.phrases, run.details["ngrams"] = measure.ngram_acceptance(store, measure.tokenized_answers(tokenizer, fit),
                                                                  measure.tokenized_answers(tokenizer, test))
    save_ngrams(heads_dir, store)
    run.model.phrases = store
    run.log(report.ngram_table(run.details["ngrams"]))


def _store(run: _Run, timed_cost: bool) -> None:
    """What the per-step tree runs on into config.adaptive, the parts' reports beside it (config.extra)."""
    if not (run.acceptance or run.lookup or run.cost or run.phrases):
        return
    config = run.model.config
    timed_here = machine_record(run.model.engine.device) if timed_cost else None
    config.adaptive = measure.merge_adaptive(config.adaptive, run.acceptance, run.lookup, run.cost, run.phrases,
                                             timed_here)
    old = config.extra.get("adaptive_calibration", {})
    config.extra["adaptive_calibration"] = {
        **old, **{k: report.brief(k, v) for k, v in run.details.items() if k != "cost"}}
    if "cost" in run.details and run.cost is not None:
        config.extra["adaptive_calibration"]["cost"] = {
            k: {**old.get("cost", {}).get(k, {}), **v}
            for k, v in {**old.get("cost", {}), **run.details["cost"]}.items()}


def _untrusted(parts: list[str], refused: dict[str, str]) -> UntrustedTimings:
    dropped = [p for p in parts if p in refused or (p in CHAINED and refused.keys() & CHAINED)]
    kept = [p for p in parts if p not in dropped]
    return UntrustedTimings(
        f"timings not stored ({', '.join(dropped)}): {next(iter(refused.values()))}; "
        + (f"{', '.join(kept)} stored; " if kept else "")
        + "rerun on an idle machine, or pass --force-cost to store them anyway")


def _rows(cost) -> list[tuple[int, dict[int, float]]]:
    """A cost model's tables as (context, {size: ms})."""
    return [(c, dict(zip(cost.sizes, row))) for c, row in zip(cost.contexts, cost.ms)]


def _one_row_cost(cost, model, what: str, part: str):
    """(kernels key, one-row cost model) that the `part` measurement adds to: measured in this run, else stored."""
    key = cost[0] if cost else model.engine.kernels()
    one_row = cost[1] if cost else (model.config.adaptive or {}).get("cost", {}).get(key)
    if one_row is None:
        raise ValueError(f"{what} adds to the one-row cost model of these kernels ({key}), which the heads lack: "
                         f"calibrate --parts cost,{part}")
    return key, one_row if isinstance(one_row, CostModel) else CostModel.from_dict(one_row)


def held_out_conversations(conversations: list[dict], heads_dir: str | os.PathLike) -> list[dict]:
    """The conversations the heads in heads_dir did not train on (their recipe's eval fraction)."""
    fraction = load_config(heads_dir).extra.get("recipe", {}).get("eval_fraction", 0.05)
    held = [c for c in conversations if is_eval(c["id"], fraction)]
    if not held:
        raise ValueError(f"no held-out conversations (eval fraction {fraction}) among the {len(conversations)} given")
    return held
