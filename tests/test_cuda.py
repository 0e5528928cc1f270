"""The CUDA path: the same exactness as on the CPU, with the model, heads, tree buffers and cache on the GPU.
Skipped without a CUDA device (CI has none); run on a lent GPU machine with `pytest tests/test_cuda.py`."""
from __future__ import annotations

import pytest
import torch

from medusa_heads import MedusaModel

from conftest import randomize_heads, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def exact_matmuls():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # TF32 would make fp32 references themselves approximate
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


# fp32 only: in bf16 a many-row product rounds differently from a one-row product, so a tree verify and
# generate's one-token steps can pick different tokens at near-ties (seen on the CPU even for tiny models).
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_greedy_on_cuda_equals_generate(arch):
    base = tiny_model(arch).cuda()
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, tree="cpu-16"))
    assert next(model.heads.parameters()).device.type == "cuda"
    for seed in range(3):
        ids = torch.randint(0, 96, (1, 6 + 3 * seed), generator=torch.Generator().manual_seed(seed)).cuda()
        ref = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
        res = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, return_dict_in_generate=True)
        assert res.sequences.device.type == "cuda"
        assert torch.equal(res.sequences, ref), f"{arch}, prompt {seed}"


def test_batched_greedy_on_cuda_equals_generate():
    base = tiny_model("llama", seed=2).cuda()
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, tree="cpu-8"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 96, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = mask[2, :5] = 0  # left padding
    ids = ids.masked_fill(mask == 0, 0).cuda()
    mask = mask.cuda()
    ref = base.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=30, pad_token_id=0)
    assert torch.equal(out, ref)


def test_sampling_on_cuda_is_reproducible_and_stays_in_the_top_p_set():
    base = tiny_model("llama", seed=4).cuda()
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, tree="cpu-8"))
    ids = torch.tensor([[3, 14, 15, 9]], device="cuda")
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        runs.append(model.generate(ids, do_sample=True, temperature=0.7, top_k=3, max_new_tokens=24))
    assert torch.equal(runs[0], runs[1])
    seq = runs[0][0]
    for p in range(ids.shape[1], seq.shape[0]):  # each token is among the model's top 3 after its own prefix
        logits = base(seq[None, :p]).logits[0, -1]
        assert int(seq[p]) in logits.topk(3).indices.tolist()
