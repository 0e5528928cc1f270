"""Calibration: what the heads' config learns from held-out data and this machine, in one place. `calibrate` runs
the parts asked for; `measure` holds the measurements, `report` what they print and write. The pure choice of a
tree from measured rank accuracies is tree/calibrate.py (no model)."""
from __future__ import annotations

import os
from dataclasses import dataclass

# measure.PARTS and measure.BATCH_ROWS, kept here too so that the command line's --help imports no torch
# (tests/test_errors.py checks that the two agree)
PARTS = ("tree", "acceptance", "lookup", "cost", "batch", "greedy", "ngrams")
BATCH_ROWS = (2, 4, 8)
TIMED_PARTS = ("tree", "cost", "batch", "greedy")  # what stores timings of this machine
MAX_SMALL_TREE_RATIO = 3.0  # a verify of 2-4 tokens costs ~1-1.5x a plain step on CPUs and GPUs; 3x: a disturbed run


class UntrustedTimings(ValueError):
    """Timings measured while other work ran (or implausible ones) were not stored; the rest of the run was."""


@dataclass
class Settings:
    max_nodes: int = 64  # largest fixed tree considered
    topk: int = 10  # candidates per head when measuring rank accuracies (the fixed tree)
    context: int = 300  # cached tokens when timing the verify pass (the fixed tree)
    repeats: int = 15  # timed forwards per size (the median is used; the cost model reads every size as measured)
    overhead_ms: float = 3.0  # per-step Python work besides heads and verify
    accept_topk: int = 8  # candidates per head in the acceptance calibration, per parent when timing a level
    lookup_tokens: int = 10  # prompt-lookup continuation length measured
    contexts: tuple[int, ...] = (256, 1024, 4096)  # cached context lengths of the cost model
    batch_rows: tuple[int, ...] = BATCH_ROWS  # batch sizes whose verify "batch" measures
    batch_repeats: int = 9  # timed batched forwards per size


def calibrate(model, tokenizer, heads_dir: str | os.PathLike, parts: list[str], conversations: list[dict],
              features: str | os.PathLike, settings: Settings = Settings(), report_dir: str | os.PathLike | None = None,
              log=print, phrase_data: tuple[list[dict], list[dict]] | None = None, force_cost: bool = False) -> None:
    """Measure `parts` (PARTS) for `model` (a MedusaModel with the heads of heads_dir) on the held-out
    `conversations` and this machine, and write into heads_dir's config: the fixed tree that maximises predicted
    tokens/s ("tree"), and what the per-step tree runs on (config.adaptive): calibrated acceptance ("acceptance"),
    prompt lookup's acceptance ("lookup"), verify and drafting time for these kernels ("cost"), the verify of a
    batch of rows for them ("batch": added to the kernels' cost model, which "cost" measures now or did before), a greedy
    verify's cost where it skips the LM head ("greedy", likewise added; medusa_heads/kernels/screen.py); and the target's
    phrasebook ("ngrams", tree/ngrams.py) from phrase_data = (conversations it learns, held-out ones): a store of
    the first, written beside the heads (ngrams.safetensors), its acceptance measured on the second.

    Timings ("tree", "cost", "batch", "greedy") taken while other work loaded the machine (the load average above
    its cores) or that are implausible (a verify of 2-4 tokens costing over 3x a plain step) are not stored, since
    every later call sizes its trees from them: the other parts are, and UntrustedTimings (a ValueError) says why
    at the end. force_cost=True stores them anyway (the reason stays in the config, beside them)."""
    import torch

    from medusa_heads.calibration import measure, report
    from medusa_heads.calibration.machine import machine_record
    from medusa_heads.checkpoint import save_config, save_ngrams
    from medusa_heads.kernels.prepack import is_prepacked
    from medusa_heads.shards import load_segments
    from medusa_heads.tree.calibrate import rank_paths
    from medusa_heads.tree.ngrams import NgramStore, max_order

    unknown = set(parts) - set(PARTS)
    if not parts or unknown:
        raise ValueError(f"calibrate takes parts among {', '.join(PARTS)}, got {', '.join(parts) or 'none'}")
    on_hf = model.engine is model.target
    if not on_hf and {"tree", "batch"} & set(parts):
        raise ValueError(f"--parts {','.join(sorted({'tree', 'batch'} & set(parts)))} times transformers' verify: on "
                         "llama.cpp (--gguf) calibrate cost, and the engine-free parts (acceptance, lookup, ngrams)")
    config, s = model.config, settings
    held_out = []
    if {"tree", "acceptance"} & set(parts):
        ids = {c["id"] for c in conversations}
        held_out = load_segments(features, keep_ids=ids)
        if not held_out:
            raise ValueError(f"no features for the {len(ids)} held-out conversations in {features} (compute them with: "
                             f"medusa-heads features --data ... --features {features})")
        have = {seg.conv_id for seg in held_out}
        if len(have) < len(ids):  # said, not silently dropped
            log(f"calibrate: {len(have)} of the {len(ids)} held-out conversations have features in {features}; the "
                f"other {len(ids) - len(have)} are left out (medusa-heads features --data ... --features {features})")
    details = {}
    problems: dict[str, str | None] = {}  # timed part -> why its timings cannot be trusted (None: they can)
    if "tree" in parts:
        ranks = measure.correct_ranks(model.heads, held_out, topk=s.topk)
        load = os.getloadavg()[0]
        latency = measure.verify_latency(model.target, list(range(1, s.max_nodes + 2)), context=s.context, repeats=s.repeats)
        problems["tree"] = timing_problem(load, os.getloadavg()[0], torch.get_num_threads(),
                                          [(s.context, {n: 1000 * t for n, t in latency.items()})])
        result = measure.choose_tree(rank_paths(ranks), latency, lambda spec: measure.draft_latency(model.heads, spec),
                                     s.overhead_ms / 1000, s.max_nodes)
        best = result["best"]
        log(report.tree_table(result, latency, len(ranks)))
        if problems["tree"] and not force_cost:
            log(f"calibrate: the tree is not stored: {problems['tree']}")
        else:
            config.tree = best["paths"]
            config.extra["calibration"] = {
                "nodes": best["nodes"], "predicted_tau": best["tau"], "predicted_speedup": best["speedup"],
                "dtype": str(model.base_model.dtype).removeprefix("torch."), "device": str(model.base_model.device),
                "threads": torch.get_num_threads(), "prepack": is_prepacked(model.base_model),
                "latency_ms": {n: 1000 * t for n, t in latency.items()}, "heads_ms": 1000 * best["draft_s"],
                "overhead_ms": s.overhead_ms, "held_out_positions": len(ranks),
                **({"untrusted timings": problems["tree"]} if problems["tree"] else {}),
            }
    acceptance = lookup = cost = phrases = None
    # the held-out answers as token ids: the lookup's acceptance and the greedy verify's timing both read them
    answers = measure.tokenized_answers(tokenizer, conversations) if {"lookup", "greedy"} & set(parts) else []
    if "acceptance" in parts:
        samples = measure.candidate_samples(model.heads, held_out, topk=s.accept_topk)
        acceptance, details["acceptance"] = measure.calibrate_acceptance(samples)
        log(report.acceptance_table(details["acceptance"]))
    if "lookup" in parts:
        lookup, details["lookup"] = measure.lookup_acceptance(answers, lookup_tokens=s.lookup_tokens)
        dense, details["lookup"]["every_position"] = measure.lookup_acceptance(answers, s.lookup_tokens, every_position=True)
        details["lookup"]["every_position"]["rates"] = [list(r) for r in dense.rates]
        log(report.lookup_table(details["lookup"], lookup))
    if "cost" in parts:
        key = model.engine.kernels()
        load = os.getloadavg()[0]  # other work on the machine slows every timing: kept beside them
        if on_hf:
            cost = (key, measure.measure_cost(model.target, model.heads, contexts=s.contexts, repeats=s.repeats,
                                              topk=s.accept_topk, overhead_ms=s.overhead_ms))
        else:
            cost = (key, measure.measure_engine_cost(model.engine, model.heads, config.vocab_size, contexts=s.contexts,
                                                     repeats=s.repeats, topk=s.accept_topk, overhead_ms=s.overhead_ms))
        after = os.getloadavg()[0]
        details["cost"] = {key: {"threads": torch.get_num_threads(), "repeats": s.repeats, "parents": 4,
                                 "topk": s.accept_topk, "load average": f"{load:.1f} -> {after:.1f}"}}
        log(report.cost_table(*cost))
        problems["cost"] = timing_problem(load, after, torch.get_num_threads(), _rows(cost[1]))
        if problems["cost"]:
            details["cost"][key]["untrusted timings"] = problems["cost"]
    if "batch" in parts:
        key, one_row = _one_row_cost(cost, model, config, "a batch's cost", "batch")
        load = os.getloadavg()[0]
        cost = (key, measure.measure_batch_cost(model.target, one_row, s.batch_rows, repeats=s.batch_repeats))
        after = os.getloadavg()[0]
        details.setdefault("cost", {}).setdefault(key, {})["batches"] = {
            "rows": list(s.batch_rows), "repeats": s.batch_repeats, "load average": f"{load:.1f} -> {after:.1f}"}
        log(report.batch_cost_table(*cost))
        problems["batch"] = timing_problem(load, after, torch.get_num_threads())
        if problems["batch"]:
            details["cost"][key]["batches"]["untrusted timings"] = problems["batch"]
    if "greedy" in parts:
        key, one_row = _one_row_cost(cost, model, config, "a greedy verify's cost", "greedy")
        if not model.engine.greedy_choices:  # greedy verifies run the LM head here: ms holds their cost already
            log(f"calibrate: greedy verifies run the whole LM head on these kernels ({key}): no greedy cost to measure")
        else:
            load = os.getloadavg()[0]
            cost = (key, measure.measure_greedy_cost(model.target, one_row, answers, repeats=s.repeats))
            after = os.getloadavg()[0]
            details.setdefault("cost", {}).setdefault(key, {})["greedy"] = {
                "repeats": s.repeats, "load average": f"{load:.1f} -> {after:.1f}",
                "how": "the table above less the median milliseconds a greedy verify saves, full and greedy "
                       "verifies timed alternately on held-out answers"}
            log(report.cost_table(f"{key}, greedy", cost[1].for_greedy()))
            problems["greedy"] = timing_problem(load, after, torch.get_num_threads(), _rows(cost[1].for_greedy()))
            if problems["greedy"]:
                details["cost"][key]["greedy"]["untrusted timings"] = problems["greedy"]
    if "ngrams" in parts:
        if not phrase_data or not phrase_data[0] or not phrase_data[1]:
            raise ValueError("the phrasebook needs distilled conversations to learn and held-out ones to measure on")
        learn, held = phrase_data  # held: the heads' held-out prompts, which a bench draws on: never learned
        # n-grams up to 4 tokens, fewer where their keys would not fit an int64 (3 for a 262K vocabulary)
        store = NgramStore.build(measure.tokenized_answers(tokenizer, learn), config.vocab_size,
                                 max_n=min(4, max_order(config.vocab_size)))
        fit = [c for c in held if not measure.second_half(c["id"])]  # fitted on one half, tested on the other
        test = [c for c in held if measure.second_half(c["id"])]
        if not fit or not test:
            fit, test = held, []
        phrases, details["ngrams"] = measure.ngram_acceptance(store, measure.tokenized_answers(tokenizer, fit),
                                                              measure.tokenized_answers(tokenizer, test))
        save_ngrams(heads_dir, store)
        model.phrases = store
        log(report.ngram_table(details["ngrams"]))
    refused = {part: why for part, why in problems.items() if why} if not force_cost else {}
    if refused and cost is not None and refused.keys() & {"cost", "batch", "greedy"}:
        cost = None  # measured in this run on a loaded machine: the stored cost models stay as they were
    if acceptance or lookup or cost or phrases:
        timed_here = machine_record(model.engine.device) if "cost" in parts else None
        config.adaptive = measure.merge_adaptive(config.adaptive, acceptance, lookup, cost, phrases, timed_here)
        old = config.extra.get("adaptive_calibration", {})
        config.extra["adaptive_calibration"] = {**old, **{k: report.brief(k, v) for k, v in details.items() if k != "cost"}}
        if "cost" in details and cost is not None:
            config.extra["adaptive_calibration"]["cost"] = {
                k: {**old.get("cost", {}).get(k, {}), **v} for k, v in {**old.get("cost", {}), **details["cost"]}.items()}
    save_config(heads_dir, config)
    if report_dir:
        out = report.write_report(config, details, report_dir)
        log(f"report written to {out}")
    if refused:
        chained = {"cost", "batch", "greedy"}  # one cost model: refused together
        dropped = [p for p in parts if p in refused or (p in chained and refused.keys() & chained)]
        kept = [p for p in parts if p not in dropped]
        raise UntrustedTimings(
            f"timings not stored ({', '.join(dropped)}): {next(iter(refused.values()))}; "
            + (f"{', '.join(kept)} stored; " if kept else "")
            + "rerun on an idle machine, or pass --force-cost to store them anyway")


def cpu_count() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _rows(cost) -> list[tuple[int, dict[int, float]]]:
    """A cost model's tables as (context, {size: ms})."""
    return [(c, dict(zip(cost.sizes, row))) for c, row in zip(cost.contexts, cost.ms)]


def timing_problem(load_before: float, load_after: float, threads: int,
                   tables: list[tuple[int, dict[int, float]]] = ()) -> str | None:
    """Why timings taken between two readings of the 1-minute load average, with `threads` threads, cannot be
    trusted, or None. The load counts every runnable thread, this run's too: above the cores it may use, other work
    took turns with the timed forwards. tables: (cached context, {tree size: ms}) as measured; a verify of 2-4
    tokens costing over MAX_SMALL_TREE_RATIO x a plain step (or a timing that is not a positive number) is one
    that was disturbed."""
    import math

    cores, load = cpu_count(), max(load_before, load_after)
    if load > cores + 0.5:
        return (f"the load average was {load_before:.1f} -> {load_after:.1f} on {cores} cores while {threads} "
                f"threads were timed (other work was running)")
    for context, ms in tables:
        bad = [n for n, t in ms.items() if not (math.isfinite(t) and t > 0)]
        if bad:
            return f"the verify of {bad[0]} tokens at {context} cached tokens took {ms[bad[0]]} ms"
        plain = ms.get(1)
        for n in (2, 3, 4):
            if plain and n in ms and ms[n] > MAX_SMALL_TREE_RATIO * plain:
                return (f"a {n}-token verify took {ms[n] / plain:.1f}x a plain step at {context} cached tokens "
                        f"({ms[n]:.1f} vs {plain:.1f} ms; at most {MAX_SMALL_TREE_RATIO:g}x is plausible)")
    return None


def _one_row_cost(cost, model, config, what: str, part: str):
    """(kernels key, one-row cost model) that the `part` measurement adds to: measured in this run, else stored."""
    from medusa_heads.tree.adaptive import CostModel

    key = cost[0] if cost else model.engine.kernels()
    one_row = cost[1] if cost else (config.adaptive or {}).get("cost", {}).get(key)
    if one_row is None:
        raise ValueError(f"{what} adds to the one-row cost model of these kernels ({key}), which the heads lack: "
                         f"calibrate --parts cost,{part}")
    return key, one_row if isinstance(one_row, CostModel) else CostModel.from_dict(one_row)


def held_out_conversations(conversations: list[dict], heads_dir: str | os.PathLike) -> list[dict]:
    """The conversations the heads in heads_dir did not train on (their recipe's eval fraction)."""
    from medusa_heads.checkpoint import load_config
    from medusa_heads.corpus import is_eval

    fraction = load_config(heads_dir).extra.get("recipe", {}).get("eval_fraction", 0.05)
    held = [c for c in conversations if is_eval(c["id"], fraction)]
    if not held:
        raise ValueError(f"no held-out conversations (eval fraction {fraction}) among the {len(conversations)} given")
    return held


__all__ = ["PARTS", "Settings", "UntrustedTimings", "calibrate", "held_out_conversations", "timing_problem"]
