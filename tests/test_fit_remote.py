"""`fit --server URL` and `fit --engine vllm`: the distill phase takes its answers from an OpenAI-compatible server
(the stand-in of tests/test_remote.py, a tiny model behind http.server) or a vLLM started for the phase (its stand-in
python), checks it against the target first, computes the features in a separate pass, stays resumable (a kill -9
while answering, an interruption while computing features) and says where the answers came from; bad options are
one line before any model loads. fit runs on a clock that advances by counts (tests/fit_clock.py): the answers it
buys are the same on any host."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from medusa_heads.corpus import read_conversations
from medusa_heads.model import MedusaModel
from medusa_heads.shards import feature_ids, shard_paths
from fit_clock import TICKING_CLI, Ticks, tick_fit
from test_fit import _model, write_prompts
from test_remote import FAKE_VLLM, FakeEngine


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("fit-remote-prompts"), seed=1, n=300)


@pytest.fixture
def target(tmp_path):
    """A tiny llama with a word-level tokenizer, saved (what fit loads) and in memory (what the stand-in serves)."""
    from transformers import AutoTokenizer

    base = _model(tmp_path / "model", "llama")
    return base, AutoTokenizer.from_pretrained(tmp_path / "model")


def _answers(out: Path) -> dict[str, list[dict]]:
    return {c["id"]: c["messages"] for name in ("distilled.jsonl", "distilled_t07.jsonl")
            for c in read_conversations(out / name)}


def test_fit_with_a_server_trains_on_its_answers_and_reports_it(target, tmp_path, prompts, monkeypatch):
    import medusa_heads.training.fit as fit_module
    from medusa_heads.training.fit import fit

    # calibrate is tested with fit in tests/test_fit.py; here the heads keep their fixed tree (a third of the time)
    monkeypatch.setattr(fit_module, "_calibrate", lambda *a, **k: {"held_out": 0, "parts": [], "forced": False,
                                                                   "untrusted_timings": "not calibrated in this test"})
    torch.set_num_threads(1)  # set back after the test (conftest)
    base, tok = target
    engine = FakeEngine(base, tok)
    logs: list[str] = []
    out = tmp_path / "heads"
    try:
        report = fit(str(tmp_path / "model"), 300, out, prompts=[str(prompts / "train.jsonl")],
                     bench_files=[str(prompts / "bench.jsonl")], bench_prompts=str(prompts / "bench.jsonl"),
                     max_answers=24, max_steps=8, log=logs.append, server=engine.url + "/v1", concurrency=4,
                     now=Ticks())
    finally:
        engine.close()
    text = "\n".join(logs)
    assert f"answers from the server 'tiny' at {engine.url}, their features in a separate pass" in text  # the plan
    assert f"server check: 'tiny' at {engine.url}; tokenizer same; 0 of 4 greedy answers" in text
    src = report["answers_source"]
    assert src["kind"] == "server" and src["url"] == engine.url and src["model"] == "tiny" and src["concurrency"] == 4
    assert src["greedy_checked"] == 4 and src["greedy_differ"] == 0 and src["tokenizer"] == "same"
    parts = report["distill_parts_s"]
    assert parts["answers"] > 0 and parts["features"] > 0
    answers = _answers(out)
    n = report["answers"]["greedy"] + report["answers"]["sampled"]
    state = json.loads((out / "fit_state.json").read_text())
    planned = state["answers"]["greedy"] + state["answers"]["sampled"]
    assert planned == 24 and not state["done"]["distill"]["stopped_at_deadline"]  # the cap, all of it answered
    assert len(answers) == n >= 24 and report["answers"]["sampled"] > 0
    assert engine.requests == 4 + n  # the check's 4 greedy answers, then one request per (one-turn) answer
    assert feature_ids(out / "features") >= set(answers)  # every answer's hidden states, from the separate pass
    assert report["steps"] == 8 and report["bench"]["differ"] == 0
    md = (out / "report.md").read_text()
    assert (f"| answers from | the server 'tiny' at {engine.url}; 0 of 4 greedy answers checked differ from the "
            "target's own; features in a separate pass |") in md
    assert f"distill {report['phases_s']['distill']:.0f} s (answers {parts['answers']:.0f} s, features" in md
    model = MedusaModel.from_pretrained(base, heads=str(out))
    ids = torch.tensor([[2, 5, 9, 14]])
    ref = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=24), ref)


def test_kill_9_while_answering_then_an_interruption_in_features_keep_what_was_written(target, tmp_path, prompts,
                                                                                     monkeypatch):
    """The command killed with SIGKILL after an answer of the phase (a subprocess), rerun and interrupted after the
    first chunk of features by a failure, rerun to the end of distill: no answer is asked twice, the killed run's answers are
    kept as written, the features written before the interruption are kept and only the rest are computed."""
    import medusa_heads.training.fit as fit_module
    from medusa_heads.cli import main

    base, tok = target
    engine = FakeEngine(base, tok)
    out = tmp_path / "heads"
    # on a clock of counts: the killed run's time is charged to the budget, and on wall time a slow host once left
    # the rerun's answers no time (19 of 30), so no features were left to interrupt
    tick_fit(monkeypatch)
    argv = ["fit", "--model", str(tmp_path / "model"), "--budget", "5m", "--out", str(out), "--prompts",
            str(prompts / "train.jsonl"), "--bench-prompts", str(prompts / "bench.jsonl"), "--max-answers", "24",
            "--stop-after", "distill", "--server", engine.url, "--concurrency", "2", "--threads", "1"]
    try:
        env = {**os.environ, "MEDUSA_HEADS_KILL_AT": "distill"}
        killed = subprocess.run([sys.executable, "-c", TICKING_CLI, *argv], env=env, capture_output=True, text=True,
                                timeout=600)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
        state = json.loads((out / "fit_state.json").read_text())
        assert "distill" not in state["done"] and state["source"]["kind"] == "server" and "answers" in state
        before, asked_before = _answers(out), engine.requests
        planned = state["answers"]["greedy"] + state["answers"]["sampled"]
        assert planned == 24  # the cap
        assert state["answers"]["timed_answers"] < len(before) < planned  # the timed batch and an answer after it

        monkeypatch.setenv("MEDUSA_HEADS_FAIL_AT", "distill-features")  # a failure after the first chunk
        monkeypatch.setattr(fit_module, "FEATURES_CHUNK", 8)
        with pytest.raises(SystemExit, match="^medusa-heads fit: distill failed \\(InjectedFailure"):
            main(argv)
        answered = _answers(out)
        assert {k: answered[k] for k in before} == before  # kept as written
        assert engine.requests - asked_before == 4 + len(answered) - len(before)  # the check, then the rest only
        shards = {p: p.stat().st_mtime_ns for p in shard_paths(out / "features")}
        with_features = feature_ids(out / "features")
        assert len(with_features) < len(answered)

        monkeypatch.delenv("MEDUSA_HEADS_FAIL_AT")
        asked_before = engine.requests
        main(argv)
    finally:
        engine.close()
    assert engine.requests == asked_before  # the answers were done: the server was not asked again
    assert _answers(out) == answered
    assert all(p.stat().st_mtime_ns == t for p, t in shards.items())  # features written before: kept as they were
    assert feature_ids(out / "features") >= set(answered)
    state = json.loads((out / "fit_state.json").read_text())
    done = state["done"]["distill"]
    assert done["source"] == {"kind": "server", "url": engine.url, "model": "tiny", "concurrency": 2}
    assert done["answers_s"] > 0 and done["features_s"] > 0
    # the phase counts its killed runs' time too
    assert done["answers_s"] > 0 and done["seconds"] >= done["answers_s"] + done["features_s"] - 1e-9
    assert done["greedy"] + done["sampled"] == len(answered)


def test_fit_engine_vllm_starts_vllm_for_the_phase_and_stops_it(target, tmp_path, prompts, capsys, monkeypatch):
    from medusa_heads.cli import main

    tick_fit(monkeypatch)
    fake = tmp_path / "python"
    fake.write_text(FAKE_VLLM.format(python=sys.executable, tests=Path(__file__).parent))
    fake.chmod(0o755)
    out = tmp_path / "heads"
    main(["fit", "--model", str(tmp_path / "model"), "--budget", "5m", "--out", str(out), "--prompts",
          str(prompts / "train.jsonl"), "--bench-prompts", str(prompts / "bench.jsonl"), "--max-answers", "20",
          "--stop-after", "distill", "--engine", "vllm", "--vllm-python", str(fake), "--vllm-args",
          "--dtype float32", "--threads", "1"])
    err = capsys.readouterr().err
    assert f"answers from vLLM started for the phase ({fake}), their features in a separate pass" in err  # the plan
    assert "fit: starting vLLM" in err and "server check: 'target'" in err and "0 of 4 greedy answers" in err
    log = (out / "vllm.log").read_text()
    assert "--served-model-name target" in log and "--dtype float32" in log
    done = json.loads((out / "fit_state.json").read_text())["done"]["distill"]
    assert done["source"]["kind"] == "vllm" and done["source"]["model"] == "target" and done["greedy_differ"] == 0
    answers = _answers(out)
    planned = json.loads((out / "fit_state.json").read_text())["answers"]
    assert planned["greedy"] + planned["sampled"] == 20 and not done["stopped_at_deadline"]  # the cap, all answered
    assert len(answers) == done["greedy"] + done["sampled"] >= 20 and feature_ids(out / "features") >= set(answers)
    pid = int(log.split("pid ", 1)[1].split()[0])
    with pytest.raises(ProcessLookupError):  # stopped when its part of the phase ended
        os.kill(pid, 0)


def test_a_stop_leaves_the_rows_not_yet_sent_and_a_rerun_asks_only_them(target, tmp_path, prompts):
    from medusa_heads.corpus import read_prompts
    from medusa_heads.training.remote import Server, distill_from_server

    base, tok = target
    rows = read_prompts(prompts / "train.jsonl")[:8]
    engine = FakeEngine(base, tok)
    out = tmp_path / "d.jsonl"
    try:
        first = distill_from_server(Server(engine.url), tok, rows, out, max_new_tokens=8, concurrency=1,
                                    stop=lambda counts: counts["written"] >= 3, progress=False)
        assert first["stopped"] and first["written"] in (3, 4) and engine.requests == first["written"]  # + 1 in flight
        again = distill_from_server(Server(engine.url), tok, rows, out, max_new_tokens=8, concurrency=2, progress=False)
    finally:
        engine.close()
    assert not again["stopped"] and again["written"] == 8 - first["written"] and engine.requests == 8
    assert sorted(c["id"] for c in read_conversations(out)) == sorted(r.id for r in rows)


def test_answers_stop_where_the_phase_has_no_time_left_and_all_get_features(target, tmp_path, prompts, monkeypatch):
    """A host so slow that the timed batch takes the whole budget: it alone is answered (the phase's end has
    passed), and its answers still get their features."""
    import medusa_heads.training.remote as remote
    from medusa_heads.training.fit import fit

    clock, real = Ticks(), remote.distill_from_server
    monkeypatch.setattr(remote, "distill_from_server", lambda *a, **k: clock.advance(300) or real(*a, **k))
    base, tok = target
    engine = FakeEngine(base, tok)
    out = tmp_path / "heads"
    try:
        fit(str(tmp_path / "model"), 300, out, prompts=[str(prompts / "train.jsonl")],
            bench_files=[str(prompts / "bench.jsonl")], bench_prompts=str(prompts / "bench.jsonl"), max_answers=40,
            stop_after="distill", log=lambda m: None, server=engine.url, now=clock)
    finally:
        engine.close()
    state = json.loads((out / "fit_state.json").read_text())
    done, answers = state["done"]["distill"], _answers(out)
    assert done["stopped_at_deadline"] and len(answers) == state["answers"]["timed_answers"] < 40
    assert engine.requests == 4 + len(answers) and done["sampled"] == 0
    assert feature_ids(out / "features") >= set(answers)


@pytest.mark.parametrize("argv,says", [
    (["--server", "http://127.0.0.1:9", "--engine", "vllm"],
     "--server and --engine both name where the answers come from: give one"),
    (["--server", "http://127.0.0.1:9"], "--server: http://127.0.0.1:9/v1/models: "),
    (["--engine", "vllm", "--vllm-python", "/nonexistent"], "--vllm-python /nonexistent: no such interpreter"),
    (["--engine", "vllm"], "--engine vllm: no vLLM here"),
    (["--server-model", "m"], "--server-model names the model served at --server: give --server URL too"),
    (["--vllm-args=--dtype float32"], "--vllm-args is for --engine vllm"),
    (["--concurrency", "4"], "--concurrency is the number of requests in flight to --server or --engine"),
    (["--server", "http://127.0.0.1:9"], "holds a fit whose answers come from this process (transformers' generate):"
                                         " rerun with neither --server nor --engine to continue it"),
])
def test_bad_answer_sources_are_one_line_before_loading(tmp_path, monkeypatch, argv, says):
    from medusa_heads.cli import main
    from medusa_heads.default_model import DEFAULT_MODEL

    monkeypatch.setattr("medusa_heads.loading.load_base", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.delenv("MEDUSA_HEADS_VLLM_PYTHON", raising=False)
    bench = Path("data/bench_prompts.jsonl").resolve()
    monkeypatch.chdir(tmp_path)  # no .venv-vllm here
    if "holds a fit" in says:  # an in-process fit planned, its distill not done
        (tmp_path / "o").mkdir()
        (tmp_path / "o" / "fit_state.json").write_text(json.dumps(
            {"model": DEFAULT_MODEL, "seed": 0, "budget_s": 360.0, "done": {}, "plan": {"per_token": 0.05}}))
    with pytest.raises(SystemExit) as e:
        main(["fit", "--budget", "6m", "--out", str(tmp_path / "o"), "--bench-prompts", str(bench), *argv])
    message = str(e.value.code)
    assert message.startswith("medusa-heads fit: ") and says in message and "\n" not in message, message
