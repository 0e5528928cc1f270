"""llama.cpp beside us in the bench: the build options for the CPU at hand, the methods, and the bench's plumbing
(with stand-in engines); the tests marked `llamacpp` run the real llama.cpp (`make test-llamacpp` builds it)."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from medusa_heads import MedusaModel, llamacpp
from medusa_heads import bench
from medusa_heads.corpus import PromptRow

from conftest import randomize_heads, tiny_model

XEON = {"avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8"}


def test_the_build_names_this_cpus_options_and_never_amx_or_native():
    args = llamacpp.cmake_args(XEON)
    assert "-DGGML_NATIVE=OFF" in args and "-DGGML_AVX512_BF16=ON" in args and "-DGGML_AVX512_VNNI=ON" in args
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(args)
    older = llamacpp.cmake_args({"avx", "avx2", "fma", "f16c"})  # e.g. a CPU without AVX-512
    assert "-DGGML_AVX2=ON" in older and "-DGGML_AVX512=OFF" in older and "-DGGML_AVX512_BF16=OFF" in older


def test_a_failed_step_is_one_line_that_names_its_cause_and_log(tmp_path):
    with pytest.raises(llamacpp.LlamaCppError) as e:
        llamacpp._run(["sh", "-c", "echo compiling; echo 'error: no such compiler' >&2; exit 3"], tmp_path / "b.log",
                      "building llama-cpp-python")
    assert "\n" not in str(e.value)
    assert str(e.value) == f"building llama-cpp-python failed (error: no such compiler); the whole log: {tmp_path / 'b.log'}"


def test_llamacpp_stands_for_every_llama_cpp_method_and_each_is_labelled():
    methods = bench.check_methods(["medusa", "llamacpp"])
    assert methods == ["hf", "medusa", "llamacpp-f32", "llamacpp-bf16", "llamacpp-q8_0", *(
        f"llamacpp-{m}" for m in llamacpp.NGRAM_MODES)]
    assert bench.check_methods(["llamacpp-ngram"])[1:] == [f"llamacpp-{m}" for m in llamacpp.NGRAM_MODES]
    assert bench.method_label("llamacpp-q8_0", 10) == "llama.cpp Q8_0"
    assert bench.method_label("llamacpp-ngram-mod", 10) == "llama.cpp F32 + ngram-mod self-speculation"
    assert llamacpp.plain_reference("llamacpp-ngram-cache") == "llamacpp-f32"
    assert llamacpp.plain_reference("llamacpp-bf16") is None
    with pytest.raises(ValueError, match="llamacpp"):
        bench.check_methods(["llamacpp-q4"])


class Replay:
    """Stands in for a llama.cpp engine: it answers with `model`'s greedy tokens, one of them changed if `wrong`."""

    def __init__(self, model, wrong: bool = False, forwards_per_token: float = 1.0) -> None:
        self.model, self.wrong, self.per = model, wrong, forwards_per_token
        self.closed = False

    def generate(self, ids, max_new_tokens, ignore_eos=False):
        kwargs = dict(eos_token_id=None) if ignore_eos else {}
        out = self.model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
        new = out[0, len(ids):].tolist()
        if self.wrong:
            new[-1] = (new[-1] + 1) % self.model.config.vocab_size
        return new, max(1, round(len(new) * self.per))

    def close(self):
        self.closed = True


def test_the_bench_runs_llama_cpp_beside_the_heads_and_says_where_it_stands(tmp_path, monkeypatch, real_base):
    _, tok = real_base
    base = tiny_model("llama", seed=2, vocab_size=len(tok))
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, tree="cpu-8"))
    engines = {"llamacpp-f32": Replay(base), "llamacpp-q8_0": Replay(base, wrong=True),
               "llamacpp-ngram-mod": Replay(base, forwards_per_token=0.5),
               "llamacpp-ngram-cache": Replay(base, wrong=True)}
    monkeypatch.setattr(bench, "llamacpp_engines", lambda *a: engines)
    methods = bench.check_methods(["pld", "medusa", "llamacpp-f32", "llamacpp-q8_0", "llamacpp-ngram-mod",
                                   "llamacpp-ngram-cache"])
    rows = [PromptRow("a", ["Hello there"]), PromptRow("b", ["Two turns", "and again"])]
    result = bench.run_bench(model, tok, rows, methods, max_new_tokens=8, long_tokens=12)
    o = result["overall"]
    assert o["llamacpp-f32"]["mismatches_vs_hf"] == 0 and o["llamacpp-q8_0"]["mismatches_vs_hf"] == 3
    assert o["llamacpp-ngram-mod"]["mismatches_vs_plain"] == 0 and o["llamacpp-ngram-cache"]["mismatches_vs_plain"] == 3
    assert "mismatches_vs_plain" not in o["llamacpp-f32"]
    assert o["llamacpp-f32"]["mean_accepted"] == 1.0 and o["llamacpp-ngram-mod"]["mean_accepted"] == pytest.approx(2.0)
    assert result["long"]["llamacpp-f32"]["tokens"] == 12 and result["long"]["llamacpp-f32"]["same_as_hf"]
    assert all(e.closed for e in engines.values())
    bench.write_results(result, tmp_path, methods)
    lines = (tmp_path / "results.md").read_text().splitlines()
    ours = o["medusa"]["tokens_per_s"]
    assert lines[5].startswith(f"**Against llama.cpp**: the heads decode at {ours:.1f} tokens/s: "
                               f"{ours / o['llamacpp-f32']['tokens_per_s']:.2f}× llama.cpp F32")
    best = max(("llamacpp-ngram-mod", "llamacpp-ngram-cache"), key=lambda m: o[m]["tokens_per_s"])
    assert lines[6].startswith(f"llama.cpp's best n-gram self-speculation here is {best.removeprefix('llamacpp-')}: ")
    assert lines[6].endswith(f"{o[best]['mismatches_vs_plain']} of 3 outputs differ from its plain decoding.")
    assert "| overall | llama.cpp Q8_0 |" in "\n".join(lines)
    assert json.loads((tmp_path / "results.json").read_text())["settings"]["prompts_run"] == 3


def test_llama_cpp_decodes_greedily_only(real_base):
    _, tok = real_base
    model = MedusaModel.from_pretrained(tiny_model("llama", vocab_size=len(tok)), heads=None)
    with pytest.raises(ValueError, match="greedily"):
        bench.run_bench(model, tok, [PromptRow("a", ["Hi"])], ["llamacpp-f32"], max_new_tokens=4,
                        sampling=dict(temperature=1.0))


def test_the_command_line_refuses_sampling_with_llama_cpp_before_the_model_loads(capsys):
    from medusa_heads.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "--prompts", "data/bench_prompts.jsonl", "--methods", "medusa,llamacpp", "--do-sample",
              "--model", "/nonexistent-model"])
    assert "llama.cpp methods decode greedily" in str(e.value) and "\n" not in str(e.value)


built = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                           reason="llama.cpp is not built here: make test-llamacpp builds it")


@pytest.mark.llamacpp
@built
def test_llama_cpp_f32_decodes_the_real_model_as_transformers_does(real_base):
    """The same weights, converted by llama.cpp's converter: its plain greedy decoding equals transformers' on real
    prompts (fp32 both; a difference could only be a near-tie, and these prompts have none in 48 tokens)."""
    from medusa_heads.prompting import prompt_ids

    base, tok = real_base
    engine = llamacpp.Plain(llamacpp.gguf(llamacpp.model_folder(base, tok), "f32"), torch.get_num_threads())
    try:
        for prompt in ["What is the capital of France?", "Write a haiku about the sea."]:
            ids = prompt_ids(tok, prompt)
            ref = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False)
            new, forwards = engine.generate(ids[0].tolist(), 48)
            assert new == ref[0, ids.shape[1]:].tolist() and forwards == len(new)
    finally:
        engine.close()


@pytest.mark.llamacpp
@built
def test_llama_cpp_quantizes_and_its_ngram_self_speculation_keeps_its_plain_output(real_base):
    from medusa_heads.prompting import prompt_ids

    base, tok = real_base
    folder = llamacpp.model_folder(base, tok)
    q8 = llamacpp.gguf(folder, "q8_0")
    assert q8.stat().st_size < 0.4 * llamacpp.gguf(folder, "f32").stat().st_size
    ids = prompt_ids(tok, "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox")[0].tolist()
    plain = llamacpp.Plain(llamacpp.gguf(folder, "f32"), torch.get_num_threads())
    server = llamacpp.Server(llamacpp.gguf(folder, "f32"), "ngram-simple", torch.get_num_threads(),
                             eos=[tok.eos_token_id])
    try:
        ref, _ = plain.generate(ids, 40)
        new, forwards = server.generate(ids, 40)
        assert new == ref and forwards < len(new)  # it drafted, and kept llama.cpp's own greedy answer
    finally:
        plain.close()
        server.close()
