"""Shared fixtures: tiny random models of several families, and the real SmolLM2-135M-Instruct."""
from __future__ import annotations

import os

import pytest
import torch
import transformers

from medusa_heads import MedusaModel

# Trees are sized by the cost tables the heads store, as they are (the default): a test host must not time its own at
# first use (calibration/machine.py, opt-in; tests/test_machine_cost.py turns it on for itself).
os.environ.setdefault("MEDUSA_HEADS_MACHINE_COSTS", "off")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs a worker per core: one thread each, none oversubscribed
    torch.set_num_threads(1)

# Files whose tests take the longest (a minute or more each on two cores): started first, so that the workers of
# `make test` do not end on one long test while the other idles.
HEAVY = ("test_fit.py", "test_greedy.py", "test_readme.py", "test_adaptive.py", "test_sampling.py", "test_calibrate.py")


def pytest_collection_modifyitems(config, items):
    """The real model's tests first, then the heavy files', then the rest; each group in collection order."""
    def rank(item) -> int:
        return 0 if item.get_closest_marker("real") else 1 if item.path.name in HEAVY else 2

    items.sort(key=rank)


@pytest.fixture(autouse=True)
def _threads_as_they_were():
    """A command run in-process sets torch's threads (`--threads`, default 2): set back after each test, so that a
    worker keeps its one thread and two workers never oversubscribe two cores."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.2)  # peaked logits: no near-ties that float noise could flip

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4096}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8, "sliding_window": 4096}),
}


def tiny_model(arch: str = "llama", seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    config_name, model_name, extra = ARCHS[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**{**TINY, **extra, **overrides})
    return getattr(transformers, model_name)(config).eval()


def randomize_heads(model: MedusaModel, std: float = 0.3, seed: int = 1) -> MedusaModel:
    """Give zero-initialised heads random weights, so that their drafts are varied (mostly wrong)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def assert_diverges_only_at_a_near_tie(base, out: torch.Tensor, ref: torch.Tensor, *context) -> bool:
    """Half precision rounds a tree verify otherwise than one-token steps: `out` may leave the target's greedy `ref`
    (both (1, L)) only where the target's own top two logits are within rounding noise. True if they are equal."""
    if torch.equal(out, ref):
        return True
    p = int((out[0, : ref.shape[1]] != ref[0, : out.shape[1]]).nonzero()[0])
    with torch.no_grad():
        top2 = base(ref[:, :p]).logits[0, -1].float().topk(2).values
    assert float(top2[0] - top2[1]) <= 0.05 * float(top2[0].abs().clamp_min(1.0)), (*context, p, top2)
    return False


@pytest.fixture(scope="session")
def real_base():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from medusa_heads import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def chat_ids(tokenizer, prompt: str) -> torch.Tensor:
    from medusa_heads.prompting import prompt_ids

    return prompt_ids(tokenizer, prompt)


def distilled_tiny_base(root, tokenizer, seed: int, prompts: list[str], max_new_tokens: int, batch_size: int):
    """A tiny Llama with `tokenizer`, saved as an HF directory under root/base, and root/d.jsonl: its own answers to
    `prompts` (root/p.jsonl). Returns the (unsaved twin) model."""
    import json

    from medusa_heads.corpus import read_prompts
    from medusa_heads.training.distill import distill

    tiny_model("llama", seed=seed, vocab_size=len(tokenizer)).save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    (root / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    base = tiny_model("llama", seed=seed, vocab_size=len(tokenizer))
    distill(base, tokenizer, read_prompts(root / "p.jsonl"), root / "d.jsonl", max_new_tokens=max_new_tokens,
            batch_size=batch_size)
    return base


def tiny_model_with_tokenizer(folder):
    """The default model's tokenizer and a tiny Llama over its vocabulary, saved together to `folder` (a model the
    command line can load by path)."""
    from transformers import AutoTokenizer

    from medusa_heads import default_model_path

    tok = AutoTokenizer.from_pretrained(default_model_path())
    base = tiny_model("llama", vocab_size=len(tok))
    base.save_pretrained(folder)
    tok.save_pretrained(folder)
    return tok, base


def rotated_conversations(n: int) -> list[dict]:
    """n one-turn conversations p0.. whose answers are rotations of one sentence (a calibration's toy data)."""
    words = "the cat sat on the mat and the dog sat on the log".split()
    return [{"id": f"p{i}", "messages": [{"role": "user", "content": f"Say something {i}"},
                                          {"role": "assistant", "content": " ".join(words[i % 13:] + words[:i % 13])}]}
            for i in range(n)]
