"""`medusa-heads fit`: from a model to calibrated, benchmarked heads within a time budget, in one resumable command.

It orchestrates the library: distill (greedy and sampled answers, features kept during generation), train (a
recipe from choose_recipe), calibrate, and a short held-out bench against generate. Every decision that sizes a
phase (how many answers, how many steps) is measured on the spot, then written into DIR/fit_state.json before the
phase runs, so a rerun after a kill continues with the same numbers and ends with the same heads.

The answers come from this process (transformers' generate, features kept during generation) or, with a server
(`server=URL`, any OpenAI-compatible completions endpoint of the target) or a vLLM started for the phase
(`engine="vllm"`), from there, checked against the target first; their features then come from a separate pass
(training/features.py) within the same phase and its time."""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
from pathlib import Path
from typing import Callable

from medusa_heads.corpus import PromptRow, as_variant, is_eval, read_prompts, subsample

PHASES = ("distill", "train", "calibrate", "bench")
# Calibrate and bench cost about a fixed time, measured in the target's generate seconds a token (per_token, timed
# after loading); distill and train share the rest, DISTILL_SHARE to distill. Train's steps are sized when it starts,
# from what is left then, so it takes up what distill's estimate missed; each phase also has a deadline.
DISTILL_SHARE = 0.58  # distill : train = 0.45 : 0.33, the split of the 1-hour run (results/fit/1h)
CALIBRATE_TOKENS = 1800  # calibrate took 96-98 s on SmolLM2 at 1 thread, ~1,800 × its 54 ms a token (results/fit)
BENCH_FACTOR = 2.4  # a bench prompt: generate + prompt lookup + ours = (1 + 1 / 1.6 + 1 / speed-up) × its tokens × per_token
BENCH_SHARE = 0.10  # the bench's prompts: as many as 10% of the budget buys, at least 2, at most the file's
SAMPLED_SHARE = 0.44  # of the answers sampled at T 0.7: the shipped heads' mix (stage 4: 5,284 of 11,927 answers)
SAMPLED_VARIANT = "t07"
# SELF_SHARE of the greedy answers go to prompts a chat model wrote itself: the default model's pool holds 2,434 of
# its own among 8,233; on SmolLM2 they moved τ +1.1-1.6% on new prompts, -1.1% on the bench (docs/not-kept.md, stage 8)
SELF_SHARE = 0.3
SELF_PROMPT_TOKENS = 96  # longest prompt the model writes (a longer one is dropped)
MIN_STEPS = 20
FIRST_BATCH = 16  # answers of distill's timed batch: the least distill does
# a distilled answer costs about this many of the target's generate tokens a token it may write (batches of 16,
# features kept: 1.4 s an answer of at most 128 tokens at 32 ms a token in the 6-minute run, results/fit/6m)
ANSWER_COST = 0.35
BENCH_TOKENS = 64  # new tokens a bench prompt
STATE = "fit_state.json"
FEATURES_CHUNK = 256  # answers a features call when they come from a server: the state (time spent) is saved after each
SERVER_CHECK_TIMEOUT = 10.0  # seconds the server has to list its models before the model loads
SOURCE_CAPS = {"gsm8k-train": 2000}  # the shipped heads' distill cap (configs/train/smollm2-135m.yaml): GSM8K is
# 7,500 of the 12,126 training prompts


def parse_budget(text: str) -> float:
    """'6m', '90m', '2h', '1h30m', '45s' -> seconds."""
    m = re.fullmatch(r"\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s)?\s*", text or "")
    if not m or not any(m.groups()):
        raise ValueError(f"--budget takes a duration such as 6m, 90m, 2h or 1h30m, got {text!r}")
    h, mi, s = (float(g or 0) for g in m.groups())
    seconds = 3600 * h + 60 * mi + s
    if seconds <= 0:
        raise ValueError(f"--budget must be positive, got {text!r}")
    return seconds


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
    | max_steps | measured: the train phase's share of the budget over one timed step | budget rule, not a measured optimum |
    | max_new_tokens | 128 under 30 min, 256 above | more prompts rather than longer answers in a short budget
      ("new answers moved the heads", docs/training.md); not measured |
    | max_prompt_chars | 1,000 under 30 min, 4,000 above | a batch pads to its longest prompt: one prompt of 1,000
      tokens made a first batch of 16 take minutes on this CPU; not measured further |
    """
    mlp = 64 * round(8 * hidden_size / 3 / 64) if hidden_size <= 1024 else 0
    return {
        "recipe": dict(num_heads=4, num_layers=1, mlp_size=mlp, condition="path", draft_vocab_size=min(4096, vocab_size),
                       decay=0.8, lr=1e-3, batch_size=2048, eval_fraction=0.05, lookup_tokens=10),
        "max_new_tokens": 128 if budget_s < 1800 else 256,
        "max_prompt_chars": 1000 if budget_s < 1800 else 4000,
        "sampled_share": SAMPLED_SHARE,
    }


# ---- state ---------------------------------------------------------------------------------------------------------

def read_state(out: Path) -> dict:
    path = out / STATE
    return json.loads(path.read_text()) if path.is_file() else {}


def write_state(out: Path, state: dict) -> None:
    """Atomically: a kill leaves the old state or the new one."""
    tmp = out / f".{STATE}.tmp"
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, out / STATE)


# ---- prompts -------------------------------------------------------------------------------------------------------

def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def bench_prompt_keys(bench_files: list[str]) -> tuple[set[str], set[str]]:
    """The ids and the normalised turn texts of every prompt in the bench files: what training must not see."""
    rows = [r for f in bench_files for r in read_prompts(f)]
    return {r.id for r in rows}, {_norm(t) for r in rows for t in r.turns}


def training_prompts(prompts: list[str], bench_files: list[str], seed: int) -> list[PromptRow]:
    """The prompts of `prompts` files, less every one whose id or any turn's text is in a bench file, shuffled
    (seeded) together."""
    import random

    bench_ids, bench_text = bench_prompt_keys(bench_files)
    rows = [r for f in prompts for r in read_prompts(f)
            if r.id not in bench_ids and not any(_norm(t) in bench_text for t in r.turns)]
    random.Random(seed).shuffle(rows)
    return rows


def take(pool: list[PromptRow], n: int, fraction: float) -> list[PromptRow]:
    """The first n rows of the pool, with at least two held-out ones in each half of calibrate's split (else
    training has nothing to evaluate on, and calibrate nothing to fit on one half and test on the other)."""
    from medusa_heads.calibration.measure import second_half

    rows = pool[:n]
    for half in (False, True):
        held = sum(is_eval(r.id, fraction) and second_half(r.id) == half for r in rows)
        rows += [r for r in pool[n:] if is_eval(r.id, fraction) and second_half(r.id) == half][: max(0, 2 - held)]
    return rows


# ---- where the answers come from -----------------------------------------------------------------------------------

def answer_source(server: str | None = None, server_model: str | None = None, concurrency: int | None = None,
                  engine: str | None = None, vllm_python: str | None = None,
                  vllm_args: str | list[str] | None = None) -> dict:
    """fit's answer source from its options: {"kind": "transformers"} (this process), {"kind": "server", "url",
    "model", "concurrency"} or {"kind": "vllm", "python", "args", "concurrency"}. ValueError (one line) for options
    that do not go together; nothing is contacted here (check_source does that)."""
    import shlex

    if server and engine:
        raise ValueError("--server and --engine both name where the answers come from: give one")
    if engine not in (None, "vllm"):
        raise ValueError(f"--engine takes vllm, got {engine!r}")
    if server_model and not server:
        raise ValueError("--server-model names the model served at --server: give --server URL too")
    if concurrency is not None and not (server or engine):
        raise ValueError("--concurrency is the number of requests in flight to --server or --engine: give one")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"--concurrency must be positive, got {concurrency}")
    for flag, given in (("--vllm-python", vllm_python), ("--vllm-args", vllm_args)):
        if given and engine != "vllm":
            raise ValueError(f"{flag} is for --engine vllm: give --engine vllm too, or leave it out")
    if server:
        return {"kind": "server", "url": server.rstrip("/").removesuffix("/v1"), "model": server_model,
                "concurrency": concurrency or 16}
    if engine:
        args = shlex.split(vllm_args) if isinstance(vllm_args, str) else list(vllm_args or [])
        return {"kind": "vllm", "python": vllm_python, "args": args, "concurrency": concurrency or 16}
    return {"kind": "transformers"}


def check_source(source: dict) -> dict:
    """Before the model loads: the server answers (its served model's name is filled in), or vLLM's python is found.
    ValueError in one line if not."""
    from medusa_heads.training.remote import Server, ServerError, vllm_python

    try:
        if source["kind"] == "server":
            source["model"] = Server(source["url"], source.get("model"), timeout=SERVER_CHECK_TIMEOUT).served_model()
        elif source["kind"] == "vllm":
            source["python"] = vllm_python(source.get("python"))
    except ServerError as e:
        raise ValueError(("--server: " if source["kind"] == "server" else "") + str(e)) from None
    return source


def source_text(source: dict | None) -> str:
    """Where the answers come from, for the plan, the log and the report."""
    kind = (source or {}).get("kind", "transformers")
    if kind == "server":
        return f"the server {source.get('model')!r} at {source['url']}"
    if kind == "vllm":
        return f"vLLM started for the phase ({source.get('python')})"
    return "this process (transformers' generate)"


def _source_flag(source: dict) -> str:
    return {"server": f"--server {source.get('url')}", "vllm": "--engine vllm"}.get(source["kind"],
                                                                                   "neither --server nor --engine")


# ---- the command ---------------------------------------------------------------------------------------------------

Now = Callable[[], float]


class Clock:
    """The budget's time, the one time fit reads: every deadline and every estimate (distill's end, answers, steps,
    the bench) comes from `now`. That is wall time for a user; a test passes a clock of its own (one that advances by
    counts), so that what fit decides does not depend on the host's speed or load. spent(): the seconds spent
    before this run (from the state) plus this run's, since `started` (in `now`'s time; default: now)."""

    def __init__(self, budget_s: float, spent_before: float, now: Now = time.time, started: float | None = None):
        self.budget, self.before, self.now = budget_s, spent_before, now
        self.t0 = now() if started is None else min(started, now())

    def spent(self) -> float:
        return self.before + self.now() - self.t0

    def at(self, spent: float) -> float:
        """The time (in `now`'s) at which the budget clock reads `spent`."""
        return self.t0 + spent - self.before

    def left(self) -> float:
        return self.budget - self.spent()


def plan_text(state: dict, clock: Clock) -> str:
    """Each phase: done (how long it took) or its estimate from the plan."""
    plan, done = state["plan"], state["done"]
    left = max(clock.left(), 0)
    cal_bench = sum(plan[k] for k in ("calibrate_s", "bench_s") if "calibrate" not in done or k == "bench_s")
    distill = max(plan["distill_by"] - clock.spent(), 0) if "distill" not in done else 0
    est = {"distill": distill, "train": max(left - distill - cal_bench, 0), "calibrate": plan["calibrate_s"],
           "bench": plan["bench_s"]}
    lines = [f"fit: budget {clock.budget / 60:.1f} min, {clock.spent() / 60:.1f} min spent "
             f"(the target generates {1 / plan['per_token']:.1f} tokens/s here)"]
    source = state.get("source") or {"kind": "transformers"}
    for p in PHASES:
        what = f"done in {done[p]['seconds']:.0f} s" if p in done else f"~{est[p] / 60:.1f} min"
        if p == "distill" and source["kind"] != "transformers":
            parts = done.get(p) or state.get("distill_parts") or {}
            what += (f" (answers {parts.get('answers_s', 0):.0f} s, features {parts.get('features_s', 0):.0f} s)"
                     if p in done else "")
            what += f": answers from {source_text(source)}, their features in a separate pass"
        lines.append(f"  {p:<10} {what}")
    if cal_bench > left:  # the target is slower here than the budget allows (another job running, or a big model)
        lines.append(f"  calibrate and the bench alone need ~{cal_bench / 60:.1f} min of the {left / 60:.1f} left: the "
                     f"budget will be overrun by at least {(cal_bench - left) / 60:.1f} min; give a larger --budget, "
                     "or run it with nothing else on the machine")
    return "\n".join(lines)


def _per(seconds: float, count: int) -> float:
    """Seconds a unit of work, never 0 (a test's clock may read no time passing): the sizes divide by it."""
    return max(seconds, 1e-6) / max(count, 1)


def make_plan(base, tok, clock: Clock, bench_prompts: str) -> dict:
    """Time the target's generate once; from it the fixed phases' estimates and distill's end (in budget seconds)."""
    import torch

    from medusa_heads.prompting import prompt_ids

    rows = read_prompts(bench_prompts)
    ids = prompt_ids(tok, rows[0].turns[0])
    with torch.no_grad():
        times = []
        for _ in range(3):  # the fastest of three: the first warms up
            s = clock.now()
            base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16, do_sample=False)
            times.append(clock.now() - s)
    per_token = _per(min(times), 16)
    per_prompt = BENCH_FACTOR * BENCH_TOKENS * per_token
    n_bench = max(2, min(len(rows), int(BENCH_SHARE * clock.budget / per_prompt)))
    calibrate_s, bench_s = CALIBRATE_TOKENS * per_token, n_bench * per_prompt
    spent = clock.spent()
    free = max(clock.budget - spent - calibrate_s - bench_s, 0)
    return {"per_token": per_token, "calibrate_s": calibrate_s, "bench_prompts": n_bench, "bench_s": bench_s,
            "distill_by": spent + DISTILL_SHARE * free}


def least_budget(plan: dict, spent: float, max_new_tokens: int, first_batch: int = FIRST_BATCH) -> float:
    """The smallest budget whose plan holds every phase, from a plan timed here: what is spent (Python's start,
    loading, the timing), calibrate, the bench (2 prompts, or its share of the budget where that buys more), and a
    distill share that buys its timed batch (train then gets its share of the same)."""
    first = first_batch * ANSWER_COST * max_new_tokens * plan["per_token"]
    held = spent + plan["calibrate_s"] + first / DISTILL_SHARE
    per_prompt = plan["bench_s"] / plan["bench_prompts"]
    return max(held + 2 * per_prompt, held / (1 - BENCH_SHARE))


def _duration(seconds: float) -> str:
    """As --budget takes it: 20s, 6m, 1h30m."""
    h, rest = divmod(round(seconds), 3600)
    m, s = divmod(rest, 60)
    return "".join(f"{v}{unit}" for v, unit in ((h, "h"), (m, "m"), (s, "s")) if v) or "0s"


def check_budget(plan: dict, clock: Clock, max_new_tokens: int, max_answers: int = 0) -> None:
    """ValueError (one line, naming the smallest budget that would do) where the budget cannot hold the phases:
    said before any phase starts, rather than a plan that overruns."""
    spent = clock.spent()
    least = least_budget(plan, spent, max_new_tokens, min(FIRST_BATCH, max_answers or FIRST_BATCH))
    if clock.budget < least:
        raise ValueError(f"--budget {_duration(clock.budget)} cannot hold the phases here: the target generates "
                         f"{1 / plan['per_token']:.1f} tokens/s, so what is spent ({spent:.0f} s: starting, loading, "
                         "timing it), calibrate, a bench of 2 prompts and distill's first batch need at least "
                         f"{least / 60:.1f} min; give --budget {math.ceil(least / 60)}m or more")


def process_start() -> float:
    """When this process started (Linux: /proc), else now: the budget counts Python's start and imports too."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return min(boot + ticks / os.sysconf("SC_CLK_TCK"), time.time())
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


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


def fit(model: str, budget_s: float, out: str | os.PathLike, *, seed: int = 0, force_cost: bool = False,
        prompts: list[str] | None = None, bench_prompts: str = "data/bench_prompts.jsonl",
        bench_files: list[str] | None = None, max_answers: int = 0, max_steps: int = 0,
        stop_after: str | None = None, started: float | None = None, log=print, server: str | None = None,
        server_model: str | None = None, concurrency: int | None = None, engine: str | None = None,
        vllm_python: str | None = None, vllm_args: str | list[str] | None = None, now: Now = time.time) -> dict:
    """Run (or continue) every phase not yet done in `out`; returns the report. max_answers / max_steps > 0 cap
    what the budget would buy (tests, or a smaller run); stop_after ends after that phase (a test hook); started:
    when the budget's clock started (default: now); now: the clock every deadline and estimate reads (a test's own
    makes fit's decisions independent of the host's speed; `started` is in its time). server (an OpenAI-compatible server of the target; server_model:
    its served name, default the first listed) or engine="vllm" (vllm_python, vllm_args: vLLM's server started for
    the phase): the answers come from there, `concurrency` requests in flight, and their features from a separate
    pass; a rerun takes the same kind of source while distill is not done."""
    from medusa_heads.loading import load_base, load_tokenizer
    from medusa_heads.training.loop import crash_point

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = read_state(out)
    if state and state.get("model") != str(model):
        raise ValueError(f"{out} holds a fit of {state.get('model')!r}, not {str(model)!r}: choose another --out")
    for key, given, flag in (("budget_s", budget_s, "--budget"), ("seed", seed, "--seed")):
        if key in state and state[key] != given:
            was = f"{state[key] / 60:g}m" if key == "budget_s" else state[key]
            raise ValueError(f"{out} holds a fit started with {flag} {was}: rerun with that to continue it, or "
                             "choose another --out")
    source = answer_source(server, server_model, concurrency, engine, vllm_python, vllm_args)
    if "distill" not in state.get("done", {}):  # where the answers come from; once distilled, no server is needed
        recorded = state.get("source") or ({"kind": "transformers"} if "plan" in state else None)
        if recorded and recorded["kind"] != source["kind"]:
            raise ValueError(f"{out} holds a fit whose answers come from {source_text(recorded)}: rerun with "
                             f"{_source_flag(recorded)} to continue it, or choose another --out")
        if not state.get("distill_parts", {}).get("answers_done"):
            state["source"] = check_source(source)  # before the model loads
        # else the answers are all in: the source that gave them stays recorded, and no server is needed
    state.setdefault("model", str(model))
    state.setdefault("seed", seed)
    state.setdefault("budget_s", budget_s)
    state.setdefault("done", {})
    clock = Clock(state["budget_s"], state.get("spent_s", 0.0), now, started)
    if all(p in state["done"] for p in PHASES):
        log(f"fit: every phase is done in {out}; the report is {out / 'report.md'}")
        return json.loads((out / "report.json").read_text())
    log(f"fit: {model} into {out}, budget {state['budget_s'] / 60:.1f} min ({clock.spent() / 60:.1f} spent): "
        "loading the model, then a plan")
    base, tok = load_base(model), load_tokenizer(model)
    h, v = base.config.hidden_size, base.get_output_embeddings().weight.shape[0]

    running: dict = {}  # the phase under way: its name, when this process began it, its seconds in earlier runs

    def save() -> None:  # the state, with the time spent so far (a kill loses at most the time since)
        state["spent_s"] = clock.spent()
        if running:  # a phase resumed after a kill counts its earlier runs' time too
            state.setdefault("phase_s", {})[running["phase"]] = running["before"] + clock.now() - running["t0"]
        write_state(out, state)

    if "plan" not in state:
        try:
            rules, plan = choose_recipe(h, v, state["budget_s"]), make_plan(base, tok, clock, bench_prompts)
        except Exception as e:
            raise PhaseFailed(f"planning failed ({type(e).__name__}: {_first_line(e)}) while timing the model's "
                              f"generate; nothing was written to {out}") from e
        check_budget(plan, clock, rules["max_new_tokens"], max_answers)  # before anything is written
        state.update(rules=rules, params=sum(p.numel() for p in base.parameters()), plan=plan)
        save()
    log(plan_text(state, clock))
    plan = state["plan"]

    def finish(phase: str, t0: float, **info) -> None:
        before = running.get("before", 0.0) if running.get("phase") == phase else 0.0
        state["done"][phase] = {"seconds": before + clock.now() - t0, **info}
        running.clear()
        save()

    fraction = state["rules"]["recipe"]["eval_fraction"]
    data = [out / "distilled.jsonl", out / f"distilled_{SAMPLED_VARIANT}.jsonl"]
    fixed = plan["calibrate_s"] + plan["bench_s"]
    for phase in PHASES:
        if phase in state["done"]:
            continue
        t0 = clock.now()
        running.update(phase=phase, t0=t0, before=state.get("phase_s", {}).get(phase, 0.0))
        state.pop("failed", None)
        try:
            if phase == "distill":
                seconds = max(plan["distill_by"] - clock.spent(), 0)
                log(f"fit: distill, ~{seconds / 60:.1f} min")
                remote = state.get("source", {}).get("kind", "transformers") != "transformers"
                run = _distill_remote if remote else _distill
                finish(phase, t0, **run(base, tok, state, out, data, seconds, fraction, prompts, bench_files,
                                        max_answers, log, save, clock.now))
            elif phase == "train":
                seconds = max(clock.left() - fixed, 0)
                log(f"fit: train, ~{seconds / 60:.1f} min")
                finish(phase, t0, **_train(base, state, out, data, seconds, clock.at(state["budget_s"] - fixed),
                                           max_steps, log, save, clock.now))
            elif phase == "calibrate":
                log(f"fit: calibrate, ~{plan['calibrate_s'] / 60:.1f} min")
                info = _calibrate(base, tok, state, out, data, force_cost, log)
                crash_point("calibrate")  # calibrated, not yet marked done
                finish(phase, t0, **info)
            else:
                log(f"fit: bench, ~{min(plan['bench_s'], max(clock.left(), 0)) / 60:.1f} min")
                info = _bench(base, tok, state, out, clock.left(), bench_prompts, log)
                crash_point("bench")
                finish(phase, t0, **info)
            if phase == stop_after:
                return {}
        except Exception as e:  # one line naming the phase and its cause; what is done stays done
            state["failed"] = {"phase": phase, "error": f"{type(e).__name__}: {_first_line(e)}"}
            save()
            raise PhaseFailed(f"{phase} failed ({state['failed']['error']}); {_KEPT[phase].format(out=out)}; fix "
                              f"the cause and rerun the same command to continue from {phase}") from e
    report = write_report(state, out)
    log((out / "report.md").read_text())
    return report


def _prompt_pool(state, tok, prompts, bench_files) -> tuple[list[str], bool, list[str], list[PromptRow]]:
    """(prompt files, whether the model's own prompts join them, bench files, the pool: decontaminated, capped,
    shuffled, short enough)."""
    from medusa_heads.default_model import DEFAULT_MODEL
    from medusa_heads.prompting import has_chat_template

    files = prompts or ["data/train_prompts.jsonl.gz"]
    chat = prompts is None and has_chat_template(tok)
    if chat and str(state["model"]) == DEFAULT_MODEL:
        files = files + ["data/self_prompts.jsonl.gz"]  # written by this model already (scripts/make_self_prompts.py)
    bench = bench_files if bench_files is not None else sorted(str(p) for p in Path("data").glob("bench_prompts*.jsonl"))
    pool = [r for r in subsample(training_prompts(files, bench, state["seed"]), SOURCE_CAPS, state["seed"])
            if sum(map(len, r.turns)) <= state["rules"]["max_prompt_chars"]]
    return files, chat, bench, pool


def _distill(base, tok, state, out, data, seconds, fraction, prompts, bench_files, max_answers, log, save,
             now: Now) -> dict:
    """Greedy answers to the first prompts, then sampled ones to the first of those: as many as the phase's time
    buys, measured on the first batch; features kept during generation."""
    from tqdm import tqdm

    from medusa_heads.corpus import read_conversations
    from medusa_heads.default_model import DEFAULT_MODEL
    from medusa_heads.training.distill import distill
    from medusa_heads.training.loop import crash_point
    from medusa_heads.training.self_prompts import write_self_prompts

    t0 = now()
    files, chat, bench, pool = _prompt_pool(state, tok, prompts, bench_files)
    tokens, batch = state["rules"]["max_new_tokens"], 16
    kw = dict(max_new_tokens=tokens, batch_size=batch, seed=state["seed"], features=out / "features")
    if "answers" not in state:  # one batch, timed, sizes the phase
        cap = max_answers or len(pool)
        s, written, k = now(), 0, 1
        while True:  # a batch of new answers is timed (after a kill in it, the next one: rows already done are skipped)
            first = take(pool, min(k * batch, cap), fraction)
            written += distill(base, tok, first, data[0], **kw)["written"]
            if written >= min(batch, cap) or k * batch >= cap:
                break
            k += 1
        per = _per(now() - s, written)
        n = int(max(seconds - (now() - t0), 0) / per)
        n = max(min(n, cap, 2 * len(pool)), len(first))  # the first batch alone makes working heads
        writes = chat and str(state["model"]) != DEFAULT_MODEL  # a chat model without prompts of its own yet
        own = int(SELF_SHARE * (n - int(n * state["rules"]["sampled_share"]))) if writes else 0
        # writing a prompt costs about SELF_PROMPT_TOKENS / tokens of an answer, twice over as about half are kept
        n = max(n - int(own * 2 * SELF_PROMPT_TOKENS / tokens), len(first))
        greedy = max(n - int(n * state["rules"]["sampled_share"]), len(first))
        state["answers"] = {"greedy": greedy, "sampled": n - greedy, "self_prompts": own, "timed": min(k * batch, cap),
                            "seconds_per_answer": per, "prompts_available": len(pool), "files": files}
        save()
        log(f"fit: {per:.2f} s an answer: {greedy} greedy and {n - greedy} sampled answers in ~{n * per:.0f} s"
            + (f", {own} of them to prompts the model writes first" if own else ""))
    a = state["answers"]
    if a.get("self_prompts"):  # after the timed batch's prompts, before the rest
        own = write_self_prompts(base, tok, out / "self_prompts.jsonl.gz", a["self_prompts"], exclude=bench,
                                 batch_size=batch, max_new_tokens=SELF_PROMPT_TOKENS, seed=state["seed"],
                                 max_batches=2 * -(-a["self_prompts"] // batch) + 2)
        known = bench_prompt_keys(bench)[1]
        own = [r for r in own if _norm(r.turns[0]) not in known]
        pool = pool[: a["timed"]] + own + pool[a["timed"]:]
    deadline = t0 + 1.1 * seconds  # an estimate that was off stops the phase here, not the budget's end
    greedy = take(pool, a["greedy"], fraction)
    sampled = as_variant(take(pool, a["sampled"], fraction), SAMPLED_VARIANT) if a["sampled"] else []
    data[1].touch()
    stopped = False
    have = {c["id"] for p in data for c in read_conversations(p)}
    jobs = [(greedy, data[0], {}), (sampled, data[1], {"temperature": 0.7})]
    bar = tqdm(total=len(greedy) + len(sampled), initial=sum(r.id in have for rows, _, _ in jobs for r in rows),
               desc="distill (greedy, then sampled)", unit="answer")
    for rows, path, extra in jobs:
        for i in range(0, len(rows), batch):  # a batch at a time, to look at the clock
            if now() > deadline:
                stopped = True
                break
            n = distill(base, tok, rows[: i + batch], path, **kw, **extra, progress=False)["written"]
            bar.update(n)  # the rows before are done: skipped
            save()  # the time spent
            crash_point("distill")
    bar.close()
    if stopped:
        log(f"fit: distill stopped at its deadline, {now() - t0:.0f} s")
    return {"greedy": len(read_conversations(data[0])), "sampled": len(read_conversations(data[1])),
            "stopped_at_deadline": stopped}


@contextlib.contextmanager
def _serving(state: dict, out: Path, log):
    """The answers' server for the phase: the one given, or a vLLM started here and stopped on leaving."""
    from medusa_heads.training.remote import Server, VllmEngine

    source = state["source"]
    if source["kind"] == "server":
        yield Server(source["url"], source.get("model"))
        return
    from medusa_heads.default_model import resolve_model

    log(f"fit: starting vLLM ({source['python']}) on {state['model']}; its log: {out / 'vllm.log'}")
    with VllmEngine(str(resolve_model(state["model"])), source["python"], out / "vllm.log", source["args"]) as server:
        source["url"], source["model"] = server.url, server.model
        yield server


def _distill_remote(base, tok, state, out, data, seconds, fraction, prompts, bench_files, max_answers, log,
                    save, now: Now) -> dict:
    """Answers from a server (or a vLLM started here), then their features in a separate pass, both within the
    phase's time: the server is checked against the target, one batch of answers and then its features are timed,
    and the phase's share sets how many answers follow (44% sampled, as in _distill); answers stop being asked for
    when the features of those written would no longer fit before the phase's end (1.1× its share). Resumable:
    answers written are kept (distill_from_server skips them), features written are kept (the pass skips them)."""
    from tqdm import tqdm

    from medusa_heads.corpus import read_conversations
    from medusa_heads.shards import feature_ids
    from medusa_heads.training.features import features_from_conversations
    from medusa_heads.training.loop import crash_point
    from medusa_heads.training.remote import ServerError, check_server, distill_from_server

    t0 = now()
    deadline = t0 + 1.1 * seconds
    source = state["source"]
    files, _, _, pool = _prompt_pool(state, tok, prompts, bench_files)
    parts = state.setdefault("distill_parts", {"answers_s": 0.0, "features_s": 0.0})
    folder = out / "features"
    data[1].touch()
    mark = [now()]

    def tick(part: str) -> None:  # the time since the last tick goes to `part` ("answers_s" or "features_s")
        t = now()
        parts[part] += t - mark[0]
        mark[0] = t

    def lacking() -> list[dict]:  # answers without features yet
        have = feature_ids(folder) if folder.is_dir() else set()
        return [c for p in data for c in read_conversations(p) if c["id"] not in have]

    def features(convs: list[dict]) -> int:
        bar = tqdm(total=len(convs), desc="features (a separate pass)", unit="answer")
        for i in range(0, len(convs), FEATURES_CHUNK):  # the time spent saved after each chunk
            features_from_conversations(base, tok, convs[i : i + FEATURES_CHUNK], folder, progress=False)
            bar.update(len(convs[i : i + FEATURES_CHUNK]))
            tick("features_s")
            save()
            crash_point("distill-features")
        bar.close()
        return len(convs)

    def asked(counts: dict) -> dict:
        if counts["failed"] and not counts["written"]:
            raise ServerError(f"every request failed ({counts['failed']}; the first: {counts['first_error']})")
        if counts["failed"]:
            log(f"fit: {counts['failed']} requests failed (the first: {counts['first_error']}); left out")
        return counts

    stopped = False
    if not parts.get("answers_done"):
        with _serving(state, out, log) as server:
            state["server_check"] = check_server(server, base, tok, pool, log=log)
            tick("answers_s")
            save()
            kw = dict(max_new_tokens=state["rules"]["max_new_tokens"], concurrency=source.get("concurrency", 16),
                      seed=state["seed"], progress=False)
            if "answers" not in state:  # one batch of answers, then its features, timed, size the phase
                cap = max_answers or len(pool)
                size = min(max(16, kw["concurrency"]), cap)  # every request in flight at once, at least
                s, written, k = now(), 0, 1
                while True:  # after a kill in it, the next batch: rows already answered are skipped
                    first = take(pool, min(k * size, cap), fraction)
                    written += asked(distill_from_server(server, tok, first, data[0], **kw))["written"]
                    if written >= size or k * size >= cap:
                        break
                    k += 1
                per_answer = _per(now() - s, written)
                tick("answers_s")
                save()
                s, todo = now(), lacking()
                features(todo)
                per_feature = _per(now() - s, len(todo))
                done_now = sum(len(read_conversations(p)) for p in data)
                n = done_now + int(max(seconds - (now() - t0), 0) / (per_answer + per_feature))
                n = max(min(n, cap, 2 * len(pool)), len(first))  # the first batch alone makes working heads
                greedy = max(n - int(n * state["rules"]["sampled_share"]), len(first))
                state["answers"] = {"greedy": greedy, "sampled": n - greedy, "self_prompts": 0,
                                    "timed": min(k * size, cap), "timed_answers": done_now,
                                    "seconds_per_answer": per_answer,
                                    "features_seconds_per_answer": per_feature, "prompts_available": len(pool),
                                    "files": files}
                save()
                log(f"fit: {per_answer:.2f} s an answer from {source_text(source)}, {per_feature:.2f} s its features: "
                    f"{greedy} greedy and {n - greedy} sampled answers in ~{n * (per_answer + per_feature):.0f} s "
                    f"(answers ~{n * per_answer:.0f} s, features ~{n * per_feature:.0f} s)")
            a = state["answers"]
            per_feature = a["features_seconds_per_answer"]
            pending = len(lacking())
            asked_now = [0]  # answers written in the jobs so far, each to be featurized later

            def over(counts: dict | None = None) -> bool:
                """Whether an answer more would leave too little time for the features of those written."""
                if now() - mark[0] > 5:  # the time spent, saved now and then
                    tick("answers_s")
                    save()
                if counts is not None:
                    crash_point("distill")  # an answer of the phase written
                written = asked_now[0] + (counts["written"] if counts else 0)
                return now() + per_feature * (pending + written) > deadline

            greedy = take(pool, a["greedy"], fraction)
            sampled = as_variant(take(pool, a["sampled"], fraction), SAMPLED_VARIANT) if a["sampled"] else []
            have = {c["id"] for p in data for c in read_conversations(p)}
            bar = tqdm(total=len(greedy) + len(sampled), initial=sum(r.id in have for r in greedy + sampled),
                       desc=f"distill (greedy, then sampled; {source['kind']})", unit="answer")
            for rows, path, temperature in ((greedy, data[0], 0.0), (sampled, data[1], 0.7)):
                if stopped or over():
                    stopped = True
                    break
                counts = asked(distill_from_server(server, tok, rows, path, temperature=temperature, stop=over, **kw))
                asked_now[0] += counts["written"]
                bar.update(counts["written"])
                stopped = counts["stopped"]
            bar.close()
        tick("answers_s")  # the engine stopped too
        parts["answers_done"], parts["stopped"] = True, stopped
        save()
        if stopped:
            log(f"fit: answers stopped at {now() - t0:.0f} s, to leave their features time before the "
                "phase's end")
    todo = lacking()
    if todo:
        log(f"fit: features of {len(todo)} answers, ~{len(todo) * state['answers']['features_seconds_per_answer']:.0f} s")
        features(todo)
    check = state.get("server_check") or {}
    return {"greedy": len(read_conversations(data[0])), "sampled": len(read_conversations(data[1])),
            "stopped_at_deadline": parts.get("stopped", False), "source": dict(source), "answers_s": parts["answers_s"],
            "features_s": parts["features_s"], "greedy_checked": check.get("greedy_checked"),
            "greedy_differ": check.get("greedy_differ"), "tokenizer": check.get("tokenizer")}


def _train(base, state, out, data, seconds, deadline, max_steps, log, save, now: Now) -> dict:
    """Steps as many as the phase's time buys at one timed step (measured on the heads themselves); past the
    deadline (in `now`'s time) training stops at the step it is on, with a final evaluation and the heads saved."""
    from medusa_heads.training.recipe import TrainRecipe
    from medusa_heads.training.trainer import train

    files = [str(p) for p in data if p.is_file() and p.stat().st_size]
    rules = state["rules"]["recipe"]
    if "steps" not in state:
        per = _time_step(base, rules, now)
        n = max(MIN_STEPS, int(seconds * 0.95 / per))  # evaluation and checkpoints: the rest; the deadline bounds it
        n = min(n, max_steps) if max_steps else n
        state["steps"] = {"max_steps": n, "seconds_per_step": per}
        save()
        log(f"fit: {per:.3f} s a step: {n} steps")
    n = state["steps"]["max_steps"]
    recipe = TrainRecipe(model=state["model"], data=",".join(files), features=str(out / "features"), out=str(out),
                         max_steps=n, warmup_steps=max(1, min(50, n // 10)), eval_every=max(1, n // 4),
                         save_every=max(1, n // 4), seed=state["seed"], **rules)
    train(recipe, resume=True, deadline=deadline, now=now)
    log_rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines() if line.strip()]
    data_row = next(r for r in log_rows if r["kind"] == "data")
    final = [r for r in log_rows if r["kind"] == "eval"][-1]
    steps = max(r["step"] for r in log_rows if r["kind"] == "eval")
    return {"steps": steps, "planned_steps": n, "train_tokens": data_row["train_tokens"], "eval_tokens": data_row["eval_tokens"],
            "top1": [final[f"top1_{k + 1}"] for k in range(rules["num_heads"])]}


def _time_step(base, rules: dict, now: Now = time.time, repeats: int = 3) -> float:
    """Seconds of one optimizer step of these heads over a batch of random features (the median of `repeats`)."""
    import torch

    from medusa_heads.heads import MedusaHeads
    from medusa_heads.training.loss import medusa_loss
    from medusa_heads.training.recipe import TrainRecipe

    lm, emb = base.get_output_embeddings().weight.detach(), base.get_input_embeddings().weight.detach()
    recipe = TrainRecipe(model="", **rules)
    vocab = list(range(min(rules["draft_vocab_size"] or lm.shape[0], lm.shape[0])))
    heads = MedusaHeads(recipe.heads_config(*lm.shape, vocab, {}), lm, emb)
    opt = torch.optim.AdamW(heads.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    b, k = rules["batch_size"], rules["num_heads"]
    hidden = torch.randn(b, lm.shape[1], generator=g)
    context = torch.randint(0, lm.shape[0], (b, heads.config.context_size), generator=g)
    targets = torch.randint(0, len(vocab), (b, k), generator=g)
    times = []
    for _ in range(repeats + 1):
        s = now()
        loss = medusa_loss(heads(hidden, context), targets, rules["decay"])[0]
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(now() - s)
    return _per(sorted(times[1:])[len(times[1:]) // 2], 1)  # the first warms up


def _calibrate(base, tok, state, out, data, force_cost, log) -> dict:
    """Acceptance, lookup, the phrasebook and the kernels' cost; timings refused under load are not stored
    (unless force_cost) and the heads then keep their fixed tree."""
    from medusa_heads.calibration import Settings, UntrustedTimings, calibrate, held_out_conversations
    from medusa_heads.corpus import read_conversations
    from medusa_heads.model import MedusaModel

    convs = [c for p in data if p.is_file() for c in read_conversations(p)]
    held = held_out_conversations(convs, out)
    ids = {c["id"] for c in held}
    learn = [c for c in convs if c["id"] not in ids]
    model = MedusaModel.from_pretrained(base, heads=str(out))
    positions = getattr(base.config, "max_position_embeddings", None) or 1 << 20
    settings = Settings(repeats=5, contexts=tuple(c for c in Settings.contexts if c < positions) or (positions // 2,))
    problem, attempts = None, [["acceptance", "lookup", "ngrams", "cost"], ["acceptance", "lookup", "cost"],
                               ["lookup", "cost"], ["cost"]]
    for parts in attempts:  # the first the data allows: acceptance needs held-out answers in both halves, lookup tokens
        try:
            calibrate(model, tok, out, parts, held, out / "features", settings,
                      phrase_data=(learn, held) if "ngrams" in parts else None, force_cost=force_cost, log=log)
            break
        except UntrustedTimings as e:
            problem = str(e)
            log(f"fit: {problem}: the heads keep their fixed tree")
            break
        except ValueError as e:
            log(f"fit: calibrating {', '.join(parts)}: {e}; trying with less")
    else:
        parts = []  # nothing calibrated: the heads keep their fixed tree
    return {"held_out": len(held), "parts": parts, "untrusted_timings": problem, "forced": force_cost}


def _bench(base, tok, state, out, seconds, bench_prompts, log) -> dict:
    """A short bench against generate on held-out prompts: the plan's number, fewer if less time is left."""
    from medusa_heads.bench import run_bench
    from medusa_heads.corpus import read_prompts
    from medusa_heads.model import MedusaModel

    model = MedusaModel.from_pretrained(base, heads=str(out))
    rows = read_prompts(bench_prompts)
    if "bench_prompts" not in state:  # the plan's, fewer where less time is left (at least 2)
        per_prompt = state["plan"]["bench_s"] / state["plan"]["bench_prompts"]
        state["bench_prompts"] = max(2, min(state["plan"]["bench_prompts"], int(seconds / per_prompt)))
    # transformers' prompt lookup beside the heads: the free baseline a user has without training anything
    result = run_bench(model, tok, rows[: state["bench_prompts"]], ["hf", "pld", "medusa"], BENCH_TOKENS)
    m, pld = result["overall"]["medusa"], result["overall"]["pld"]
    return {"prompts": state["bench_prompts"], "tau": m["mean_accepted"], "speedup": m["speedup_vs_hf"],
            "differ": m["mismatches_vs_hf"], "file": str(bench_prompts),
            "per_step_tree": model.cost_model() is not None, "pld_speedup": pld["speedup_vs_hf"],
            "pld_tau": pld["mean_accepted"]}


def write_report(state: dict, out: Path) -> dict:
    d = state["done"]
    report = {
        "model": state["model"], "budget_s": state["budget_s"], "spent_s": state.get("spent_s"),
        "phases_s": {p: d[p]["seconds"] for p in PHASES},
        "answers": {k: d["distill"][k] for k in ("greedy", "sampled")},
        "answers_source": {**d["distill"].get("source", {"kind": "transformers"}),
                           **{k: d["distill"][k] for k in ("tokenizer", "greedy_checked", "greedy_differ")
                              if k in d["distill"]}},
        "distill_parts_s": ({"answers": d["distill"]["answers_s"], "features": d["distill"]["features_s"]}
                            if "answers_s" in d["distill"] else None),
        "train_tokens": d["train"]["train_tokens"], "eval_tokens": d["train"]["eval_tokens"],
        "steps": d["train"]["steps"], "held_out_top1": d["train"]["top1"], "recipe": state["rules"],
        "calibration": {"untrusted_timings": d["calibrate"]["untrusted_timings"], "forced": d["calibrate"]["forced"]},
        "bench": {k: d["bench"].get(k) for k in ("prompts", "tau", "speedup", "differ", "file", "per_step_tree",
                                                  "pld_speedup", "pld_tau")},
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    b, r = report["bench"], report["recipe"]["recipe"]
    tree = "the per-step tree (calibrated)" if b["per_step_tree"] else "the fixed tree (no trusted cost model: " \
        f"{report['calibration']['untrusted_timings'] or 'none measured'})"
    src, parts = report["answers_source"], report["distill_parts_s"]
    if src["kind"] == "transformers":
        origin = f"{source_text(src)}, features kept during generation"
    else:
        differ = (f"; {src['greedy_differ']} of {src['greedy_checked']} greedy answers checked differ from the "
                  "target's own" if src.get("greedy_checked") is not None else "")
        origin = f"{source_text(src)}{differ}; features in a separate pass"
    phases = ", ".join(f"{p} {s:.0f} s" + (f" (answers {parts['answers']:.0f} s, features {parts['features']:.0f} s)"
                                            if p == "distill" and parts else "") for p, s in report["phases_s"].items())
    verdict = []
    if b["pld_speedup"] is not None:  # the first lines say whether the training paid against the free baseline
        from medusa_heads.bench import lookup_verdict

        verdict = [lookup_verdict(b["speedup"], b["pld_speedup"], "on this model"), ""]
    md = [f"# fit: {state['model']}", "", *verdict,
          f"Budget {state['budget_s'] / 60:.1f} min, spent {report['spent_s'] / 60:.1f} min "
          f"({phases}; the rest: loading).", "",
          "| what the budget bought | |", "|---|---|",
          f"| answers | {report['answers']['greedy']} greedy + {report['answers']['sampled']} sampled (T 0.7) |",
          f"| answers from | {origin} |",
          f"| answer tokens | {report['train_tokens']:,} training, {report['eval_tokens']:,} held out |",
          f"| heads | {r['num_heads']} × {r['condition']}-conditioned, mlp {r['mlp_size']}, draft vocabulary {r['draft_vocab_size']} |",
          f"| training steps | {report['steps']} |",
          f"| held-out top-1, heads 1–{r['num_heads']} | {' / '.join(f'{t:.3f}' for t in report['held_out_top1'])} |",
          f"| bench | {b['prompts']} prompts of {b['file']}, {BENCH_TOKENS} new tokens, greedy |",
          f"| τ (tokens a forward) | {b['tau']:.2f} |", f"| speed-up over generate | {b['speedup']:.2f}× |",
          *([f"| prompt lookup (transformers, 10 tokens): τ, speed-up | {b['pld_tau']:.2f}, {b['pld_speedup']:.2f}× |"]
            if b["pld_speedup"] is not None else []),
          f"| outputs that differ from generate | {b['differ']} |", f"| tree used | {tree} |", ""]
    (out / "report.md").write_text("\n".join(md))
    return report


__all__ = ["PHASES", "Clock", "PhaseFailed", "answer_source", "check_budget", "check_source", "choose_recipe", "fit",
           "least_budget", "make_plan", "parse_budget", "plan_text", "process_start", "training_prompts"]
