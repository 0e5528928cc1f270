"""The README's Python example and its command lines run exactly as printed, and say what they claim."""
import gzip
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def python_example() -> str:
    """The README's Python section's example (the llama.cpp section's needs its build: test_llamacpp_engine.py)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text().split("\n## Python\n", 1)[1], flags=re.S)
    assert blocks, "README.md has no ```python block"
    return blocks[0]


@pytest.mark.real
def test_readme_python_example_runs_verbatim(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    scope: dict = {}
    exec(compile(python_example(), "README.md", "exec"), scope)
    out = capsys.readouterr().out
    assert "tau " in out and (tmp_path / "my-heads" / "heads.safetensors").is_file()
    model, ids, mask, tok = scope["model"], scope["ids"], scope["mask"], scope["tok"]
    assert scope["out"].shape[1] > ids.shape[1] and model.config.extra  # trained heads, something generated
    ref = model.base_model.generate(ids, attention_mask=mask, max_new_tokens=64, do_sample=False)
    assert torch.equal(scope["out"], ref)  # the claim in the example's comment
    assert torch.equal(scope["chain"], scope["out"])  # another tree for one call: the same tokens
    assert tok.decode(ids[0]).startswith("<|im_start|>system") and tok.decode(ids[0]).endswith("<|im_start|>assistant\n")


ENTRY_POINT = Path(sys.executable).parent / "medusa-heads"
ROOT = README.parent


def bash_lines(text: str) -> list[list[str]]:
    """The `medusa-heads` commands of the ```bash blocks in `text`, in order (continuations joined, comments cut)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line.split(" #", 1)[0]) if line.strip() else []
            if words[:1] == ["medusa-heads"]:
                commands.append(words[1:])
    return commands


def training_commands() -> list[list[str]]:
    """The step-by-step `medusa-heads` commands of the README's training section, in order. The section opens with
    the one-command path, `fit` with a budget (tests/test_fit.py runs it end to end on tiny models)."""
    section = README.read_text().split("## Train heads for your own model", 1)[1].split("\n## ", 1)[0]
    commands = bash_lines(section)
    assert commands[0][0] == "fit" and "--budget" in commands[0] and "--out" in commands[0], commands[0]
    return commands[1:]


# What a test adds so that the README's commands run in a minute on a handful of prompts (acceptance and cost
# calibration need more held-out data and a longer context than this; tests/test_calibrate.py runs them).
SMALL = {
    "distill": ["--limit", "8", "--max-new-tokens", "12", "--batch-size", "2"],
    "train": ["--set", "max_steps=2", "--set", "eval_fraction=0.5", "--set", "eval_every=1", "--set", "save_every=1",
              "--set", "batch_size=8"],
    "calibrate": ["--parts", "tree,lookup", "--max-nodes", "4", "--repeats", "1", "--threads", "1"],
    "bench": ["--limit", "2", "--max-new-tokens", "8", "--long-tokens", "0", "--methods", "hf,medusa", "--threads", "1",
              "--out", "runs/bench"],
}


def run_training_commands(workdir: Path, model: str, prompts: list[str]) -> list[str]:
    """The README's training commands in `workdir` (a copy of configs/, and data/train_prompts.jsonl.gz and
    data/bench_prompts.jsonl holding `prompts`) through the installed entry point; returns their stderr."""
    shutil.copytree(ROOT / "configs", workdir / "configs")
    (workdir / "data").mkdir()
    with gzip.open(workdir / "data" / "train_prompts.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts)
    (workdir / "data" / "bench_prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = []
    commands = training_commands()
    assert [c[0] for c in commands] == ["distill", "train", "calibrate", "bench"]
    calibrate_help = subprocess.run([str(ENTRY_POINT), "calibrate", "--help"], capture_output=True, text=True).stdout
    force_cost = ["--force-cost"] if "--force-cost" in calibrate_help else []  # the test host is shared: store timings
    for argv in commands:
        extra = SMALL[argv[0]] + (["--set", f"model={model}"] if argv[0] == "train" else ["--model", model])
        extra += force_cost if argv[0] == "calibrate" else []
        done = subprocess.run([str(ENTRY_POINT), *argv, *extra], cwd=workdir, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, f"medusa-heads {' '.join(argv)} failed:\n{done.stderr[-2000:]}"
        logs.append(done.stderr)
    heads = workdir / "runs" / "my-heads"
    assert (heads / "heads.safetensors").is_file() and (heads / "train_plot.png").is_file()  # all in train's --out
    assert (heads / "train_log.jsonl").is_file() and (workdir / "runs" / "bench" / "results.md").is_file()
    done = subprocess.run([str(ENTRY_POINT), "generate", "--model", model, "--heads", str(heads), "--prompt", prompts[0],
                           "--max-new-tokens", "8"], cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return logs + [done.stderr]


def test_readme_training_commands_run_for_a_model_without_chat_template(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from conftest import tiny_model

    words = [f"w{i}" for i in range(94)]
    inner = Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(words)}}, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>")
    model = tmp_path / "base"
    tiny_model("llama", seed=5, bos_token_id=1, eos_token_id=1, pad_token_id=1).save_pretrained(model)
    tok.save_pretrained(model)
    work = tmp_path / "work"
    work.mkdir()
    logs = run_training_commands(work, str(model), [" ".join(words[i : i + 6]) for i in range(0, 48, 6)])
    assert "no chat template" in logs[0] and "no chat template" in logs[-1]  # distill and generate say so
    assert all(log.count("no chat template") <= 1 for log in logs)  # once per command
    rows = [json.loads(line) for line in (work / "data" / "distilled.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(r["messages"][-1]["role"] == "assistant" for r in rows)


@pytest.mark.slow
@pytest.mark.real
def test_readme_training_commands_run_for_the_embedded_model(tmp_path):
    prompts = ["What is 2 + 3?", "Name a colour.", "Say hello in French.", "Write one word.", "Count to three.",
               "What is the capital of Italy?", "Spell cat.", "Give me a fruit."]
    logs = run_training_commands(tmp_path, "smollm2-135m-instruct", prompts)
    assert not any("no chat template" in log for log in logs)


# The README's other command lines (its training section runs above) and those of docs/: the ones that finish within
# a minute run here as printed; `chat` is interactive, and `bench`, `demo`, `distill`, `train` and `calibrate` take
# minutes to hours as printed.
QUICK = {"generate", "export"}


def quick_commands() -> list[list[str]]:
    """The quick command lines of the README (outside its training section) and of docs/*.md, each once."""
    text = README.read_text()
    before, rest = text.split("## Train heads for your own model", 1)
    after = rest.split("\n## ", 1)[1]
    commands = bash_lines(before + after)
    assert ["--help"] in commands and any(c[0] == "generate" for c in commands)
    for page in sorted((ROOT / "docs").glob("*.md")):
        commands += bash_lines(page.read_text())
    unique = [c for i, c in enumerate(commands) if c not in commands[:i]]
    # a command on llama.cpp needs its build (make llamacpp-setup): tests/test_llamacpp_engine.py runs those
    return [c for c in unique if (c[0] in QUICK or "--help" in c) and "--gguf" not in c]


def run_as_printed(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """One command in a scratch folder that sees the repository's medusa_heads/, data/ and configs/ (what the
    README's relative paths name), so whatever it writes lands in the scratch folder."""
    for name in ("medusa_heads", "data", "configs"):
        if not (tmp_path / name).exists():
            (tmp_path / name).symlink_to(ROOT / name)
    return subprocess.run([str(ENTRY_POINT), *argv], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})


def test_readme_help_lines_run(tmp_path):
    helps = [c for c in quick_commands() if "--help" in c]
    assert helps
    for argv in helps:
        done = run_as_printed(argv, tmp_path)
        assert done.returncode == 0 and "usage: medusa-heads" in done.stdout, (argv, done.stderr[-2000:])


@pytest.mark.real
def test_readme_quick_command_lines_run_as_printed(tmp_path):
    for argv in [c for c in quick_commands() if "--help" not in c]:
        if argv[0] == "generate":
            assert int(argv[argv.index("--max-new-tokens") + 1]) <= 64  # a quick line stays quick
        done = run_as_printed(argv, tmp_path)
        assert done.returncode == 0, (argv, done.stderr[-2000:])
        if argv[0] == "generate":
            assert done.stdout.strip() and "tau" in done.stderr.lower() + done.stdout.lower()
        if argv[0] == "export":
            assert (tmp_path / argv[-1] / "config.json").is_file()


def test_docs_cli_shows_the_live_help():
    """docs/cli.md reproduces `medusa-heads [COMMAND] --help` as the command prints it (at 100 columns)."""
    doc = (ROOT / "docs" / "cli.md").read_text()
    blocks = dict(re.findall(r"### (\S+)\n```text\n(.*?)\n```", doc.split("<!-- help:start", 1)[1], flags=re.S))
    commands = ["medusa-heads", "generate", "chat", "demo", "distill", "features", "train", "calibrate", "bench",
                "export", "fit"]
    assert sorted(blocks) == sorted(commands)
    env = {**os.environ, "COLUMNS": "100"}
    for name in commands:
        argv = [str(ENTRY_POINT), *([] if name == "medusa-heads" else [name]), "--help"]
        live = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60).stdout.rstrip()
        assert blocks[name] == live, f"docs/cli.md's `{name} --help` is out of date; the command now prints:\n{live}"
