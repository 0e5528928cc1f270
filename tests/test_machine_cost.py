"""Trees sized for the machine at hand: a cost table timed on another machine is timed again here at first use, in
seconds, cached per machine outside the heads' folder; never cached from a busy machine; output stays the target's."""
from __future__ import annotations

import json

import pytest
import torch

from medusa_heads.calibration import machine
from medusa_heads.calibration.measure import merge_adaptive
from medusa_heads.machine import kernels_key
from medusa_heads.tree.adaptive import CostModel

from conftest import tiny_model
from test_adaptive import calibrated

ELSEWHERE = {"cpu": "AMD EPYC 7B13", "isa": "avx512", "threads": 2, "torch": "2.13"}
# timed elsewhere: trees nearly free (a 32-token verify 1.2x a plain step), batches and a greedy table
STORED = CostModel(contexts=(8, 40), sizes=(1, 2, 32), ms=((10.0, 10.0, 12.0), (20.0, 20.0, 24.0)), draft_ms=0.1,
                   overhead_ms=3.0, fit="measured",
                   batches=((2, CostModel((8, 40), (1, 32), ((15.0, 30.0), (30.0, 60.0)))),),
                   greedy=CostModel((8, 40), (1, 32), ((8.0, 10.0), (17.0, 21.0))))


@pytest.fixture
def machine_costs(monkeypatch, tmp_path):
    """Machine costs on (they are opt-in), and a cache of this test's own."""
    import medusa_heads.calibration as calibration

    monkeypatch.setenv(machine.ENV, "on")
    monkeypatch.setenv("MEDUSA_HEADS_CACHE", str(tmp_path / "cache"))
    # the test host's own load (other test workers) must not decide these tests: an idle machine, and a tiny
    # model's timings judged by the load alone (test_timings_from_a_busy_machine_... sets a busy one)
    monkeypatch.setattr(machine.os, "getloadavg", lambda: (0.2, 0.2, 0.2))
    real_problem = calibration.timing_problem
    monkeypatch.setattr(calibration, "timing_problem", lambda before, after, threads, tables=(): real_problem(before, after, threads))
    timed = []
    real = machine.quick_cost
    monkeypatch.setattr(machine, "quick_cost", lambda *a, **k: timed.append(1) or real(*a, **k))
    return timed


def stored_elsewhere(seed: int = 4, record: dict | None = ELSEWHERE):
    base = tiny_model("llama", seed=seed)
    model = calibrated(base, STORED, rates=(0.9,) * 4)
    entry = STORED.to_dict()
    if record is not None:
        entry["machine"] = record
    model.config.adaptive["cost"] = {kernels_key(base, False): entry}
    return base, model


def test_a_table_timed_on_another_machine_is_timed_here_once_and_cached(machine_costs, tmp_path, capsys):
    base, model = stored_elsewhere()
    cost = model.cost_model()
    assert machine_costs == [1] and cost != STORED and cost.sizes == machine.QUICK_SIZES[:len(cost.sizes)]
    assert cost.contexts == STORED.contexts and all(v > 0 for row in cost.ms for v in row)
    assert model.cost_model_key() == f"{kernels_key(base, False)} (this machine's: measured)"
    said = capsys.readouterr().err.splitlines()[0]  # one line, then the timings' progress bars
    assert said.startswith(f"medusa-heads: the heads' step timings ({kernels_key(base, False)}) were measured on AMD "
                           "EPYC 7B13, 2 threads, not here (") and "cached in" in said
    files = list((tmp_path / "cache" / "costs").rglob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["measured_from"] == ELSEWHERE
    # greedy output stays the target's with this machine's trees
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    ref = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=20), ref)
    # a second model (another process would do the same) reads the cache: nothing timed again
    _, again = stored_elsewhere()
    assert again.cost_model() == cost and machine_costs == [1]
    assert again.cost_model_key().endswith("(this machine's: cached)")


def test_a_table_timed_here_or_without_a_record_is_used_as_stored(machine_costs):
    here = machine.machine_record("cpu")
    for record in (here, None):
        _, model = stored_elsewhere(record=record)
        assert model.cost_model() == STORED
    assert machine_costs == []
    _, model = stored_elsewhere(record={**here, "threads": here["threads"] + 6})  # another thread count
    assert model.cost_model() != STORED and machine_costs == [1]


def test_another_thread_count_in_the_same_process_is_timed_for_itself(machine_costs):
    threads = torch.get_num_threads()
    _, model = stored_elsewhere(record={**machine.machine_record("cpu"), "threads": threads})
    assert model.cost_model() == STORED
    try:
        torch.set_num_threads(threads + 1)
        assert model.cost_model() != STORED and machine_costs == [1]
    finally:
        torch.set_num_threads(threads)
    assert model.cost_model() == STORED


def test_timings_from_a_busy_machine_are_used_but_never_cached(machine_costs, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(machine.os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    _, model = stored_elsewhere()
    assert model.cost_model() != STORED and model.cost_model_key().endswith("(this machine's: measured, not cached)")
    assert not list((tmp_path / "cache").rglob("*.json")) and "not cached (the load average was 9.0" in capsys.readouterr().err
    _, again = stored_elsewhere()
    again.cost_model()
    assert machine_costs == [1, 1]


def test_without_the_switch_the_stored_tables_size_the_trees(machine_costs, monkeypatch):
    for value in ("off", ""):
        monkeypatch.setenv(machine.ENV, value)
        _, model = stored_elsewhere()
        assert model.cost_model() == STORED and machine_costs == []


def test_batches_and_greedy_savings_are_read_through_this_machines_plain_step():
    """Here a plain step costs 2x the stored one at context 8 and 1.5x at 40: batch tables scale by that, and the
    greedy verify saves what it saved there, scaled alike."""
    here = CostModel((8, 40), (1, 32), ((20.0, 40.0), (30.0, 45.0)), draft_ms=0.2, overhead_ms=3.0, fit="steps")
    out = machine.scaled(STORED, here)
    assert out.ms == here.ms and out.draft_ms == 0.2
    (rows, batch), = out.batches
    assert rows == 2 and batch.ms == ((30.0, 60.0), (45.0, 90.0))
    # stored savings: 2 ms (plain) and 2 ms (32 tokens) at 8; 3 and 3 at 40; scaled by 2 and 1.5
    assert out.greedy.ms == ((16.0, 36.0), (25.5, 40.5))


def test_calibrate_keeps_the_machine_beside_its_table_and_a_partial_rerun_keeps_it():
    one = merge_adaptive(None, cost=("k", STORED), machine=ELSEWHERE)
    assert one["cost"]["k"]["machine"] == ELSEWHERE and CostModel.from_dict(one["cost"]["k"]) == STORED
    again = merge_adaptive(one, cost=("k", STORED.with_batches({4: STORED.batches[0][1]})))
    assert again["cost"]["k"]["machine"] == ELSEWHERE


def test_the_shipped_heads_name_the_machines_their_tables_came_from():
    from medusa_heads.default_model import default_heads_path

    costs = json.loads((default_heads_path() / "config.json").read_text())["adaptive"]["cost"]
    assert all("machine" in c for c in costs.values())
    assert all(("gpu" in c["machine"]) == ("cuda" in key) for key, c in costs.items())


@pytest.mark.skipif(not (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")),
                    reason="this PyTorch build has no MKL packed SGEMM")
def test_other_kernels_sized_by_the_same_table_are_timed_and_cached_apart(machine_costs, tmp_path, monkeypatch):
    """An fp32 model on MKL's packed products takes oneDNN's stored table where it has none of its own, but what this
    machine timed for one kernel is never read for the other."""
    from medusa_heads.kernels.prepack import prepack_linears

    def packed_model(kernel: str):
        monkeypatch.setenv("MEDUSA_HEADS_FP32_KERNEL", kernel)
        base = tiny_model("llama", seed=4)
        model = calibrated(base, STORED, rates=(0.9,) * 4)
        prepack_linears(base)
        entry = {**STORED.to_dict(), "machine": ELSEWHERE}
        model.config.adaptive["cost"] = {"prepacked-float32-cpu": entry}  # oneDNN's, from another machine
        return model

    onednn = packed_model("onednn")
    assert onednn.cost_model_key() == "prepacked-float32-cpu (this machine's: measured)" and machine_costs == [1]
    mkl = packed_model("mkl")
    assert mkl.cost_model_key() == "prepacked-float32-cpu (this machine's: measured)" and machine_costs == [1, 1]
    names = sorted(p.name for p in (tmp_path / "cache" / "costs").rglob("*.json"))
    assert len(names) == 2 and names[0].startswith("prepacked-float32-cpu") and names[1].startswith("prepacked-mkl-float32-cpu"), names
    assert packed_model("mkl").cost_model_key().endswith("(this machine's: cached)") and machine_costs == [1, 1]
