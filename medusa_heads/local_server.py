"""A server process started here for the length of a run: a free port, its log, a /health wait, a clean stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the process that started it dies, even by kill -9 (Linux), so that
    a killed run leaves no server behind."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """`cmd` (which must listen on `port`) in a process group of its own, output to `log`. `start` returns once
    `http://127.0.0.1:port/health` answers 200, or raises `error` in one line naming the log; `stop` ends the whole
    group (a server's workers too) and closes the log; a run killed outright takes the server with it (Linux)."""

    def __init__(self, cmd: list[str], port: int, log: str | os.PathLike, name: str, error: type[Exception],
                 env: dict | None = None) -> None:
        self.cmd, self.port, self.log, self.name, self.error, self.env = cmd, port, Path(log), name, error, env
        self.proc: subprocess.Popen | None = None
        self._log_file = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=self.env,
                                     preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise self.error(f"{self.name} exited ({self.proc.returncode}) before it was ready; "
                                 f"its log: {self.log}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise self.error(f"{self.name} was not ready in {timeout:.0f} s; its log: {self.log}")
            time.sleep(0.2)

    def stop(self, grace: float = 30.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
