"""Trees sized for the machine at hand, without asking the user to calibrate.

A cost model (tree/adaptive.py: CostModel) is a table of one machine's verify timings. Heads carry the tables of the
machine that calibrated them, keyed by kernels ("prepacked-float32-cpu-avx512"), and that key cannot tell an AMD EPYC
from an Intel Xeon with AMX, nor two threads from eight. So `calibrate` now stores beside each table the machine it
timed (CPU model or GPU, vector ISA, threads, torch), and at first use on another machine the model times this one's
verify in seconds (a few tree sizes at the stored contexts), reads the rest of the stored table through it, and
caches the result per machine outside the heads' folder (cache_dir()/costs). `calibrate --parts cost` stays the full
measurement. Timings taken while other work runs are used for that process only and never cached.

What the quick measurement reads from the stored table rather than measuring: the batch tables and the greedy
verify's savings, scaled at each context by how this machine's plain step compares with the stored one.

It is opt-in (MEDUSA_HEADS_MACHINE_COSTS=on): on the one machine it was measured on (a 2-core Intel Xeon, the shipped
heads' tables from an AMD EPYC) the trees it sized gained nothing (2.15x `generate` against the stored tables'
2.18x), and a run whose few timings were disturbed lost (1.96x against 2.12x; results/ab/machine_cost_ab.md).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import torch

from medusa_heads import calibration  # its timing_problem read at each call (tests replace it)
from medusa_heads.calibration.latency import level_draft_ms, ms_table, verify_latency
from medusa_heads.default_model import cache_dir
from medusa_heads.kernels.prepack import is_prepacked
from medusa_heads.machine import cost_key, cpu_name, isa
from medusa_heads.tree.adaptive import CostModel

QUICK_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # the sizes timed at first use (CostModel interpolates the rest)
QUICK_REPEATS = 2
ENV = "MEDUSA_HEADS_MACHINE_COSTS"  # "on": time this machine's tables at first use; else the stored ones as they are
_lock = threading.Lock()


def machine_record(device: torch.device | str) -> dict:
    """What a cost table depends on besides the kernels: the processor, its vector ISA as ATen dispatches it, the
    threads timed with, and torch's version (its kernels change between releases)."""
    device = torch.device(device)
    torch_version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if device.type == "cuda":
        return {"gpu": torch.cuda.get_device_name(device), "torch": torch_version}
    return {"cpu": cpu_name(), "isa": isa(),
            "threads": torch.get_num_threads(), "torch": torch_version}


def same_machine(stored: dict | None, here: dict) -> bool:
    """A table stored without a record (heads calibrated before records were kept, or built in code) is taken as
    this machine's: there is nothing to compare."""
    return stored is None or stored == here


def describe(record: dict) -> str:
    if "gpu" in record:
        return record["gpu"]
    threads = record.get("threads")
    return f"{record.get('cpu', '?')}" + (f", {threads} threads" if threads else "")


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def cache_path(record: dict, key: str, stored: dict) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", describe(record).lower()).strip("-")[:48]
    return cache_dir() / "costs" / f"{slug}-{_digest(record)}" / f"{key}-{_digest(stored)}.json"


def scaled(stored: CostModel, measured: CostModel) -> CostModel:
    """`measured` (this machine's one-row table) with the stored batch and greedy tables carried over, scaled at
    each stored context by this machine's plain step over the stored one's."""
    def ratio(context: int) -> float:
        return float(measured.verify_ms(context)[0] / stored.verify_ms(context)[0])

    def rescale(table: CostModel) -> CostModel:
        ms = tuple(tuple(round(v * ratio(c), 2) for v in row) for c, row in zip(table.contexts, table.ms))
        return dataclasses.replace(table, ms=ms)

    out = dataclasses.replace(measured, batches=tuple((b, rescale(c)) for b, c in stored.batches))
    if stored.greedy is not None:  # keep what the screen saves, scaled: greedy = measured - stored savings x ratio
        g = stored.greedy
        n = (torch.tensor(g.sizes) - 1).clamp_max(min(stored.max_size, measured.max_size) - 1)
        rows = []
        for c in g.contexts:
            saving = (stored.verify_ms(c)[n] - g.verify_ms(c)[n]) * ratio(c)
            rows.append(tuple(round(float(v), 2) for v in (measured.verify_ms(c)[n] - saving).clamp_min(0.1)))
        out = out.with_greedy(dataclasses.replace(g, ms=tuple(rows), batches=(), greedy=None))
    return out


def quick_cost(target, heads, stored: CostModel, sizes: tuple[int, ...] = QUICK_SIZES,
               repeats: int = QUICK_REPEATS) -> CostModel:
    """This machine's one-row verify at the stored contexts for `sizes` (smoothed over sizes as "steps": a few
    timings a size are noisy), drafting timed too; the stored batch and greedy tables read through it (scaled)."""
    sizes = tuple(s for s in sizes if s <= stored.max_size)
    ms = ms_table(lambda c: verify_latency(target, list(sizes), context=c, repeats=repeats), stored.contexts, sizes,
                  desc=None)
    measured = CostModel(stored.contexts, sizes, ms, draft_ms=round(level_draft_ms(heads, repeats=10), 3),
                         overhead_ms=stored.overhead_ms, fit="steps")
    return scaled(stored, measured)


def local_cost(model, key: str, stored_dict: dict, stored: CostModel, log=None) -> tuple[CostModel, str]:
    """The cost model to size trees with here, and where it came from ("stored", "cached", "measured" or
    "measured, not cached": timings taken on a busy machine). Measures at most once per process and machine."""
    if os.environ.get(ENV, "").lower() not in ("1", "on", "yes", "true"):  # opt-in: see the module's docstring
        return stored, "stored"
    device = next(model.base_model.parameters()).device
    here = machine_record(device)
    record = stored_dict.get("machine")
    if same_machine(record, here):
        return stored, "stored"
    # cached by the kernels that run here, not the table's key: an fp32 model on MKL or an int8 model sized by
    # another kernel's table must not read a table this machine timed on that kernel
    running = cost_key(model.base_model, is_prepacked(model.base_model))
    path = cache_path(here, key if running == key else f"{running}-from-{key}", stored_dict)
    log = log or (lambda msg: print(msg, file=sys.stderr))
    with _lock:
        if path.is_file():
            try:
                return CostModel.from_dict(json.loads(path.read_text())["cost"]), "cached"
            except (OSError, ValueError, KeyError, TypeError):
                pass  # a damaged cache file is measured again
        log(f"medusa-heads: the heads' step timings ({key}) were measured on {describe(record)}, not here "
            f"({describe(here)}); timing this machine's verify once (about {_seconds(stored):.0f} s), cached in "
            f"{path.parent}")
        load, t0 = os.getloadavg()[0], time.perf_counter()
        cost = quick_cost(model.target, model.heads, stored)
        after, seconds = os.getloadavg()[0], time.perf_counter() - t0
        rows = [(c, {n: float(v) for n, v in zip(cost.sizes, row)}) for c, row in zip(cost.contexts, cost.ms)]
        problem = calibration.timing_problem(load, after, torch.get_num_threads(), rows)
        if problem:
            log(f"medusa-heads: not cached ({problem}); this process uses them, the next one times again")
            return cost, "measured, not cached"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"machine": here, "key": key, "measured_from": record, "seconds": round(seconds, 1),
                                   "cost": cost.to_dict()}, indent=1))
        tmp.replace(path)
        return cost, "measured"


def _seconds(stored: CostModel) -> float:
    """About how long quick_cost takes, from the stored table: each context's prefill and its timed verifies."""
    sizes = [s for s in QUICK_SIZES if s <= stored.max_size]
    per_context = [float(stored.verify_ms(c)[torch.tensor(sizes) - 1].sum()) * (QUICK_REPEATS + 1) / 1000
                   + c / 1000 for c in stored.contexts]
    return sum(per_context) + 1
