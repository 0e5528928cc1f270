"""The heads' drafting on weight-only int8 (kernels/draft_int8.py): every product swapped, close to fp32's, the heads'
guesses nearly always fp32's, the saved heads untouched, and the output the target's whatever the drafts."""
from __future__ import annotations

import pytest
import torch

from medusa_heads import MedusaModel
from medusa_heads.kernels.draft_int8 import Int8DraftLinear, Int8DraftWeight, draft_int8_supported
from tests.conftest import randomize_heads, tiny_model

pytestmark = pytest.mark.skipif(not draft_int8_supported(), reason="no torch._weight_int8pack_mm in this build")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tiny_model("llama", seed=7)
    folder = tmp_path_factory.mktemp("heads") / "h"
    randomize_heads(MedusaModel.from_pretrained(base, heads=None, condition="path", mlp_size=24)).save_pretrained(folder)
    return base, folder


def test_int8_heads_swap_every_product_and_score_as_fp32(saved):
    base, folder = saved
    int8 = MedusaModel.from_pretrained(base, heads=folder, draft_dtype=torch.int8).heads
    fp32 = MedusaModel.from_pretrained(base, heads=folder, draft_dtype=torch.float32).heads
    linears = [m for m in int8.modules() if isinstance(m, torch.nn.Linear) or isinstance(m, Int8DraftLinear)]
    assert linears and all(isinstance(m, Int8DraftLinear) for m in linears)
    assert int8.dtype == torch.float32 and isinstance(int8.pack(int8.shared_weight), Int8DraftWeight)
    h, context = torch.randn(64, 32), torch.randint(0, 96, (64, 4))
    with torch.no_grad():
        got, ref = int8(h, context), fp32(h, context)
    assert got.dtype == torch.float32 and not torch.equal(got, ref)  # another kernel ran
    torch.testing.assert_close(got, ref, rtol=0.05, atol=0.05 * ref.abs().max().item())
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_int8_drafting_keeps_the_targets_greedy_output_and_the_saved_heads(saved, tmp_path):
    base, folder = saved
    model = MedusaModel.from_pretrained(base, heads=folder, draft_dtype=torch.int8, tree="cpu-8")
    for seed in range(3):
        ids = torch.randint(0, 96, (1, 5 + seed), generator=torch.Generator().manual_seed(seed))
        want = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
        out = model.generate(ids, max_new_tokens=40, return_dict_in_generate=True)
        assert torch.equal(out.sequences, want), seed
        assert out.stats.steps < 40  # the int8 heads' guesses are accepted
    model.save_pretrained(tmp_path / "again")  # the fp32 weights are what is saved, not the int8 copies
    assert (tmp_path / "again" / "heads.safetensors").read_bytes() == (folder / "heads.safetensors").read_bytes()


@pytest.mark.parametrize("inner", [8, 24, 40, 64])
def test_an_inner_dimension_off_the_kernel_s_blocks_is_padded_not_read_past(inner):
    """The kernel's AVX-512 path reads the inner dimension in blocks of 16 (an Intel Xeon died at 24): the weight is
    padded with zero columns, and the product equals the dequantised weight's."""
    from medusa_heads.kernels.draft_int8 import K_BLOCK, _int8, _product

    g = torch.Generator().manual_seed(inner)
    weight, x = torch.randn(32, inner, generator=g), torch.randn(5, 3, inner, generator=g)
    q, scale = _int8(weight)
    assert q.shape == (32, -(-inner // K_BLOCK) * K_BLOCK) and not q[:, inner:].any()
    want = x.bfloat16().float() @ (q[:, :inner].float() * scale.float()[:, None]).T
    torch.testing.assert_close(_product(x, q, scale), want, rtol=0.02, atol=0.02)
