"""The heads on llama.cpp (engines/llamacpp.py): a tiny random Llama over the real tokenizer, converted to GGUF by
llama.cpp's own converter and quantizer, decoded by the same loop as transformers; greedy output must be llama.cpp's
own plain greedy decoding of that file, token for token. Marked `llamacpp`: `make test-llamacpp` builds llama.cpp."""
from __future__ import annotations

import importlib.util
import threading

import pytest
import torch

from medusa_heads import MedusaModel, llamacpp
from medusa_heads.engines.llamacpp import LlamaCppEngine, _paths
from medusa_heads.tree.buffers import from_parents

from conftest import chat_ids, randomize_heads, tiny_model_with_tokenizer
from test_greedy import OracleDrafter, WrongDrafter

built = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                           reason="llama.cpp is not built here: make test-llamacpp builds it")
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Count: one two three four"]


def test_every_node_carries_the_paths_through_it():
    """Node i's sequences are the root-to-leaf paths through it: the root is on all, a leaf on its own only."""
    tree = from_parents((-1, 0, 0, 1, 1, 2), "cpu")  # root; two children; the first has two, the second one
    paths = _paths(tree)
    assert paths.shape == (6, 3)
    assert paths[0].all() and paths[1].tolist() == [True, True, False] and paths[2].tolist() == [False, False, True]
    assert [row.sum() for row in paths[3:]] == [1, 1, 1]
    chain = from_parents((-1, 0, 1), "cpu")
    assert _paths(chain).shape == (3, 1)  # one path: decoded on sequence 0 itself


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny Llama over SmolLM2's tokenizer saved as a transformers folder; its GGUF files are made on demand."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tok, base = tiny_model_with_tokenizer(folder)
    return folder, tok


@pytest.fixture(scope="module")
def tiny_f32(tiny_gguf):
    """The tiny model's F32 GGUF on llama.cpp with random heads and a fixed tree, and its tokenizer."""
    folder, tok = tiny_gguf
    return randomize_heads(MedusaModel.from_pretrained(str(folder), heads=None, gguf="f32", tree="cpu-8")), tok


def _plain(path, ids: torch.Tensor, n: int) -> list[int]:
    engine = llamacpp.Plain(path, torch.get_num_threads())
    try:
        return engine.generate(ids[0].tolist(), n, ignore_eos=True)[0]
    finally:
        engine.close()


@pytest.mark.llamacpp
@built
@pytest.mark.parametrize("weights", ["f32", "q8_0"])
def test_greedy_output_is_llama_cpps_own_plain_decoding(tiny_gguf, weights):
    folder, tok = tiny_gguf
    model = randomize_heads(MedusaModel.from_pretrained(str(folder), heads=None, gguf=weights, tree="cpu-16"))
    assert model.engine.kernels().startswith(f"llamacpp-{weights}-cpu")
    path = llamacpp.gguf(folder, weights)
    for prompt in PROMPTS:
        ids = chat_ids(tok, prompt)
        ref = _plain(path, ids, 40)
        right = OracleDrafter(torch.tensor([ids[0].tolist() + ref]), len(tok))
        for drafter in (None, right, WrongDrafter(torch.tensor([ids[0].tolist() + ref]), len(tok))):
            res = model.generate(ids, max_new_tokens=40, eos_token_id=None, drafter=drafter,
                                 return_dict_in_generate=True)
            assert res.sequences[0, ids.shape[1]:].tolist() == ref, (prompt, drafter)
        assert res.stats.mean_accepted == 1.0  # the wrong drafter: every step its own token alone
        out = model.generate(ids, max_new_tokens=40, eos_token_id=None, drafter=right, return_dict_in_generate=True)
        assert out.stats.mean_accepted > 3  # the oracle's paths were kept, and each committed without a recompute
        assert model.generate(ids, max_new_tokens=40, eos_token_id=None, tree="plain")[0, ids.shape[1]:].tolist() == ref


@pytest.mark.llamacpp
@built
def test_a_path_off_the_first_branch_is_committed_whole(tiny_gguf):
    """The accepted path runs down the tree's last branches, whose sequences are not the first ones: the cache keeps
    that path alone, and the next steps read it."""
    folder, tok = tiny_gguf
    model = MedusaModel.from_pretrained(str(folder), heads=None, gguf="f32", tree="cpu-16")
    ids = chat_ids(tok, PROMPTS[0])
    ref = _plain(llamacpp.gguf(folder, "f32"), ids, 48)

    class LastChildren(OracleDrafter):
        """The true token on the path of last children only; every other node wrong."""

        def draft_row(self, hidden, sequence, buffers):
            parent, on = buffers.parent.tolist(), [True]
            for i in range(1, buffers.size):
                on.append(on[parent[i]] and buffers.children[parent[i]][-1] == i)
            ref = torch.cat([self.reference, torch.zeros(buffers.size, dtype=torch.long)])
            truth = ref[sequence.shape[0] - 1 + buffers.depth[1:]]
            return torch.where(torch.tensor(on[1:]), truth, (truth + 1) % self.vocab)

    drafter = LastChildren(torch.tensor([ids[0].tolist() + ref]), len(tok))
    res = model.generate(ids, max_new_tokens=48, eos_token_id=None, drafter=drafter, return_dict_in_generate=True)
    assert res.sequences[0, ids.shape[1]:].tolist() == ref
    assert res.stats.mean_accepted > 1.5


@pytest.mark.llamacpp
@built
def test_streaming_stopping_threads_and_batches(tiny_f32):
    from transformers import StoppingCriteria, StoppingCriteriaList

    model, tok = tiny_f32
    ids = chat_ids(tok, PROMPTS[1])
    ref = model.generate(ids, max_new_tokens=30, eos_token_id=None)

    class Collect:
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value.flatten().tolist())

        def end(self):
            self.ended = True

    streamer = Collect()
    model.generate(ids, max_new_tokens=30, eos_token_id=None, streamer=streamer)
    assert sum(streamer.chunks[1:], []) == ref[0, ids.shape[1]:].tolist() and streamer.ended

    class AtTen(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.tensor([input_ids.shape[1] - ids.shape[1] >= 10])

    stopped = model.generate(ids, max_new_tokens=30, eos_token_id=None, stopping_criteria=StoppingCriteriaList([AtTen()]))
    assert torch.equal(stopped, ref[:, : ids.shape[1] + 10])

    outs = [None] * 4  # one model, four threads: each call on a llama context of its own
    def worker(i):
        outs[i] = model.generate(ids, max_new_tokens=30, eos_token_id=None)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(o, ref) for o in outs)

    two = torch.cat([ids, ids])
    with pytest.raises(ValueError, match="one prompt a call") as e:
        model.generate(two, max_new_tokens=4)
    assert "\n" not in str(e.value)


@pytest.mark.llamacpp
@built
def test_sampling_draws_from_llama_cpps_logits_reproducibly(tiny_f32):
    model, tok = tiny_f32
    ids = chat_ids(tok, PROMPTS[2])
    draw = lambda seed: model.generate(ids, max_new_tokens=24, do_sample=True, temperature=1.0,  # noqa: E731
                                       generator=torch.Generator().manual_seed(seed))
    assert torch.equal(draw(3), draw(3)) and not torch.equal(draw(3), draw(4))


@pytest.mark.llamacpp
@built
def test_a_context_too_small_and_a_missing_file_are_one_line(tiny_gguf, tmp_path):
    folder, tok = tiny_gguf
    engine = LlamaCppEngine(llamacpp.gguf(folder, "f32"), "f32", n_ctx=64)
    with pytest.raises(ValueError, match="more than the 64") as e:
        engine.session(100)
    assert "\n" not in str(e.value)
    engine.close()
    with pytest.raises(FileNotFoundError, match="no such file"):
        MedusaModel.from_pretrained(str(folder), heads=None, gguf=tmp_path / "nope.gguf")


@pytest.mark.parametrize("argv, says", [
    (["generate", "--prompt", "hi", "--gguf", "q5"], "--gguf q5: neither a GGUF file nor a weight type"),
    (["generate", "--prompt", "hi", "--gguf", "q8_0", "--dtype", "bf16"], "leave out --dtype and --device"),
    (["bench", "--prompts", "data/bench_prompts.jsonl", "--gguf", "nope.gguf"], "neither a GGUF file"),
])
def test_bad_gguf_arguments_are_one_line_before_anything_loads(argv, says, monkeypatch):
    from medusa_heads import loading
    from medusa_heads.cli import main

    monkeypatch.setattr(loading, "load_base", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.llamacpp
@built
def test_the_readmes_llama_cpp_lines_run_as_printed(tmp_path, monkeypatch):
    """The README's `--gguf` command lines and its llama.cpp Python example, as printed, on the real model."""
    import re

    from test_readme import README, bash_lines, run_as_printed

    commands = [c for c in bash_lines(README.read_text()) if "--gguf" in c]
    assert commands
    for argv in commands:
        done = run_as_printed(argv, tmp_path)
        assert done.returncode == 0, (argv, done.stderr[-2000:])
        assert done.stdout.strip() and "tau" in (done.stderr + done.stdout).lower()
    example = next(b for b in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S) if "gguf=" in b)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(example, "README.md", "exec"), scope)
    assert torch.equal(scope["out"][0, scope["ids"].shape[1]:], torch.tensor(scope["plain"]))


@pytest.mark.llamacpp
@built
def test_fit_on_a_gguf_file_alone_trains_heads_for_it_and_reports_llama_cpps_rows(tiny_gguf, tmp_path, monkeypatch):
    """A user who has only the GGUF: `fit --model FILE.gguf` (transformers dequantises it to train on), llama.cpp's
    verify calibrated as a cost table of its own, and the report's rows for the heads on llama.cpp against its plain
    decoding of that very file; the heads then load onto the file and decode as llama.cpp does."""
    import json

    from fit_clock import tick_fit
    from test_fit import write_prompts

    from medusa_heads.cli import main

    folder, tok = tiny_gguf
    path = tmp_path / "tiny-q8_0.gguf"
    path.write_bytes(llamacpp.gguf(folder, "q8_0").read_bytes())  # a file of the user's, apart from any folder
    prompts = write_prompts(tmp_path, seed=1, n=200)
    tick_fit(monkeypatch)
    out = tmp_path / "heads"
    main(["fit", "--model", str(path), "--budget", "5m", "--out", str(out), "--prompts", str(prompts / "train.jsonl"),
          "--bench-prompts", str(prompts / "bench.jsonl"), "--max-answers", "24", "--max-steps", "8", "--threads", "1",
          "--force-cost"])
    report = json.loads((out / "report.json").read_text())
    ll = report["bench"]["llamacpp"]
    assert (ll["file"], ll["weights"], ll["prompts"], ll["differ"]) == (str(path), "q8_0", 2, 0), ll
    assert ll["tau"] >= 1 and ll["tokens_per_s"] > 0 and ll["plain_tokens_per_s"] > 0
    assert "| on llama.cpp, " in (out / "report.md").read_text()
    costs = json.loads((out / "config.json").read_text())["adaptive"]["cost"]
    assert any(k.startswith("llamacpp-q8_0-cpu-") for k in costs), sorted(costs)
    model = MedusaModel.from_pretrained(str(path), heads=str(out))  # a .gguf base: llama.cpp runs it
    assert model.engine.kernels().startswith("llamacpp-q8_0-cpu")
    ids = chat_ids(tok, PROMPTS[0])
    res = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, eos_token_id=None)
    assert res[0, ids.shape[1]:].tolist() == _plain(path, ids, 32)  # (the GGUF's pad token sits in the chat prompt)
    # the bench on that file: llama.cpp's methods of its weight type run the file itself (no folder to convert)
    main(["bench", "--model", str(path), "--heads", str(out), "--prompts", str(prompts / "bench.jsonl"), "--methods",
          "medusa-llamacpp-q8_0,llamacpp-q8_0", "--max-new-tokens", "16", "--long-tokens", "0", "--threads", "1", "--out", str(tmp_path / "b")])
    overall = json.loads((tmp_path / "b" / "results.json").read_text())["overall"]
    assert overall["medusa-llamacpp-q8_0"]["mismatches_vs_plain"] == 0 and overall["llamacpp-q8_0"]["tokens_per_s"] > 0
