"""Calibration: what the heads' config learns from held-out data and this machine, in one place. `calibrate`
(parts.py) runs the parts asked for; `measure` holds the measurements (the heads' acceptance from acceptance.py, this
machine's timings from latency.py), `report` what they print and write; timing.py is the alternating A/B loop that
every timing in the project shares. The pure choice of a tree from measured rank accuracies is tree/calibrate.py (no
model)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from importlib import import_module

# measure.PARTS and measure.BATCH_ROWS, kept here too so that the command line's --help imports no torch
# (tests/test_errors.py checks that the two agree)
PARTS = ("tree", "acceptance", "lookup", "cost", "batch", "greedy", "ngrams", "loop")
BATCH_ROWS = (2, 4, 8)
TIMED_PARTS = ("tree", "cost", "batch", "greedy", "loop")  # what stores timings of this machine
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


def cpu_count() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def timing_problem(load_before: float, load_after: float, threads: int,
                   tables: list[tuple[int, dict[int, float]]] = ()) -> str | None:
    """Why timings taken between two readings of the 1-minute load average, with `threads` threads, cannot be
    trusted, or None. The load counts every runnable thread, this run's too: above the cores it may use, other work
    took turns with the timed forwards. tables: (cached context, {tree size: ms}) as measured; a verify of 2-4
    tokens costing over MAX_SMALL_TREE_RATIO x a plain step (or a timing that is not a positive number) is one
    that was disturbed."""
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


def __getattr__(name: str):
    """calibrate and held_out_conversations, from parts.py on first use: it imports torch, which --help must not."""
    if name in ("calibrate", "held_out_conversations"):
        return getattr(import_module("medusa_heads.calibration.parts"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PARTS", "Settings", "UntrustedTimings", "calibrate", "held_out_conversations", "timing_problem"]
