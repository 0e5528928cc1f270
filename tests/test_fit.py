"""`medusa-heads fit` end to end on tiny random models: heads that load by default, lossless, a report, resumable.
fit runs on a clock that advances by counts (tests/fit_clock.py), so the counts it buys are the same on any host."""
import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import tiny_model
from fit_clock import TICKING_CLI, Ticks, tick_fit
from medusa_heads.model import MedusaModel
from medusa_heads.training.fit import Clock, choose_recipe, fit, parse_budget, plan_text, training_prompts

WORDS = [f"w{i}" for i in range(94)]


def _tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer without a chat template over the model's first 96 ids (the rest: unused). (transformers
    loads a Qwen2 model's folder with Qwen2's own tokenizer class, so the tests take no qwen2 model.)"""
    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>")


def write_prompts(root, seed: int, n: int):
    """n random six-word prompts in root/train.jsonl, the first two also in root/bench.jsonl (decontaminated away)."""
    g = torch.Generator().manual_seed(seed)
    lines = [json.dumps({"id": f"p{i}", "prompt": " ".join(WORDS[j] for j in torch.randint(0, 94, (6,), generator=g))})
             for i in range(n)]
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    (root / "bench.jsonl").write_text("\n".join(lines[:2]) + "\n")
    return root


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("fit-prompts"), seed=0, n=400)


def _model(folder, arch: str, chat: bool = False, **kw):
    """A tiny model saved with a word-level tokenizer without a chat template, or (chat) the default model's."""
    if chat:
        from transformers import AutoTokenizer

        from medusa_heads import default_model_path

        tok = AutoTokenizer.from_pretrained(default_model_path())
        kw = {"vocab_size": len(tok), "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
              "pad_token_id": tok.eos_token_id, **kw}
    else:
        tok = _tokenizer()
        kw = {"bos_token_id": 1, "eos_token_id": 1, "pad_token_id": 1, **kw}
    base = tiny_model(arch, seed=3, **kw)
    base.save_pretrained(folder)
    tok.save_pretrained(folder)
    return base


def _fit(model_dir, out, folder, **kw):
    kw = {"prompts": [str(folder / "train.jsonl")], "now": Ticks(), **kw}
    return fit(str(model_dir), 120, out, bench_files=[str(folder / "bench.jsonl")],
               bench_prompts=str(folder / "bench.jsonl"), max_answers=24, max_steps=8, log=lambda m: None, **kw)


def test_budget_and_rules():
    assert parse_budget("6m") == 360 and parse_budget("2h") == 7200 and parse_budget("1h30m") == 5400
    for bad in ("", "6", "2x", "0m"):
        with pytest.raises(ValueError, match="--budget"):
            parse_budget(bad)
    assert choose_recipe(576, 49152, 3600)["recipe"]["mlp_size"] == 1536  # the shipped heads' shape
    assert choose_recipe(4096, 152064, 3600)["recipe"]["draft_vocab_size"] == 4096


def test_prompts_decontaminated(prompts):
    rows = training_prompts([str(prompts / "train.jsonl")], [str(prompts / "bench.jsonl")], seed=0)
    assert len(rows) == 398 and not {"p0", "p1"} & {r.id for r in rows}


@pytest.mark.parametrize("arch,kw", [
    ("llama", {}),  # GQA, untied LM head
    ("phi3", {"tie_word_embeddings": True}),
    ("mistral", {"num_key_value_heads": 4}),  # no GQA
    ("qwen3", {"vocab_size": 150_016, "tie_word_embeddings": True}),  # a large vocabulary
    ("gemma2", {"chat": True}),  # a chat template: the repository's prompts and some it writes itself
])
def test_fit_end_to_end(tmp_path, prompts, arch, kw):
    base = _model(tmp_path / "model", arch, **kw)
    report = _fit(tmp_path / "model", tmp_path / "heads", prompts, **({"prompts": None} if kw.get("chat") else {}))
    state = json.loads((tmp_path / "heads" / "fit_state.json").read_text())
    answers = state["answers"]
    assert (answers["self_prompts"] > 0) == bool(kw.get("chat"))
    # what the clock bought is the cap, all of it written in time (with the held-out rows take() adds to each part);
    # for a chat model, the prompts it writes cost 6 answers, and the timed batch (20 rows) is then the most
    if kw.get("chat"):
        assert (answers["greedy"], answers["sampled"]) == (20, 0) and report["answers"]["greedy"] >= 20
    else:
        assert (answers["greedy"], answers["sampled"]) == (17, 7) and report["answers"] == {"greedy": 18, "sampled": 10}
    assert not state["done"]["distill"]["stopped_at_deadline"] and state["steps"]["max_steps"] == 8
    assert (tmp_path / "heads" / "self_prompts.jsonl.gz").is_file() == bool(kw.get("chat"))
    for key in ("answers", "train_tokens", "steps", "held_out_top1", "bench", "phases_s", "spent_s"):
        assert key in report
    assert report["bench"]["differ"] == 0 and report["steps"] == 8 and report["bench"]["pld_speedup"] > 0
    assert "prompt lookup" in (tmp_path / "heads" / "report.md").read_text().splitlines()[2]
    assert (tmp_path / "heads" / "report.md").is_file()
    model = MedusaModel.from_pretrained(base, heads=str(tmp_path / "heads"))
    ids = torch.tensor([[2, 5, 9, 14]])
    ref = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=24), ref)
    before = (tmp_path / "heads" / "fit_state.json").read_text()
    _fit(tmp_path / "model", tmp_path / "heads", prompts, prompts=None)  # done: no work
    assert (tmp_path / "heads" / "fit_state.json").read_text() == before
    with pytest.raises(ValueError, match="started with --seed 0: rerun with that"):
        _fit(tmp_path / "model", tmp_path / "heads", prompts, seed=1)


@pytest.mark.slow
def test_kill_9_in_each_phase_then_rerun_gives_the_same_heads(tmp_path, prompts):
    """The command line, killed with SIGKILL inside each phase in turn (after distill's first batch, train's first
    checkpoint, calibrate's files, the bench), rerun each time: the heads and answers of one run that was not. On a
    clock that advances by counts: the killed runs' time is charged to the budget, and on wall time a slow host
    would size the reruns' phases from what little was left."""
    import os
    import signal
    import subprocess
    import sys

    _model(tmp_path / "model", "llama")
    argv = [sys.executable, "-c", TICKING_CLI, "fit", "--model", str(tmp_path / "model"), "--budget", "5m",
            "--prompts", str(prompts / "train.jsonl"), "--bench-prompts", str(prompts / "bench.jsonl"),
            "--max-answers", "24", "--max-steps", "8", "--threads", "1"]

    def run(out, kill_at=None):
        env = {**os.environ, "MEDUSA_HEADS_KILL_AT": kill_at or ""}
        done = subprocess.run(argv + ["--out", str(out)], env=env, capture_output=True, text=True)
        assert done.returncode == (-signal.SIGKILL if kill_at else 0), done.stderr[-2000:]
        return done.returncode

    assert run(tmp_path / "whole") == 0
    whole = json.loads((tmp_path / "whole" / "fit_state.json").read_text())
    assert whole["answers"]["greedy"] + whole["answers"]["sampled"] == 24 and whole["steps"]["max_steps"] == 8
    for phase in ("distill", "train", "calibrate", "bench"):
        assert run(tmp_path / "killed", phase) == -signal.SIGKILL, phase
        state = json.loads((tmp_path / "killed" / "fit_state.json").read_text())
        assert phase not in state["done"], phase  # killed inside it
    assert run(tmp_path / "killed") == 0
    killed = json.loads((tmp_path / "killed" / "fit_state.json").read_text())
    assert all(killed["answers"][k] == whole["answers"][k] for k in ("greedy", "sampled", "timed"))
    assert json.loads((tmp_path / "killed" / "report.json").read_text())["steps"] == 8
    for name in ("heads.safetensors", "distilled.jsonl", "distilled_t07.jsonl"):
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "killed" / name).read_bytes(), name
    assert json.loads((tmp_path / "killed" / "report.json").read_text())["bench"]["differ"] == 0


def test_train_deadline_stops_at_the_step_it_is_on(tmp_path, prompts):
    """A deadline already passed: one step, evaluated and saved as the last; the heads load."""
    import time

    from medusa_heads.training.recipe import TrainRecipe
    from medusa_heads.training.trainer import train

    base = _model(tmp_path / "model", "llama")
    fit(str(tmp_path / "model"), 120, tmp_path / "d", prompts=[str(prompts / "train.jsonl")],
        bench_files=[str(prompts / "bench.jsonl")], bench_prompts=str(prompts / "bench.jsonl"), max_answers=24,
        stop_after="distill", log=lambda m: None, now=Ticks())
    recipe = TrainRecipe(model=str(tmp_path / "model"), data=str(tmp_path / "d" / "distilled.jsonl"),
                         features=str(tmp_path / "d" / "features"), out=str(tmp_path / "h"), max_steps=50,
                         eval_every=10, save_every=10, num_heads=2, batch_size=64)
    train(recipe, deadline=time.time() - 1)
    log = [json.loads(line) for line in (tmp_path / "h" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r["kind"] == "eval"] == [1]
    MedusaModel.from_pretrained(base, heads=str(tmp_path / "h"))


@pytest.mark.parametrize("argv,says", [
    (["--budget", "2x"], "--budget takes a duration"),
    (["--budget", "6m", "--out", __file__], "is a file"),
    (["--budget", "6m", "--bench-prompts", "nope.jsonl"], "--bench-prompts nope.jsonl: no such file"),
])
def test_cli_refuses_before_loading(monkeypatch, capsys, argv, says):
    from medusa_heads.cli import main

    monkeypatch.setattr("medusa_heads.loading.load_base", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as e:
        main(["fit", *argv])
    assert e.value.code != 0 and says in str(e.value.code)


def test_plan_says_up_front_when_the_fixed_phases_overrun_the_budget():
    """A target too slow for the budget (another job on the machine, a bigger model) is said before the long work."""
    state = {"plan": {"per_token": 0.9, "calibrate_s": 1650.0, "bench_s": 211.0, "distill_by": 55.0}, "done": {}}
    text = plan_text(state, Clock(360.0, 30.0))
    assert "budget will be overrun by at least 25.5 min" in text and "larger --budget" in text
    fits = {"plan": {"per_token": 0.04, "calibrate_s": 72.0, "bench_s": 100.0, "distill_by": 150.0}, "done": {}}
    assert "overrun" not in plan_text(fits, Clock(360.0, 10.0))


def test_a_budget_that_cannot_hold_the_phases_is_refused_before_any_phase(tmp_path, prompts, monkeypatch):
    """A target that generates 20 tokens/s (on the test's clock, whatever the host): --budget 20s is one line naming
    the smallest budget that holds the phases (calibrate alone is 1,800 tokens, 1.5 min), nothing is written and
    no phase starts; a minute less than the one named is refused too, the one named is not."""
    import medusa_heads.loading as loading
    import medusa_heads.training.fit as fit_module
    from medusa_heads.cli import main

    _model(tmp_path / "model", "llama")
    clock, real_load = tick_fit(monkeypatch), loading.load_base

    def slow_target(*args, **kwargs):
        base = real_load(*args, **kwargs)
        generate = base.generate
        base.generate = lambda *a, **k: clock.advance(0.05 * k["max_new_tokens"]) or generate(*a, **k)
        return base

    class Distilling(BaseException):
        pass

    def distill(*args, **kwargs):
        raise Distilling

    monkeypatch.setattr(loading, "load_base", slow_target)
    monkeypatch.setattr(fit_module, "_distill", distill)

    def fit_for(budget: str) -> str:
        out = tmp_path / f"heads-{budget}"
        argv = ["fit", "--model", str(tmp_path / "model"), "--budget", budget, "--out", str(out), "--prompts",
                str(prompts / "train.jsonl"), "--bench-prompts", str(prompts / "bench.jsonl")]
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert not (out / "fit_state.json").exists()  # nothing written
        return str(e.value.code)

    for budget in ("20s", "2m"):
        message = fit_for(budget)
        assert message.startswith(f"medusa-heads fit: --budget {budget} cannot hold the phases here: the target "
                                  "generates 20.0 tokens/s, so what is spent (2 s: starting, loading, timing it), ")
        assert message.endswith("need at least 2.9 min; give --budget 3m or more") and "\n" not in message, message
    with pytest.raises(Distilling):  # planned, then distill starts
        fit_for("3m")
    plan = json.loads((tmp_path / "heads-3m" / "fit_state.json").read_text())["plan"]
    assert plan["per_token"] == pytest.approx(0.05, abs=1e-4) and plan["calibrate_s"] == pytest.approx(90, abs=0.2)


def test_a_failure_inside_each_phase_is_one_line_and_the_rerun_reuses_the_work_before_it(tmp_path, prompts,
                                                                                          monkeypatch, capsys):
    """A sliding-window model (a window of 16 tokens, which calibrate's contexts cross), the command line run in
    process on a clock of counts; an error raised inside each phase in turn (medusa_heads/faults.py: after distill's
    first batch of answers, train's first checkpoint, calibrate's files, the bench), each run
    continuing the last: one line on stderr naming the phase and the cause, no traceback; the work before the failure
    is on disk and the rerun takes it up (no answer asked twice, training from its checkpoint);
    heads that failed in calibrate load and decode losslessly with their fixed tree; and the end is byte for byte the
    heads and answers of a run that never failed."""
    from medusa_heads.cli import main

    base = _model(tmp_path / "model", "gemma2", sliding_window=16)
    tick_fit(monkeypatch)
    ids = torch.tensor([[2, 5, 9, 14] * 6])  # 24 tokens: past the window
    ref = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)

    def argv(out):
        return ["fit", "--model", str(tmp_path / "model"), "--budget", "5m", "--out", str(out), "--prompts",
                str(prompts / "train.jsonl"), "--bench-prompts", str(prompts / "bench.jsonl"), "--max-answers", "24",
                "--max-steps", "8", "--threads", "1"]

    main(argv(tmp_path / "whole"))
    out = tmp_path / "failed"
    # (the features of answers from a server are computed in a pass of their own, and a failure there is
    # test_fit_remote's; here they are kept as the answers are generated)
    for point in ("distill", "train", "calibrate", "bench"):
        phase = point
        monkeypatch.setenv("MEDUSA_HEADS_FAIL_AT", point)
        capsys.readouterr()
        with pytest.raises(SystemExit) as err:
            main(argv(out))
        message, printed = str(err.value.code), capsys.readouterr().err
        assert message.startswith(f"medusa-heads fit: {phase} failed (InjectedFailure: a failure injected at {point} "
                                  "(MEDUSA_HEADS_FAIL_AT)); ") and "\n" not in message, message
        assert "rerun the same command" in message and "Traceback" not in printed, printed[-2000:]
        state = json.loads((out / "fit_state.json").read_text())
        assert state["failed"]["phase"] == phase and phase not in state["done"]
        written = {"distill": lambda: 0 < len((out / "distilled.jsonl").read_text().splitlines()) < 24,
                   "train": lambda: (out / "checkpoint").is_dir(),
                   "calibrate": lambda: "adaptive" in json.loads((out / "config.json").read_text()),
                   "bench": lambda: (out / "heads.safetensors").is_file()}[point]
        assert written(), point  # the work done before the failure is on disk
        if phase in ("calibrate", "bench"):
            model = MedusaModel.from_pretrained(base, heads=str(out))
            assert torch.equal(model.generate(ids, max_new_tokens=24), ref)
    monkeypatch.delenv("MEDUSA_HEADS_FAIL_AT")
    main(argv(out))
    state = json.loads((out / "fit_state.json").read_text())
    assert "failed" not in state and json.loads((out / "report.json").read_text())["bench"]["differ"] == 0
    whole = json.loads((tmp_path / "whole" / "fit_state.json").read_text())
    assert all(state["answers"][k] == whole["answers"][k] for k in ("greedy", "sampled", "timed"))
    for name in ("heads.safetensors", "distilled.jsonl", "distilled_t07.jsonl"):
        assert (tmp_path / "whole" / name).read_bytes() == (out / name).read_bytes(), name
