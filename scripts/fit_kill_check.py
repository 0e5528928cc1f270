#!/usr/bin/env python
"""`medusa-heads fit` killed with SIGKILL inside each phase in turn, rerun after each kill, against one run that was
not killed (same model, seed and caps): are the answers, the heads and their evaluations the same?

    python -m scripts.fit_kill_check --out runs/killcheck --json results/training/fit/kill_check.json

The kill comes from the command itself (MEDUSA_HEADS_KILL_AT=phase: after distill's first batch, train's first
checkpoint, calibrate's files, the bench), so it lands at the same point every time. --max-answers and --max-steps
cap what the budget buys so that both runs train on the same answers for the same steps; the bench's timings and
the calibrated kernel costs are timings, so they are not compared."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from scripts.common import Option, parser

PHASES = ("distill", "train", "calibrate", "bench")
SAME = ("heads.safetensors", "distilled.jsonl", "distilled_t07.jsonl")


def main() -> None:
    p = parser(__doc__, "model", out=Option("runs/killcheck", "folder for the two runs (replaced)"))
    p.add_argument("--budget", default="8m")
    p.add_argument("--max-answers", type=int, default=32)
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--json", default="results/training/fit/kill_check.json")
    args = p.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    argv = [sys.executable, "-m", "medusa_heads.cli", "fit", "--model", args.model, "--budget", args.budget,
            "--max-answers", str(args.max_answers), "--max-steps", str(args.max_steps)]
    print(f"two fits of {args.model} with at most {args.max_answers} answers and {args.max_steps} steps: one whole, "
          f"one killed in each of the {len(PHASES)} phases (about three times the budget's work in all)", flush=True)

    def run(folder: Path, kill_at: str = "") -> tuple[int, float]:
        s = time.time()
        rc = subprocess.run(argv + ["--out", str(folder)], env={**os.environ, "MEDUSA_HEADS_KILL_AT": kill_at},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
        print(f"  {folder.name}{' killed in ' + kill_at if kill_at else ''}: exit {rc}, {time.time() - s:.0f} s",
              flush=True)
        return rc, time.time() - s

    rows = {"whole": run(out / "whole")[0]}
    for phase in PHASES:
        rc, _ = run(out / "killed", phase)
        done = json.loads((out / "killed" / "fit_state.json").read_text())["done"]
        rows[f"killed in {phase}"] = {"exit": rc, "sigkill": rc == -signal.SIGKILL, "phase_done": phase in done}
    rows["rerun"] = run(out / "killed")[0]

    def evals(folder: Path) -> list[dict]:
        log = [json.loads(line) for line in (folder / "train_log.jsonl").read_text().splitlines() if line.strip()]
        return [r for r in log if r["kind"] == "eval"]

    same = {name: (out / "whole" / name).read_bytes() == (out / "killed" / name).read_bytes() for name in SAME}
    same["train_log evaluations"] = evals(out / "whole") == evals(out / "killed")
    reports = {k: json.loads((out / k / "report.json").read_text()) for k in ("whole", "killed")}
    result = {"model": args.model, "budget": args.budget, "max_answers": args.max_answers, "max_steps": args.max_steps,
              "runs": rows, "same": same, "answers": reports["whole"]["answers"], "steps": reports["whole"]["steps"],
              "differ_vs_generate": {k: r["bench"]["differ"] for k, r in reports.items()},
              "all_same": all(same.values()) and all(v["sigkill"] and not v["phase_done"]
                                                     for k, v in rows.items() if k.startswith("killed"))}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    sys.exit(0 if result["all_same"] else 1)


if __name__ == "__main__":
    main()
