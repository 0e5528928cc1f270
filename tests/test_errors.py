"""Every mistake gets one line, before the model loads where it can be found then, with the documented exit status;
nothing untrustworthy is stored silently; written files follow the umask; chat survives a line that is not UTF-8."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from medusa_heads import MedusaModel
from medusa_heads.cli import main

from conftest import tiny_model
from test_cli import ENTRY_POINT, run
from test_cli import files  # noqa: F401  (the fixture: prompt files, a tiny model directory without chat template)

EVAL_FRACTION = 0.05


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if anything loads a model or a tokenizer (training's own imports of the loaders too)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    for target in ("medusa_heads.loading.load_base", "medusa_heads.loading.load_tokenizer",
                   "medusa_heads.model.MedusaModel.from_pretrained", "medusa_heads.training.trainer.load_base",
                   "medusa_heads.training.trainer.load_tokenizer"):
        monkeypatch.setattr(target, refuse)


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> Path:
    """Heads (2 of them) for the tiny llama of seed 3, the base of test_cli's `files["model"]`."""
    out = tmp_path_factory.mktemp("heads") / "heads"
    MedusaModel.from_pretrained(tiny_model("llama", seed=3, bos_token_id=1, eos_token_id=1, pad_token_id=1), heads=None,
                                num_heads=2).save_pretrained(out)
    return out


def copy_heads(heads: Path, to: Path) -> Path:
    to.mkdir()
    for f in heads.iterdir():
        (to / f.name).write_bytes(f.read_bytes())
    return to


def conversations(ids: list[str]) -> list[dict]:
    return [{"id": i, "messages": [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4"}]}
            for i in ids]


def ids_on_one_side(n: int, held_out: bool) -> list[str]:
    """n prompt ids that all fall on one side of the evaluation split at EVAL_FRACTION."""
    from medusa_heads.corpus import is_eval

    return [f"c{i}" for i in range(10_000) if is_eval(f"c{i}", EVAL_FRACTION) == held_out][:n]


def one_line(code: int, err: str, cause: str, command: str) -> None:
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"medusa-heads {command}: ") and cause in err, err


# ---- before the model loads --------------------------------------------------------------------------------------

def test_a_truncated_heads_file_is_one_line_naming_it(heads, tmp_path, no_model, capsys):
    cut = copy_heads(heads, tmp_path / "cut")
    data = (cut / "heads.safetensors").read_bytes()
    for size in (len(data) // 2, 100, 4):  # in the tensors, in the header, before the header's length
        (cut / "heads.safetensors").write_bytes(data[:size])
        code, err = run(["generate", "--prompt", "hi", "--heads", str(cut)], capsys)
        one_line(code, err, f"--heads {cut / 'heads.safetensors'}: cut short (", "generate")
        assert "an interrupted download or copy: copy the file again" in err
    (cut / "heads.safetensors").write_bytes(data[: len(data) // 2])
    code, err = run(["calibrate", "--heads", str(cut), "--parts", "cost"], capsys)
    one_line(code, err, f"cut short ({len(data) // 2:,} of its {len(data):,} bytes)", "calibrate")


def test_heads_whose_config_disagrees_with_their_weights_say_both_numbers(heads, tmp_path, no_model, capsys):
    edited = copy_heads(heads, tmp_path / "edited")
    config = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**config, "num_heads": 7}))
    code, err = run(["demo", "--heads", str(edited)], capsys)
    one_line(code, err, f"--heads {edited}: config.json says 7 heads (num_heads), heads.safetensors holds 2 (", "demo")
    assert "set num_heads to 2, or copy both files again" in err
    (edited / "config.json").write_text(json.dumps({**config, "num_layers": 3}))
    code, err = run(["export", str(edited), str(tmp_path / "out")], capsys)
    one_line(code, err, "config.json says 3 blocks per head (num_layers), heads.safetensors holds 1", "export")
    (edited / "config.json").write_text(json.dumps({**config, "hidden_size": 16}))
    code, err = run(["calibrate", "--heads", str(edited), "--parts", "cost"], capsys)
    one_line(code, err, "heads.safetensors holds blocks.0.0.linear.weight of shape (32, 32), config.json implies (16, 16)",
             "calibrate")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_device_this_machine_lacks_is_one_line(no_model, capsys):
    code, err = run(["generate", "--prompt", "hi", "--device", "cuda"], capsys)
    if torch.version.cuda is None:
        one_line(code, err, f"--device cuda: this PyTorch ({torch.__version__}) is a CPU-only build; leave out --device "
                            "to run on the CPU", "generate")
    else:
        one_line(code, err, "--device cuda: no CUDA GPU is visible", "generate")
    code, err = run(["bench", "--prompts", "x.jsonl", "--device", "gpu0"], capsys)  # the prompts are checked first
    assert code == 1 and "x.jsonl: no such file" in err
    for command in (["chat"], ["demo"], ["calibrate", "--heads", str(Path(__file__).parents[1] / "medusa_heads" / "default_heads"),
                                          "--parts", "cost"]):
        code, err = run([*command, "--device", "cuda:x"], capsys)
        one_line(code, err, "--device cuda:x: not a device name; give cpu, cuda or cuda:N", command[0])


def test_a_prompt_that_is_not_utf8_is_one_line_before_anything_loads(files, no_model, capsys):  # noqa: F811
    code, err = run(["generate", "--prompt", "ab\udcffc"], capsys)  # how Python hands over the argv bytes ab\xffc
    one_line(code, err, "--prompt is not valid UTF-8 (byte 0xff at character 3); pass UTF-8 text", "generate")
    bad = files["prompts.jsonl"].parent / "latin1.jsonl"
    bad.write_bytes(json.dumps({"prompt": "w1"}).encode() + b"\n" + b'{"prompt": "caf\xe9"}\n')
    code, err = run(["bench", "--prompts", str(bad)], capsys)
    one_line(code, err, f"{bad}:2: not valid UTF-8 text; convert the file to UTF-8", "bench")


def test_a_misspelt_model_name_names_the_embedded_one_without_retries(no_model, capsys, monkeypatch):
    looks: list[float] = []  # counted, not timed: a loaded host must not decide this test
    monkeypatch.setattr("medusa_heads.default_model.hub_reachable", lambda timeout=3.0: looks.append(timeout) or False)
    code, err = run(["generate", "--prompt", "hi", "--model", "smollm2-135m-instrct"], capsys)
    one_line(code, err, "--model smollm2-135m-instrct: no such model; did you mean 'smollm2-135m-instruct'? "
                        "(the embedded models are 'smollm2-135m-instruct', 'gemma3-270m'", "generate")
    assert looks == []  # a typo of an embedded name: the hub is not asked
    code, err = run(["chat", "--model", "someone/some-model"], capsys)
    one_line(code, err, "--model someone/some-model: not a local directory nor an embedded name (the embedded models are "
                        "'smollm2-135m-instruct', 'gemma3-270m'), and the hub (", "chat")
    assert "cannot be reached from here, so it cannot be downloaded" in err
    assert looks == [3.0]  # one look with a short timeout, not the hub client's retries (~50 s)


def test_the_hub_is_not_asked_when_offline_is_set(monkeypatch):
    from medusa_heads.default_model import hub_reachable

    def no_network(*args, **kwargs):
        raise AssertionError("the network was tried")

    monkeypatch.setattr("socket.create_connection", no_network)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_reachable() is False


def test_sampling_settings_without_do_sample_are_refused(no_model, capsys):
    code, err = run(["generate", "--prompt", "hi", "--temperature", "0.5"], capsys)
    one_line(code, err, "--temperature sets sampling, but decoding is greedy without --do-sample; add --do-sample, or "
                        "leave out --temperature", "generate")
    code, err = run(["chat", "--temperature", "0.5", "--top-p", "0.5"], capsys)
    one_line(code, err, "--temperature and --top-p set sampling", "chat")


def test_train_with_too_few_conversations_for_a_split_is_one_line(tmp_path, no_model, capsys):
    data = tmp_path / "three.jsonl"
    ids = ids_on_one_side(3, held_out=False)
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations(ids)))
    code, err = run(["train", "--data", str(data), "--max-steps", "1", "--out", str(tmp_path / "out")], capsys)
    suggest = (min(zlib.crc32(i.encode()) % 10_000 for i in ids) + 1) / 10_000
    one_line(code, err, f"{data}: none of the 3 prompts falls in the evaluation split (eval_fraction 0.05, chosen by a "
                        f"hash of each id); pass --set eval_fraction={suggest:g} (it holds out 1 of them)", "train")
    from medusa_heads.corpus import check_eval_split

    check_eval_split(ids, suggest, "ok")  # the fix it names splits them
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations(["only"])))
    code, err = run(["train", "--data", str(data), "--out", str(tmp_path / "out")], capsys)
    one_line(code, err, "1 conversation(s) of one prompt cannot be split into training and evaluation", "train")


def test_the_default_data_is_read_from_its_gz_and_said_so(tmp_path, no_model, capsys, monkeypatch, heads):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    with gzip.open(tmp_path / "data" / "distilled.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(c) + "\n" for c in conversations(ids_on_one_side(3, held_out=False)))
    code, err = run(["train", "--max-steps", "1"], capsys)
    note, last = err.splitlines()
    assert note == ("medusa-heads: the recipe's data data/distilled.jsonl does not exist; reading "
                    "data/distilled.jsonl.gz beside it")
    assert code == 1 and last.startswith("medusa-heads train: data/distilled.jsonl.gz: none of the 3 prompts")
    config = json.loads((heads / "config.json").read_text())
    mine = copy_heads(heads, tmp_path / "heads")
    (mine / "config.json").write_text(json.dumps({**config, "extra": {"recipe": {"eval_fraction": EVAL_FRACTION}}}))
    code, err = run(["calibrate", "--heads", str(mine), "--parts", "lookup"], capsys)
    note, last = err.splitlines()
    assert note == "medusa-heads: --data data/distilled.jsonl does not exist; reading data/distilled.jsonl.gz beside it"
    assert code == 1 and "no held-out conversations (eval fraction 0.05) among the 3 given" in last
    code, err = run(["train", "--data", "data/other.jsonl"], capsys)  # no .gz beside it: the plain message
    one_line(code, err, "--data data/other.jsonl: no such file", "train")
    code, err = run(["calibrate", "--heads", str(mine), "--parts", "acceptance", "--features", "data/none"], capsys)
    assert code == 1 and err.splitlines()[-1] == (
        "medusa-heads calibrate: --features data/none: no such folder; the tree and acceptance parts read the held-out "
        "conversations' features: compute them with `medusa-heads features --data data/distilled.jsonl.gz --features "
        "data/none`")


def test_export_refuses_a_folder_with_files_before_loading(heads, tmp_path, no_model, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"")
    (out / "notes.txt").write_text("mine")
    code, err = run(["export", str(heads), str(out)], capsys)
    one_line(code, err, f"{out}: exists and holds files (model.safetensors, notes.txt); give a new or empty folder, or "
                        "pass --force to replace the heads there (only one layout is left)", "export")
    code, err = run(["export", str(heads), str(heads), "--force"], capsys)
    one_line(code, err, f"{heads}: is the heads directory being exported; give another folder", "export")
    code, err = run(["export", str(heads), str(out / "notes.txt")], capsys)
    one_line(code, err, "notes.txt: is a file; give a folder to export the heads to", "export")


def test_export_force_leaves_one_layout(files, heads, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "out"
    model = ["--model", str(files["model"])]
    assert run(["export", str(heads), str(out), "--format", "vllm", *model], capsys)[0] == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    (out / "notes.txt").write_text("kept")
    code, err = run(["export", str(heads), str(out), "--format", "medusa", *model], capsys)
    assert code == 1 and "exists and holds files" in err and sorted(p.name for p in out.iterdir()) == [
        "config.json", "model.safetensors", "notes.txt"]
    code, err = run(["export", str(heads), str(out), "--format", "medusa", "--force", *model], capsys)
    assert code == 0 and f"exported to {out} (replaced config.json, model.safetensors)" in err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "medusa_lm_head.safetensors", "notes.txt"]
    assert "medusa_num_heads" in json.loads((out / "config.json").read_text())


# ---- calibrate stores no timings it cannot trust -----------------------------------------------------------------

def _calibrate_cost(heads_dir: Path, monkeypatch, ms: tuple, load: float, force: bool = False):
    """calibrate's "cost" part on tiny heads, its timings replaced by `ms` (one context) at this load average."""
    from medusa_heads.calibration import Settings, calibrate
    from medusa_heads.tree.adaptive import CostModel

    sizes = tuple(range(1, len(ms) + 1))
    monkeypatch.setattr("medusa_heads.calibration.measure.measure_cost",
                        lambda *a, **k: CostModel((256,), sizes, (ms,), draft_ms=0.1, overhead_ms=3.0, fit="measured"))
    monkeypatch.setattr("os.getloadavg", lambda: (load, load, load))
    model = MedusaModel.from_pretrained(tiny_model("llama", seed=3, bos_token_id=1, eos_token_id=1, pad_token_id=1),
                                        heads=str(heads_dir), prepack=False)
    lines = []
    calibrate(model, None, heads_dir, ["cost"], [], "", Settings(contexts=(256,)), log=lines.append, force_cost=force)
    return lines


def test_calibrate_refuses_to_store_implausible_or_loaded_timings(heads, tmp_path, monkeypatch):
    from medusa_heads.calibration import UntrustedTimings, cpu_count

    mine = copy_heads(heads, tmp_path / "heads")
    before = (mine / "config.json").read_text()
    disturbed = (10.0, 11.0, 98.0, 12.0, 12.5)  # a 3-token verify at ~10x a plain step
    with pytest.raises(UntrustedTimings, match=r"timings not stored \(cost\): a 3-token verify took 9.8x a plain step "
                                               r"at 256 cached tokens \(98.0 vs 10.0 ms; at most 3x is plausible\); rerun "
                                               "on an idle machine, or pass --force-cost to store them anyway"):
        _calibrate_cost(mine, monkeypatch, disturbed, load=0.0)
    assert (mine / "config.json").read_text() == before  # nothing stored
    fine = (10.0, 10.5, 11.0, 11.5, 12.0)
    busy = cpu_count() + 2.0
    with pytest.raises(UntrustedTimings, match=rf"the load average was {busy:.1f} -> {busy:.1f} on {cpu_count()} cores "
                                               r"while \d+ threads were timed \(other work was running\)"):
        _calibrate_cost(mine, monkeypatch, fine, load=busy)
    assert (mine / "config.json").read_text() == before
    _calibrate_cost(mine, monkeypatch, fine, load=0.0)  # an idle machine, plausible timings: stored
    stored = json.loads((mine / "config.json").read_text())
    (key,) = stored["adaptive"]["cost"]
    assert stored["adaptive"]["cost"][key]["ms"] == [list(fine)]
    _calibrate_cost(mine, monkeypatch, disturbed, load=0.0, force=True)  # --force-cost: stored, the reason beside it
    stored = json.loads((mine / "config.json").read_text())
    assert stored["adaptive"]["cost"][key]["ms"] == [list(disturbed)]
    assert "9.8x a plain step" in stored["extra"]["adaptive_calibration"]["cost"][key]["untrusted timings"]


def test_calibrate_says_so_in_one_line_with_status_1(files, heads, tmp_path, monkeypatch, capsys):  # noqa: F811
    from medusa_heads.calibration import cpu_count
    from medusa_heads.tree.adaptive import CostModel

    mine = copy_heads(heads, tmp_path / "heads")
    before = (mine / "config.json").read_text()
    monkeypatch.setattr("medusa_heads.calibration.measure.measure_cost",
                        lambda *a, **k: CostModel((256,), (1, 2, 3), ((10.0, 10.0, 10.0),), fit="measured"))
    busy = cpu_count() + 1.5
    monkeypatch.setattr("os.getloadavg", lambda: (busy, busy, busy))
    code, err = run(["calibrate", "--heads", str(mine), "--model", str(files["model"]), "--parts", "cost",
                     "--no-prepack", "--threads", "1"], capsys)
    lines = err.splitlines()
    assert lines[0] == (f"medusa-heads: the load average is {busy:.1f} on {cpu_count()} cores: other work is running, and "
                        "timings (cost) taken now will not be stored unless the load falls (--force-cost stores them "
                        "anyway)")
    assert code == 1 and lines[-1].startswith("medusa-heads calibrate: timings not stored (cost): the load average was ")
    assert (mine / "config.json").read_text() == before


def test_calibrate_parts_and_batch_rows_are_measures(capsys):
    from medusa_heads.calibration import BATCH_ROWS, PARTS, Settings, measure
    from medusa_heads.cli import list_presets
    from medusa_heads.tree import list_presets as presets

    assert PARTS == measure.PARTS and BATCH_ROWS == measure.BATCH_ROWS and Settings().batch_rows == measure.BATCH_ROWS
    assert list_presets() == presets()


# ---- chat goes on after a bad line --------------------------------------------------------------------------------

def test_chat_survives_a_line_that_is_not_utf8(files, capsys, monkeypatch):  # noqa: F811
    def typed(prompt=""):
        line = next(lines)
        if line == "w1 w2" and not hasattr(typed, "raised"):  # a stdin that is strict: the decoder raises once
            typed.raised = True
            raise UnicodeDecodeError("utf-8", b"\xe9", 0, 1, "invalid continuation byte")
        return line

    monkeypatch.setattr("builtins.input", typed)
    lines = iter(["w1 \udcff w2", "w1 w2", "w1 w2", ""])  # a line with the byte 0xff, one the decoder refuses, a good one
    code, err = run(["chat", "--model", str(files["model"]), "--no-prepack", "--max-new-tokens", "3"], capsys)
    assert code == 0 and "Traceback" not in err
    assert ("medusa-heads: chat: that line is not valid UTF-8 (byte 0xff at character 4); it was skipped: type it "
            "again") in err
    assert "medusa-heads: chat: that line is not valid UTF-8 (byte 0xe9); it was skipped: type it again" in err
    assert err.count("tokens/s, tau") == 1  # the good line was answered, and the empty one ended the chat


# ---- files others can read -----------------------------------------------------------------------------------------

def test_written_files_are_readable_by_others_under_umask_022(tmp_path, monkeypatch):
    import medusa_heads.checkpoint as checkpoint
    from medusa_heads.shards import Segment, write_shard
    from medusa_heads.training.loop import save_checkpoint
    from medusa_heads.training.recipe import TrainRecipe

    monkeypatch.setattr(checkpoint, "_UMASK", 0o022)
    old = os.umask(0o022)
    try:
        write_shard(tmp_path / "shard-00000.safetensors", [Segment("a#0", torch.zeros(3, 4), torch.arange(3))])
        heads = torch.nn.Linear(2, 2)
        optimizer = torch.optim.AdamW(heads.parameters())
        heads(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        save_checkpoint(tmp_path / "checkpoint", lambda folder: None, optimizer, scheduler, 1, TrainRecipe())
        # a cache converted before: a 0700 folder, model.safetensors 0600 (mkdtemp's and safetensors' modes)
        cache = tmp_path / "cache" / "smollm2-135m-instruct"
        cache.mkdir(parents=True)
        for name in ("model.safetensors", "tokenizer.json"):
            (cache / name).write_text("x")
            os.chmod(cache / name, 0o600)
        os.chmod(cache, 0o700)
        monkeypatch.setenv("MEDUSA_HEADS_CACHE", str(tmp_path / "cache"))
        from medusa_heads.default_model import default_model_path

        assert default_model_path() == cache
    finally:
        os.umask(old)
    assert (tmp_path / "shard-00000.safetensors").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "checkpoint").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "checkpoint" / "optimizer.safetensors").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "checkpoint" / "trainer_state.json").stat().st_mode & 0o777 == 0o644
    assert cache.stat().st_mode & 0o777 == 0o755 and (cache / "model.safetensors").stat().st_mode & 0o777 == 0o644


# ---- help, demo, bench -------------------------------------------------------------------------------------------------

def test_help_prints_without_torch_and_lists_the_exit_codes():
    code = ("import sys; from medusa_heads.cli import build_parser; build_parser().format_help(); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "[]", done.stderr
    done = subprocess.run([ENTRY_POINT, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0  # quick because torch is not imported (above), not timed: a loaded host is slow
    epilog = done.stdout.split("exit status:", 1)[1]
    for code in ("0    done", "1    a mistake found by a check", "2    a bad argument", "130  interrupted"):
        assert f"\n  {code}" in epilog
    assert "exit status: 0 done, 1 a mistake (one line), 2 a bad argument, 130 interrupted" in subprocess.run(
        [ENTRY_POINT, "export", "--help"], capture_output=True, text=True, timeout=60).stdout.replace("\n", " ")


def test_demo_says_what_it_does_first_and_puts_the_baseline_first(files, capsys):  # noqa: F811
    main(["demo", "--model", str(files["model"]), "--no-prepack", "--max-new-tokens", "4", "--threads", "1"])
    captured = capsys.readouterr()
    out = captured.out.splitlines()
    assert out[1].startswith("demo: 3 prompts x 2 methods (transformers; medusa-heads) x up to 4 new tokens, greedy, "
                             "1 threads: about ") and out[1].endswith(" here (fewer --max-new-tokens is quicker)")
    table = out[out.index(next(line for line in out if line.startswith("method"))):]
    assert table[1].startswith("transformers (baseline)") and table[1].split()[-2:] == ["1.00", "1.00"]
    assert table[2].startswith("medusa-heads")
    assert table[3] == ("tau: tokens each forward of the model yields (plain generate: 1; medusa: the drafted tokens "
                        "it accepts + 1); speed-up: against the baseline row")
    assert "demo: 100%" in captured.err.replace("\r", "\n")  # the progress bar, on stderr


def test_bench_names_prompts_by_their_place_not_their_id(tmp_path):
    from medusa_heads.bench import prompt_name, write_results
    from medusa_heads.corpus import PromptRow

    rows = [PromptRow("train_prompts:12104", ["Can you give me examples of strange laws in the US?"], category="chat"),
            PromptRow("train_prompts:7", ["a", "b"], category="multi")]
    assert [prompt_name(0, rows[0], 1), prompt_name(1, rows[1], 2)] == ["prompt 1", "prompt 2, turn 2"]
    stats = lambda s: {"tokens_per_s": s, "mean_accepted": 2.0, "speedup_vs_hf": s, "mismatches_vs_hf": 0,  # noqa: E731
                       "peak_memory_mb": 1}
    result = {"overall": {"hf": stats(1.0), "medusa": stats(2.0)}, "by_category": {"chat": {"hf": stats(1.0), "medusa": stats(2.0)}},
              "by_prompt": {"prompt 1": {"hf": 1.0, "medusa": 0.9}, "prompt 2, turn 2": {"hf": 1.0, "medusa": 2.0}},
              "prompts": {"prompt 1": {"id": rows[0].id, "category": "chat", "text": rows[0].turns[0]}},
              "settings": {"model": "m", "max_new_tokens": 8, "sampling": None, "tree": "fixed", "prompts": 2,
                           "dtype": "torch.float32", "device": "cpu", "threads": 2}}
    write_results(result, tmp_path, ["hf", "medusa"])
    table = (tmp_path / "results.md").read_text()
    assert ('Slowest single prompt for `medusa`: prompt 1 (chat, "Can you give me examples of strange laws in the US?"): '
            "0.90x.") in table and "train_prompts" not in table
    assert (tmp_path / "speedup.png").stat().st_size > 1000


def test_distill_and_features_refuse_a_features_path_that_is_a_file(tmp_path, no_model, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "turns": ["hi"]}\n')
    shards = tmp_path / "shards"
    shards.write_text("not a folder")
    code, err = run(["distill", "--prompts", str(prompts), "--out", str(tmp_path / "d.jsonl"), "--features", str(shards)],
                    capsys)
    one_line(code, err, f"--features {shards}: is a file; give the folder to keep feature shards in", "distill")
