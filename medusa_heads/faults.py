"""Fault injection for the tests of resumable work, at named points inside it (after distill's batch, a features
shard, a training checkpoint, calibrate's files, the bench): MEDUSA_HEADS_KILL_AT=name kills the process there with
SIGKILL, as `kill -9` would (no cleanup, no flush); MEDUSA_HEADS_FAIL_AT=name raises there, as an error inside the
work would (a full disk, a bad row). Unset, a point costs one environment lookup."""
from __future__ import annotations

import os
import signal


class InjectedFailure(RuntimeError):
    """The error MEDUSA_HEADS_FAIL_AT raises."""


def crash_point(name: str) -> None:
    if os.environ.get("MEDUSA_HEADS_KILL_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("MEDUSA_HEADS_FAIL_AT") == name:
        raise InjectedFailure(f"a failure injected at {name} (MEDUSA_HEADS_FAIL_AT)\n(a second line a traceback "
                              "would print)")
