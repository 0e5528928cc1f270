"""A clock for fit's tests that advances by counts, not by the host's speed: what fit decides from time (distill's
end, how many answers and steps, the bench's prompts, every deadline) then comes out the same on a fast machine and
on a loaded 2-core one, and the tests can assert exact counts."""
from __future__ import annotations

import threading
from pathlib import Path


class Ticks:
    """Each reading is `step` seconds after the last; advance() adds time, as slow work would. fit reads its clock
    a few hundred times a run, so with the default step a budget of minutes never binds and the caps (max_answers,
    max_steps) decide the counts; a test that wants time to bind advances it."""

    def __init__(self, step: float = 1e-3):
        self.t, self.step, self._lock = 0.0, step, threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            self.t += self.step
            return self.t

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.t += seconds


def tick_fit(monkeypatch, clock: Ticks | None = None) -> Ticks:
    """`medusa-heads fit` run in-process (cli.main) on `clock` instead of wall time."""
    import medusa_heads.training.fit as fit_module

    clock = clock or Ticks()
    real = fit_module.fit
    monkeypatch.setattr(fit_module, "fit", lambda *a, **k: real(*a, **{**k, "now": clock, "started": None}))
    return clock


# `python -c TICKING_CLI fit ...`: the command line in a process of its own (the kill -9 tests), on a Ticks clock
TICKING_CLI = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import medusa_heads.training.fit as fit_module
from fit_clock import Ticks
real = fit_module.fit
fit_module.fit = lambda *a, **k: real(*a, **{{**k, "now": Ticks(), "started": None}})
from medusa_heads.cli import main
main(sys.argv[1:])
"""
