"""The command line guides: a mistake is one line on stderr naming the cause, a non-zero status and no traceback,
found before any model loads; --debug shows the traceback; Ctrl-C ends quietly."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from medusa_heads import MedusaModel
from medusa_heads.cli import main

from conftest import tiny_model

ENTRY_POINT = str(Path(sys.executable).parent / "medusa-heads")
WORDS = [f"w{i}" for i in range(94)]  # with <unk> and <eos>: the tiny model's 96 tokens


def run(argv: list[str], capsys) -> tuple[int, str]:
    """main(argv) in this process: (exit status, stderr), as the interpreter would end it."""
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = 1 if isinstance(e.code, str) else (e.code or 0)
    return code, capsys.readouterr().err


def entry_point(argv: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([ENTRY_POINT, *argv], capture_output=True, text=True, timeout=120, env=env, cwd=cwd)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Prompt files (good, empty, malformed), heads directories (empty, for another base) and a tiny model directory
    whose tokenizer has no chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("cli")
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "w1 w2 w3"}) + "\n" + json.dumps({"prompt": "w4 w5"}) + "\n")
    (root / "empty.jsonl").write_text("")
    (root / "bad.jsonl").write_text(json.dumps({"prompt": "w1"}) + "\n{not json\n")
    (root / "no-heads").mkdir()
    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>")
    tiny_model("llama", seed=3, bos_token_id=1, eos_token_id=1, pad_token_id=1).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    MedusaModel.from_pretrained(tiny_model("llama", seed=4), heads=None, num_heads=2).save_pretrained(root / "other-heads")
    return {p.name: p for p in root.iterdir()}


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if anything loads a model or a tokenizer."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr("medusa_heads.loading.load_base", refuse)
    monkeypatch.setattr("medusa_heads.loading.load_tokenizer", refuse)
    monkeypatch.setattr("medusa_heads.model.MedusaModel.from_pretrained", refuse)


# (argv with {placeholders} for the fixture's files, what the one line must say)
MISTAKES = {
    "distill, missing prompts": (["distill", "--prompts", "{dir}/nope.jsonl", "--out", "{dir}/d.jsonl"], "nope.jsonl: no such file"),
    "bench, missing prompts": (["bench", "--prompts", "{dir}/nope.jsonl"], "nope.jsonl: no such file"),
    "malformed line": (["bench", "--prompts", "{bad.jsonl}"], "bad.jsonl:2: not valid JSON"),
    "bench, empty prompts": (["bench", "--prompts", "{empty.jsonl}"], "no prompts in it"),
    "distill, empty prompts": (["distill", "--prompts", "{empty.jsonl}", "--out", "{dir}/d.jsonl"], "no prompts in it"),
    "unknown tree": (["generate", "--prompt", "hi", "--tree", "cpu-7"], "invalid choice: 'cpu-7' (choose from 'chain-4'"),
    "unknown preset": (["bench", "--prompts", "{prompts.jsonl}", "--preset", "big"], "argument --preset: invalid choice"),
    "no new tokens": (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens: must be positive, got 0"),
    "negative new tokens": (["chat", "--max-new-tokens", "-5"], "--max-new-tokens: must be positive, got -5"),
    "negative limit": (["distill", "--prompts", "{prompts.jsonl}", "--out", "{dir}/d.jsonl", "--limit", "-1"],
                       "--limit: must be positive, got -1"),
    "zero limit": (["bench", "--prompts", "{prompts.jsonl}", "--limit", "0"], "--limit: must be positive, got 0"),
    "unknown method": (["bench", "--prompts", "{prompts.jsonl}", "--methods", "hf,medusaa"],
                       "unknown bench method 'medusaa'; methods: hf, hf-stock, pld, medusa"),
    "lookup on hf": (["bench", "--prompts", "{prompts.jsonl}", "--methods", "hf+pld3"], "unknown bench method 'hf+pld3'"),
    "missing heads": (["generate", "--prompt", "hi", "--heads", "{dir}/nope"], "nope: no such directory; train heads with `medusa-heads train"),
    "empty heads": (["demo", "--heads", "{no-heads}"], "holds no heads"),
    "empty heads, export": (["export", "{no-heads}", "{dir}/out"], "holds no heads"),
    "missing model": (["generate", "--prompt", "hi", "--model", "{dir}/no-model"], "no-model: no such directory"),
    "model without config": (["chat", "--model", "{no-heads}"], "holds no config.json"),
    "too few prompts for a batch": (["bench", "--prompts", "{prompts.jsonl}", "--batch-sizes", "1,4"], "needs at least 4 prompts"),
    "temperature": (["generate", "--prompt", "hi", "--do-sample", "--temperature", "0"], "--temperature: must be > 0.0"),
}


def _argv(argv: list[str], files: dict[str, Path]) -> list[str]:
    names = {"dir": files["prompts.jsonl"].parent, **files}
    for key, path in names.items():
        argv = [a.replace(f"{{{key}}}", str(path)) for a in argv]
    return argv


@pytest.mark.parametrize("case", list(MISTAKES))
def test_a_mistake_is_one_line_before_any_model_loads(case, files, no_model, capsys):
    argv, cause = MISTAKES[case]
    code, err = run(_argv(argv, files), capsys)
    assert code != 0 and err.count("\n") == 1 and cause in err and "Traceback" not in err, err
    assert err.startswith(f"medusa-heads {argv[0]}: ")


def test_the_installed_command_says_one_line_and_debug_shows_the_traceback(files):
    cases = ["unknown method", "zero limit"]  # a check of ours, an argparse check (each start imports torch: ~5 s)
    argvs = [_argv(MISTAKES[c][0], files) for c in cases] + [["--debug", *_argv(MISTAKES["malformed line"][0], files)]]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(entry_point, argvs))
    for case, res in zip(cases, results):
        assert res.returncode != 0 and res.stderr.count("\n") == 1 and MISTAKES[case][1] in res.stderr, (case, res.stderr)
        assert "Traceback" not in res.stderr
    debug = results[-1]
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "ValueError: " in debug.stderr


def test_debug_after_the_command_shows_the_traceback_of_a_check(files, no_model, capsys):
    code, err = run(["bench", "--debug", *_argv(MISTAKES["bench, empty prompts"][0], files)[1:]], capsys)
    assert code != 0 and "Traceback" in err and "no prompts in it" in err


def test_heads_for_another_base_are_refused_unless_allowed(files, capsys):
    model, heads = str(files["model"]), str(files["other-heads"])
    argv = ["generate", "--prompt", "w1 w2", "--model", model, "--heads", heads, "--max-new-tokens", "4", "--no-prepack"]
    code, err = run(argv, capsys)
    last = err.splitlines()[-1]  # after transformers' loading progress bar
    assert code != 0 and last.startswith("medusa-heads generate: these heads were trained for another base model")
    assert "--allow-base-mismatch" in last and "Traceback" not in err
    assert err.count("no chat template") == 1  # said once, before the model loads
    code, err = run([*argv, "--allow-base-mismatch"], capsys)
    assert code == 0 and "tokens/s, tau" in err and f"untrained heads: {heads} holds" in err


def test_a_model_without_heads_or_chat_template_is_announced_once(files, capsys, tmp_path):
    model = str(files["model"])
    code, err = run(["generate", "--prompt", "w1 w2", "--model", model, "--max-new-tokens", "4", "--do-sample",
                     "--seed", "1"], capsys)
    assert code == 0 and err.count("no chat template: prompts are plain text") == 1
    assert f"untrained heads: no shipped heads fit {model}" in err and "tau will be near 1.0" in err
    assert "`medusa-heads train`" in err
    out = tmp_path / "bench"
    code, err = run(["bench", "--prompts", str(files["prompts.jsonl"]), "--model", model, "--max-new-tokens", "4",
                     "--long-tokens", "0", "--methods", "medusa,medusa+pld0", "--out", str(out), "--no-prepack"], capsys)
    assert code == 0 and err.count("no chat template") == 1 and f"results written to {out}" in err
    table = (out / "results.md").read_text()
    assert table.startswith(f"# Benchmark: {model}: 4 new tokens, greedy, tree fixed") and "{" not in table.splitlines()[0]
    assert "| medusa+pld0 (heads only) |" in table
    code, err = run(["distill", "--prompts", str(files["prompts.jsonl"]), "--model", model, "--out",
                     str(tmp_path / "d.jsonl"), "--max-new-tokens", "4", "--no-prepack"], capsys)
    assert code == 0 and err.count("no chat template") == 1 and len((tmp_path / "d.jsonl").read_text().splitlines()) == 2


def test_a_greedy_variant_answers_follow_up_turns_after_the_targets_own_first_answer(files, capsys, tmp_path):
    model = str(files["model"])
    prompts = ["w1 w2 w3", "w4 w5"]
    single, multi = tmp_path / "single.jsonl", tmp_path / "multi.jsonl"
    single.write_text("".join(json.dumps({"id": f"p{i}", "prompt": q}) + "\n" for i, q in enumerate(prompts)))
    multi.write_text("".join(json.dumps({"id": f"p{i}", "turns": [q, "w9 w8"]}) + "\n" for i, q in enumerate(prompts)))
    common = ["--model", model, "--max-new-tokens", "4", "--no-prepack"]
    code, err = run(["distill", "--prompts", str(single), "--out", str(tmp_path / "fu.jsonl"), "--variant", "fu", *common], capsys)
    assert code == 1 and "2 of the 2 rows have a single turn" in err and not (tmp_path / "fu.jsonl").exists()
    assert run(["distill", "--prompts", str(single), "--out", str(tmp_path / "d.jsonl"), *common], capsys)[0] == 0
    assert run(["distill", "--prompts", str(multi), "--out", str(tmp_path / "fu.jsonl"), "--variant", "fu", *common], capsys)[0] == 0
    first = {r["id"]: r["messages"] for r in map(json.loads, (tmp_path / "d.jsonl").read_text().splitlines())}
    follow = {r["id"]: r["messages"] for r in map(json.loads, (tmp_path / "fu.jsonl").read_text().splitlines())}
    assert sorted(follow) == ["p0~fu", "p1~fu"]
    for pid, messages in first.items():
        roles = [m["role"] for m in follow[f"{pid}~fu"]]
        assert roles == ["user", "assistant", "user", "assistant"]
        assert follow[f"{pid}~fu"][:2] == messages  # the target's own greedy answer first, then the follow-up's


def test_distill_reuses_answers_given_before_and_generates_only_the_new_turns(files, capsys, tmp_path):
    from medusa_heads.shards import load_segments

    model = str(files["model"])
    common = ["--model", model, "--max-new-tokens", "4", "--no-prepack"]
    single, multi = tmp_path / "single.jsonl", tmp_path / "multi.jsonl"
    single.write_text("".join(json.dumps({"id": f"p{i}", "prompt": q}) + "\n" for i, q in enumerate(["w1 w2 w3", "w4 w5"])))
    multi.write_text("".join(json.dumps({"id": f"p{i}", "turns": [q, "w9 w8"]}) + "\n"
                             for i, q in enumerate(["w1 w2 w3", "w4 w5", "w6"])))  # p2 was never answered
    assert run(["distill", "--prompts", str(single), "--out", str(tmp_path / "d.jsonl"), *common], capsys)[0] == 0
    assert run(["distill", "--prompts", str(multi), "--out", str(tmp_path / "fu.jsonl"), "--variant", "fu", *common], capsys)[0] == 0
    code, err = run(["distill", "--prompts", str(multi), "--out", str(tmp_path / "re.jsonl"), "--variant", "fu",
                     "--reuse", str(tmp_path / "d.jsonl"), "--features", str(tmp_path / "feat"), *common], capsys)
    assert code == 0 and "'reused': 2" in err
    fresh = {r["id"]: r["messages"] for r in map(json.loads, (tmp_path / "fu.jsonl").read_text().splitlines())}
    reused = {r["id"]: r["messages"] for r in map(json.loads, (tmp_path / "re.jsonl").read_text().splitlines())}
    assert sorted(reused) == ["p0~fu", "p1~fu", "p2~fu"]
    for cid, messages in reused.items():
        flags = [m.get("reused", False) for m in messages if m["role"] == "assistant"]
        assert flags == ([False, False] if cid == "p2~fu" else [True, False])
        # the same conversation as generating every turn: the greedy answer to the prompt, then to the follow-up
        assert [{k: v for k, v in m.items() if k != "reused"} for m in messages] == fresh[cid]
    # features only for what was generated now: training counts the reused answers once, from d.jsonl
    assert sorted(s.id for s in load_segments(tmp_path / "feat")) == ["p0~fu#1", "p1~fu#1", "p2~fu#0", "p2~fu#1"]
    code, err = run(["distill", "--prompts", str(multi), "--out", str(tmp_path / "x.jsonl"), "--reuse", str(tmp_path / "no.jsonl"), *common], capsys)
    assert code == 1 and "--reuse" in err and "no such file" in err


def test_bench_writes_to_a_fresh_run_folder_by_default(files, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    code, err = run(["bench", "--prompts", str(files["prompts.jsonl"]), "--model", str(files["model"]), "--limit", "1",
                     "--max-new-tokens", "2", "--long-tokens", "0", "--methods", "hf", "--no-prepack", "--device", "cpu"],
                    capsys)
    (folder,) = (tmp_path / "runs").iterdir()
    assert code == 0 and folder.name.startswith("bench-") and (folder / "speedup.png").is_file()
    assert json.loads((folder / "results.json").read_text())["settings"]["device"] == "cpu"  # --device: where it ran


def test_bench_runs_an_int8_target_against_its_own_plain_decoding(files, capsys, tmp_path):
    from medusa_heads.kernels.int8 import int8_supported

    if not int8_supported():
        pytest.skip("this PyTorch has no oneDNN int8 linear")
    out = tmp_path / "int8"
    code, err = run(["bench", "--prompts", str(files["prompts.jsonl"]), "--model", str(files["model"]), "--limit", "2",
                     "--max-new-tokens", "12", "--long-tokens", "0", "--methods", "hf,medusa", "--dtype", "int8",
                     "--out", str(out)], capsys)
    result = json.loads((out / "results.json").read_text())
    assert code == 0 and result["settings"]["int8_linears"] and "int8 linears" in (out / "results.md").read_text()
    assert result["overall"]["medusa"]["mismatches_vs_hf"] == 0


def test_ctrl_c_ends_chat_quietly_and_anything_else_with_status_130(files, capsys, monkeypatch):
    def ctrl_c(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr("builtins.input", ctrl_c)
    code, err = run(["chat", "--model", str(files["model"]), "--no-prepack"], capsys)
    assert code == 0 and "interrupted" not in err and "Traceback" not in err
    monkeypatch.setattr("medusa_heads.cli.generating._load_medusa", ctrl_c)
    code, err = run(["generate", "--prompt", "hi"], capsys)
    assert code == 130 and err == "interrupted\n"


def test_help_shows_defaults_and_every_flag_is_explained():
    from medusa_heads.cli import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for name, sub in commands.items():
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help text"
    help = commands["generate"].format_help()
    assert "(default: 0.7)" in help and "(default: 256)" in help


def test_written_files_follow_the_umask(tmp_path):
    from medusa_heads.checkpoint import save_heads

    umask = os.umask(0)
    os.umask(umask)
    model = MedusaModel.from_pretrained(tiny_model("llama"), heads=None, num_heads=1)
    save_heads(tmp_path, model.heads)
    for name in ("config.json", "heads.safetensors"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~umask
