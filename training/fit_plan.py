"""fit's plan: the budget, the phases' shares of it, the clock every deadline reads, the state kept in
DIR/fit_state.json (with what a run's phases share, FitRun), and the plan timed on the target before any phase."""
from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from medusa_heads.corpus import read_prompts
from medusa_heads.prompting import prompt_ids
from medusa_heads.training.fit_sources import source_text

PHASES = ("distill", "train", "calibrate", "bench")
# Calibrate and bench cost about a fixed time, measured in the target's generate seconds a token (per_token, timed
# after loading); distill and train share the rest, DISTILL_SHARE to distill. Train's steps are sized when it starts,
# from what is left then, so it takes up what distill's estimate missed; each phase also has a deadline.
DISTILL_SHARE = 0.58  # distill : train = 0.45 : 0.33, the split of the 1-hour run (results/training/fit/1h)
# calibrate took 96-98 s on SmolLM2 at 1 thread, ~1,800 × its 54 ms a token (results/training/fit)
CALIBRATE_TOKENS = 1800
# a bench prompt: generate + prompt lookup + ours = (1 + 1 / 1.6 + 1 / speed-up) × its tokens × per_token
BENCH_FACTOR = 2.4
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
# features kept: 1.4 s an answer of at most 128 tokens at 32 ms a token in the 6-minute run, results/training/fit/6m)
ANSWER_COST = 0.35
BENCH_TOKENS = 64  # new tokens a bench prompt
STATE = "fit_state.json"
FEATURES_CHUNK = 256  # answers a features call when they come from a server: the state (time spent) is saved after each


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


# ---- state ---------------------------------------------------------------------------------------------------------

def read_state(out: Path) -> dict:
    path = out / STATE
    return json.loads(path.read_text()) if path.is_file() else {}


def write_state(out: Path, state: dict) -> None:
    """Atomically: a kill leaves the old state or the new one."""
    tmp = out / f".{STATE}.tmp"
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, out / STATE)


# ---- the clock -----------------------------------------------------------------------------------------------------

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


@dataclass
class FitRun:
    """What the phases of a run share: the folder and its state (saved as the work goes), the budget's clock, the
    log, the target, and the options that bound the phases. `running`: the phase under way (its name, when this
    process began it, its seconds in earlier runs)."""
    out: Path
    state: dict
    clock: Clock
    log: Callable[[str], None]
    base: Any = None
    tok: Any = None
    prompts: list[str] | None = None
    bench_files: list[str] | None = None
    bench_prompts: str = "data/bench_prompts.jsonl"
    max_answers: int = 0
    max_steps: int = 0
    force_cost: bool = False
    running: dict = field(default_factory=dict)

    @property
    def data(self) -> list[Path]:
        """The answers' files: greedy, then sampled."""
        return [self.out / "distilled.jsonl", self.out / f"distilled_{SAMPLED_VARIANT}.jsonl"]

    @property
    def fraction(self) -> float:
        return self.state["rules"]["recipe"]["eval_fraction"]

    def now(self) -> float:
        return self.clock.now()

    def save(self) -> None:
        """The state, with the time spent so far (a kill loses at most the time since)."""
        self.state["spent_s"] = self.clock.spent()
        if self.running:  # a phase resumed after a kill counts its earlier runs' time too
            phase = self.running
            self.state.setdefault("phase_s", {})[phase["phase"]] = phase["before"] + self.clock.now() - phase["t0"]
        write_state(self.out, self.state)

    def begin(self, phase: str) -> float:
        """The phase is under way from now (returned), after its seconds in earlier runs."""
        t0 = self.clock.now()
        self.running.update(phase=phase, t0=t0, before=self.state.get("phase_s", {}).get(phase, 0.0))
        self.state.pop("failed", None)
        return t0

    def finish(self, phase: str, t0: float, **info) -> None:
        """The phase is done: its seconds (earlier runs' too) and what it returned, saved."""
        before = self.running.get("before", 0.0) if self.running.get("phase") == phase else 0.0
        self.state["done"][phase] = {"seconds": before + self.clock.now() - t0, **info}
        self.running.clear()
        self.save()


# ---- the plan ------------------------------------------------------------------------------------------------------

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


def per_unit(seconds: float, count: int) -> float:
    """Seconds a unit of work, never 0 (a test's clock may read no time passing): the sizes divide by it."""
    return max(seconds, 1e-6) / max(count, 1)


def make_plan(base, tok, clock: Clock, bench_prompts: str) -> dict:
    """Time the target's generate once; from it the fixed phases' estimates and distill's end (in budget seconds)."""
    rows = read_prompts(bench_prompts)
    ids = prompt_ids(tok, rows[0].turns[0])
    with torch.no_grad():
        times = []
        for _ in range(3):  # the fastest of three: the first warms up
            s = clock.now()
            base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                          do_sample=False)
            times.append(clock.now() - s)
    per_token = per_unit(min(times), 16)
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
