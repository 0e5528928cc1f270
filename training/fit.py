"""`medusa-heads fit`: from a model to calibrated, benchmarked heads within a time budget, in one resumable command.

It orchestrates the library: distill (greedy and sampled answers, features kept during generation), train (a
recipe from choose_recipe), calibrate, and a short held-out bench against generate. Every decision that sizes a
phase (how many answers, how many steps) is measured on the spot, then written into DIR/fit_state.json before the
phase runs, so a rerun after a kill continues with the same numbers and ends with the same heads.

The answers come from this process (transformers' generate, features kept during generation) or, with a server
(`server=URL`, any OpenAI-compatible completions endpoint of the target) or a vLLM started for the phase
(`engine="vllm"`), from there, checked against the target first; their features then come from a separate pass
(training/features.py) within the same phase and its time.

fit itself runs the phases in order (STEPS), each on the run's shared FitRun; their work is in fit_distill.py
(distill, from either source) and fit_phases.py (train, calibrate, bench), the budget, clock, state and plan in
fit_plan.py, the prompts and answer sources in fit_sources.py, and the report in fit_report.py."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable, NamedTuple

from medusa_heads import loading
from medusa_heads.faults import crash_point
# The phases' work, looked up here when a phase runs (tests stand in for it)
from medusa_heads.training.fit_distill import distill_from_source as _distill_remote, distill_here as _distill
from medusa_heads.training.fit_phases import bench_heads as _bench, calibrate_heads as _calibrate, train_heads as _train
from medusa_heads.training.fit_plan import (FEATURES_CHUNK, PHASES, SAMPLED_SHARE, Clock, FitRun, Now, check_budget,
                                            least_budget, make_plan, parse_budget, plan_text, process_start,
                                            read_state)
from medusa_heads.training.fit_report import write_report
from medusa_heads.training.fit_sources import (answer_source, check_source, source_flag, source_text,
                                               training_prompts)


def choose_recipe(hidden_size: int, vocab_size: int, budget_s: float) -> dict:
    """The heads' shape and training keys for a base of this size and a budget: the rules, in one place.

    | key | rule | behind it |
    |---|---|---|
    | num_heads | 4 | the shipped heads; head 4's held-out top-1 (0.388) still adds to τ (docs/training.md) |
    | condition | path | the shipped heads; path-conditioning beat plain Medusa heads (docs/not-kept.md) |
    | mlp_size | 8/3·H rounded to 64 (1536 at H 576) up to H 1024; 0 (square blocks) above | the shipped block is
      576 → 1536; above H 1024 a 2.7·H block costs more per draft than it was measured to buy: not measured |
    | draft_vocab_size | min(4096, vocab) | the shipped heads: 4,096 tokens cover most answer tokens, also of a
      150K vocabulary (the draft head's cost grows with it) |
    | lr, decay, batch_size | 1e-3, 0.8, 2048 | the shipped recipe (configs/train/smollm2-135m.yaml) |
    | lookup_tokens | 10 | the shipped recipe |
    | max_steps | measured: the train phase's share of the budget over one timed step | budget rule, not a measured
      optimum |
    | max_new_tokens | 128 under 30 min, 256 above | more prompts rather than longer answers in a short budget
      ("new answers moved the heads", docs/training.md); not measured |
    | max_prompt_chars | 1,000 under 30 min, 4,000 above | a batch pads to its longest prompt: one prompt of 1,000
      tokens made a first batch of 16 take minutes on this CPU; not measured further |
    """
    mlp = 64 * round(8 * hidden_size / 3 / 64) if hidden_size <= 1024 else 0
    return {
        "recipe": dict(num_heads=4, num_layers=1, mlp_size=mlp, condition="path",
                       draft_vocab_size=min(4096, vocab_size), decay=0.8, lr=1e-3, batch_size=2048, eval_fraction=0.05,
                       lookup_tokens=10),
        "max_new_tokens": 128 if budget_s < 1800 else 256,
        "max_prompt_chars": 1000 if budget_s < 1800 else 4000,
        "sampled_share": SAMPLED_SHARE,
    }


class PhaseFailed(RuntimeError):
    """A phase of fit ended in an error: the message is one line (phase, cause, what is kept, how to go on)."""


_KEPT = {  # what a failure in each phase leaves
    "distill": "the answers written so far are kept in {out}",
    "train": "the answers are kept in {out}, and training resumes from its last checkpoint",
    "calibrate": "the trained heads in {out} load and decode losslessly with their fixed tree",
    "bench": "the heads in {out} are trained and calibrated; only the closing bench is missing",
}


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0][:300] if lines else "no message"


# ---- the phases, in order ------------------------------------------------------------------------------------------

class Phase(NamedTuple):
    """A phase: its name in PHASES (and in the state), and run(run), which says its estimate, does its work and
    returns what goes into state["done"][name] beside its seconds."""
    name: str
    run: Callable[[FitRun], dict]


def _distill_phase(run: FitRun) -> dict:
    seconds = max(run.state["plan"]["distill_by"] - run.clock.spent(), 0)
    run.log(f"fit: distill, ~{seconds / 60:.1f} min")
    if run.state.get("source", {}).get("kind", "transformers") != "transformers":
        return _distill_remote(run, seconds, FEATURES_CHUNK)
    return _distill(run, seconds)


def _train_phase(run: FitRun) -> dict:
    fixed = run.state["plan"]["calibrate_s"] + run.state["plan"]["bench_s"]  # calibrate's and the bench's plan
    seconds = max(run.clock.left() - fixed, 0)
    run.log(f"fit: train, ~{seconds / 60:.1f} min")
    return _train(run, seconds, run.clock.at(run.state["budget_s"] - fixed))


def _calibrate_phase(run: FitRun) -> dict:
    run.log(f"fit: calibrate, ~{run.state['plan']['calibrate_s'] / 60:.1f} min")
    info = _calibrate(run)
    crash_point("calibrate")  # calibrated, not yet marked done
    return info


def _bench_phase(run: FitRun) -> dict:
    run.log(f"fit: bench, ~{min(run.state['plan']['bench_s'], max(run.clock.left(), 0)) / 60:.1f} min")
    info = _bench(run, run.clock.left())
    crash_point("bench")
    return info


STEPS = (Phase("distill", _distill_phase), Phase("train", _train_phase), Phase("calibrate", _calibrate_phase),
         Phase("bench", _bench_phase))  # PHASES, each with its work


def _run_phase(run: FitRun, phase: Phase) -> None:
    """The phase, marked done when it ends; an error in it is one line naming the phase and its cause, and what is
    done stays done."""
    t0 = run.begin(phase.name)
    try:
        run.finish(phase.name, t0, **phase.run(run))
    except Exception as e:
        run.state["failed"] = {"phase": phase.name, "error": f"{type(e).__name__}: {_first_line(e)}"}
        run.save()
        raise PhaseFailed(f"{phase.name} failed ({run.state['failed']['error']}); "
                          f"{_KEPT[phase.name].format(out=run.out)}; fix the cause and rerun the same command to "
                          f"continue from {phase.name}") from e


# ---- the command ---------------------------------------------------------------------------------------------------

def _continued(out: Path, model: str, budget_s: float, seed: int) -> dict:
    """The state of the fit in `out` ({} for a new one); ValueError where it is another model's, or was started with
    another budget or seed."""
    state = read_state(out)
    if state and state.get("model") != model:
        raise ValueError(f"{out} holds a fit of {state.get('model')!r}, not {model!r}: choose another --out")
    for key, given, flag in (("budget_s", budget_s, "--budget"), ("seed", seed, "--seed")):
        if key in state and state[key] != given:
            was = f"{state[key] / 60:g}m" if key == "budget_s" else state[key]
            raise ValueError(f"{out} holds a fit started with {flag} {was}: rerun with that to continue it, or "
                             "choose another --out")
    return state


def _take_source(state: dict, source: dict, out: Path) -> None:
    """While distill is not done: the answers come from the kind of source the fit began with, checked before the
    model loads; once distilled, no server is needed."""
    if "distill" in state.get("done", {}):
        return
    recorded = state.get("source") or ({"kind": "transformers"} if "plan" in state else None)
    if recorded and recorded["kind"] != source["kind"]:
        raise ValueError(f"{out} holds a fit whose answers come from {source_text(recorded)}: rerun with "
                         f"{source_flag(recorded)} to continue it, or choose another --out")
    if not state.get("distill_parts", {}).get("answers_done"):
        state["source"] = check_source(source)  # before the model loads
    # else the answers are all in: the source that gave them stays recorded, and no server is needed


def _plan(run: FitRun) -> None:
    """A new fit's recipe and plan, timed on the target and saved; refused (one line, nothing written) where the
    budget cannot hold the phases."""
    state, base = run.state, run.base
    h, v = base.config.hidden_size, base.get_output_embeddings().weight.shape[0]
    if "plan" in state:
        return
    try:
        rules, plan = choose_recipe(h, v, state["budget_s"]), make_plan(base, run.tok, run.clock, run.bench_prompts)
    except Exception as e:
        raise PhaseFailed(f"planning failed ({type(e).__name__}: {_first_line(e)}) while timing the model's "
                          f"generate; nothing was written to {run.out}") from e
    check_budget(plan, run.clock, rules["max_new_tokens"], run.max_answers)  # before anything is written
    state.update(rules=rules, params=sum(p.numel() for p in base.parameters()), plan=plan)
    run.save()


def fit(model: str, budget_s: float, out: str | os.PathLike, *, seed: int = 0, force_cost: bool = False,
        prompts: list[str] | None = None, bench_prompts: str = "data/bench_prompts.jsonl",
        bench_files: list[str] | None = None, max_answers: int = 0, max_steps: int = 0,
        stop_after: str | None = None, started: float | None = None, log=print, server: str | None = None,
        server_model: str | None = None, concurrency: int | None = None, engine: str | None = None,
        vllm_python: str | None = None, vllm_args: str | list[str] | None = None, now: Now = time.time) -> dict:
    """Run (or continue) every phase not yet done in `out`; returns the report. max_answers / max_steps > 0 cap
    what the budget would buy (tests, or a smaller run); stop_after ends after that phase (a test hook); started:
    when the budget's clock started (default: now); now: the clock every deadline and estimate reads (a test's own
    makes fit's decisions independent of the host's speed; `started` is in its time). server (an OpenAI-compatible
    server of the target; server_model: its served name, default the first listed) or engine="vllm" (vllm_python,
    vllm_args: vLLM's server started for the phase): the answers come from there, `concurrency` requests in flight, and
    their features from a separate pass; a rerun takes the same kind of source while distill is not done."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = _continued(out, str(model), budget_s, seed)
    _take_source(state, answer_source(server, server_model, concurrency, engine, vllm_python, vllm_args), out)
    for key, value in (("model", str(model)), ("seed", seed), ("budget_s", budget_s), ("done", {})):
        state.setdefault(key, value)
    clock = Clock(state["budget_s"], state.get("spent_s", 0.0), now, started)
    if all(p in state["done"] for p in PHASES):
        log(f"fit: every phase is done in {out}; the report is {out / 'report.md'}")
        return json.loads((out / "report.json").read_text())
    log(f"fit: {model} into {out}, budget {state['budget_s'] / 60:.1f} min ({clock.spent() / 60:.1f} spent): "
        "loading the model, then a plan")
    run = FitRun(out, state, clock, log, loading.load_base(model), loading.load_tokenizer(model), prompts,
                 bench_files, bench_prompts, max_answers, max_steps, force_cost)
    _plan(run)
    log(plan_text(state, clock))
    for phase in STEPS:
        if phase.name not in state["done"]:
            _run_phase(run, phase)
            if phase.name == stop_after:
                return {}
    report = write_report(state, out)
    log((out / "report.md").read_text())
    return report


__all__ = ["PHASES", "Clock", "PhaseFailed", "answer_source", "check_budget", "check_source", "choose_recipe", "fit",
           "least_budget", "make_plan", "parse_budget", "plan_text", "process_start", "training_prompts"]
