"""RMS norms on ATen's rms_norm (inference/norms.py): only where it gives the model's own bits."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from medusa_heads.inference.norms import fuse_norms, fused_norms, unfuse_norms
from medusa_heads.inference.prepack import prepack_linears, prepack_supported, packs, stock_kernels

from conftest import tiny_model


def rms_norms(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


def with_random_norm_weights(model: nn.Module, seed: int = 3) -> nn.Module:
    """Norm weights start at one, under which the weight's product cannot show a form that applies it otherwise."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in rms_norms(model):
            m.weight.copy_(torch.randn(m.weight.shape, generator=gen).to(m.weight.dtype))
    return model


@pytest.mark.parametrize("dtype,form", [(torch.float32, "rms_norm"), (torch.bfloat16, "rms_norm in fp32")])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: norms of the queries and keys too, per head
def test_fused_norms_give_the_models_own_logits_bit_for_bit(arch, dtype, form):
    base = with_random_norm_weights(tiny_model(arch)).to(dtype)
    ids = torch.randint(0, 96, (2, 37), generator=torch.Generator().manual_seed(0))
    state = {k: v.clone() for k, v in base.state_dict().items()}
    with torch.no_grad():
        ref, ref_one = base(ids).logits, base(ids[:, :1]).logits
        assert fuse_norms(base) == len(rms_norms(base)) > 0
        assert {m.forward.name for m in fused_norms(base)} == {form}
        assert torch.equal(base(ids).logits, ref)
        assert torch.equal(base(ids[:, :1]).logits, ref_one)
    after = base.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)
    assert fuse_norms(base) == len(rms_norms(base))  # idempotent
    assert unfuse_norms(base) == len(rms_norms(base)) and not fused_norms(base)
    assert all("forward" not in m.__dict__ for m in rms_norms(base))


def test_a_norm_of_another_form_keeps_its_forward():
    base = tiny_model("gemma2")  # Gemma's norm scales by 1 + weight: no form reproduces it
    assert rms_norms(base) and fuse_norms(base) == 0 and not fused_norms(base)


def test_a_later_cast_runs_the_norms_own_forward():
    base = with_random_norm_weights(tiny_model("llama"))
    fuse_norms(base)
    base = base.to(torch.bfloat16)
    ref = with_random_norm_weights(tiny_model("llama")).to(torch.bfloat16)
    ids = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(base(ids).logits, ref(ids).logits)


@pytest.mark.skipif(not prepack_supported(), reason="this PyTorch build has no oneDNN packed linear")
def test_prepacking_fuses_the_norms_and_stock_kernels_restores_them():
    base = tiny_model("llama")
    prepack_linears(base)
    norms = rms_norms(base)
    assert set(map(id, fused_norms(base))) == set(map(id, norms))
    with stock_kernels(base):
        assert not fused_norms(base)
    assert len(fused_norms(base)) == len(norms)


@pytest.mark.skipif(not packs(torch.float32), reason="this PyTorch build has no oneDNN packed linear")
def test_real_model_norms_fused_and_logits_unchanged(real_base):
    model, tok = real_base
    ids = tok("The quick brown fox jumps over the lazy dog, and then it runs far away into the woods where",
              return_tensors="pt")["input_ids"]
    try:
        with torch.no_grad():
            ref = model(ids).logits
            assert fuse_norms(model) == len(rms_norms(model)) == 2 * model.config.num_hidden_layers + 1
            assert torch.equal(model(ids).logits, ref)
    finally:
        unfuse_norms(model)  # the fixture is shared
