"""oneDNN-prepacked linears (medusa_heads/kernels/prepack.py): same model, same weights, same greedy output."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from medusa_heads import MedusaModel
from medusa_heads.kernels.prepack import (
    MklPackedLinear, PackedLinear, Siblings, bf16_supported, is_prepacked, mkl_packs, packs, prepack_linears,
    prepack_supported, stock_kernels,
)

from medusa_heads.machine import find_cost, kernels_key

from conftest import assert_diverges_only_at_a_near_tie, chat_ids, randomize_heads, tiny_model

pytestmark = pytest.mark.skipif(not prepack_supported(), reason="this PyTorch build has no oneDNN packed linear")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepack_keeps_weights_keys_and_ties(dtype):
    base = tiny_model("llama", tie_word_embeddings=True).to(dtype)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    n_linear = sum(type(m) is nn.Linear for m in base.modules())
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = base(ids).logits
        if not packs(dtype):  # bf16 on a CPU without oneDNN bf16 kernels (AVX2 only): said, and nothing swapped
            with pytest.raises(ValueError, match="no oneDNN bf16 kernels"):
                prepack_linears(base)
            assert not is_prepacked(base) and torch.equal(base(ids).logits, ref)
            return
        assert prepack_linears(base) == n_linear and is_prepacked(base)
        assert not any(type(m) is nn.Linear for m in base.modules())
        assert isinstance(base.get_output_embeddings(), PackedLinear)
        assert base.get_output_embeddings().weight is base.get_input_embeddings().weight  # still tied
        after = base.state_dict()
        assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)
        got = base(ids).logits
        torch.testing.assert_close(got, ref, atol=1e-4 if dtype == torch.float32 else 2e-2, rtol=0)
        with stock_kernels(base):  # the very kernels of the unpacked model: bit for bit
            assert torch.equal(base(ids).logits, ref)


def sibling_groups(model: nn.Module) -> list[Siblings]:
    return list({id(m.siblings): m.siblings for m in model.modules()
                 if isinstance(m, PackedLinear) and m.siblings is not None}.values())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biased q, k and v
def test_siblings_make_one_product_and_each_member_gets_its_own_columns(arch):
    base = tiny_model(arch)
    ref = tiny_model(arch)
    prepack_linears(base)
    layers = base.model.layers
    assert len(sibling_groups(base)) == 2 * len(layers)
    attn = layers[0].self_attn
    assert attn.q_proj.siblings is attn.v_proj.siblings is not layers[0].mlp.up_proj.siblings
    assert (attn.q_proj.bias is not None) == (arch == "qwen2")
    x = torch.randn(1, 5, base.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            own = getattr(attn, name)
            torch.testing.assert_close(own(x), nn.functional.linear(x, own.weight, own.bias), atol=1e-5, rtol=0)
        ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(base(ids).logits, ref(ids).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_sibling_never_takes_columns_made_for_a_changed_or_another_input(mode):
    """The first member called computes the product for all; the others take their columns only of that very input
    unchanged since (its version counter), and each once: a changed input, another one, or a second call of the same
    member makes the product again."""
    base = tiny_model("llama")
    prepack_linears(base)
    attn = base.model.layers[0].self_attn
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    g = torch.Generator().manual_seed(1)

    def alone(m, x):
        return nn.functional.linear(x, m.weight, m.bias)

    with getattr(torch, mode)():
        x = torch.randn(3, base.config.hidden_size, generator=g)
        q(x)
        if mode == "no_grad":  # inference tensors keep no version counter to tell
            x.mul_(2)
            torch.testing.assert_close(k(x), alone(k, x), atol=1e-5, rtol=0)
        y = torch.randn(3, base.config.hidden_size, generator=g)
        torch.testing.assert_close(v(y), alone(v, y), atol=1e-5, rtol=0)
        q(x)
        k(x)
        torch.testing.assert_close(k(x), alone(k, x), atol=1e-5, rtol=0)  # again: the product for it made anew


def test_prepacked_model_cast_later_falls_back_to_stock_kernels():
    base = tiny_model("llama")
    prepack_linears(base)
    base.to(torch.bfloat16)  # the packed fp32 copies no longer fit: plain linear, same result as an unpacked cast
    ref = tiny_model("llama").to(torch.bfloat16)
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(base(ids).logits, ref(ids).logits)


def test_a_bf16_model_loaded_by_name_is_packed_where_the_cpu_can_and_generates_its_own_greedy_output(tmp_path):
    """from_pretrained prepacks a base it loads itself by default: fp32 always, bf16 only with bf16 kernels (on an
    AVX2-only CPU packing a bf16 weight fails, so the base and the bf16 heads keep the stock products)."""
    tiny_model("llama").save_pretrained(tmp_path / "base")
    model = MedusaModel.from_pretrained(str(tmp_path / "base"), heads=None, num_heads=2, dtype=torch.bfloat16)
    assert model.base_model.dtype == torch.bfloat16 and is_prepacked(model.base_model) == packs(torch.bfloat16)
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    ref = tiny_model("llama").to(torch.bfloat16).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
    with stock_kernels(model.base_model):  # the unpacked model's very kernels, packed or not
        out = model.generate(ids, max_new_tokens=10)
    assert_diverges_only_at_a_near_tie(model.base_model, out, ref)  # bf16 rounds a tree verify otherwise


def test_prepack_refuses_other_dtypes():
    base = tiny_model("llama").to(torch.float16)
    with pytest.raises(ValueError, match="float16"):
        prepack_linears(base)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_prepacked_model_matches_greedy(arch):
    base = tiny_model(arch)
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, tree="cpu-16", prepack=True))
    assert is_prepacked(base)
    for seed in range(3):
        ids = torch.randint(0, 96, (1, 5 + seed), generator=torch.Generator().manual_seed(seed))
        mask = torch.ones_like(ids)  # phi3's pad token (0) may occur in a random prompt
        ref = base.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=40), ref), (arch, seed)


def test_real_model_prepacked_matches_greedy():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from medusa_heads import default_model_path

    path = default_model_path()
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # its own copy: packed in place
    tok = AutoTokenizer.from_pretrained(path)
    model = MedusaModel.from_pretrained(base, heads="auto", prepack=True)
    for prompt in ("Explain photosynthesis to a child.", "Write a Python function that reverses a linked list."):
        ids = chat_ids(tok, prompt)
        ref = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=96, do_sample=False)
        assert torch.equal(model.generate(ids, max_new_tokens=96), ref), prompt


def test_prepacked_heads_score_as_the_stock_heads_save_the_same_and_fall_back_when_cast(tmp_path):
    from medusa_heads.checkpoint import save_heads

    base = tiny_model("llama", seed=3)
    trained = randomize_heads(MedusaModel.from_pretrained(base, heads=None, condition="path", mlp_size=24))
    trained.save_pretrained(tmp_path / "h")
    model = MedusaModel.from_pretrained(base, heads=tmp_path / "h", prepack=True, draft_dtype=torch.float32)
    heads = model.heads  # loaded heads are packed
    assert is_prepacked(heads) and heads.pack is not None
    h, context = torch.randn(7, 32), torch.randint(0, 96, (7, 4))
    with torch.no_grad():
        packed = heads(h, context)
        pack = heads.pack
        heads.use_kernels(None)
        with stock_kernels(heads):
            stock = heads(h, context)
        heads.use_kernels(pack)
        torch.testing.assert_close(packed, stock, rtol=1e-4, atol=1e-4)
        assert not torch.equal(packed, heads.blocks[0](h) @ heads.shared_weight.T)  # the heads are not the identity
        save_heads(tmp_path / "again", heads, model.config)
        assert (tmp_path / "again" / "heads.safetensors").read_bytes() == (tmp_path / "h" / "heads.safetensors").read_bytes()
        heads.to(torch.bfloat16)  # the packed copies no longer serve: the stock products run
        torch.testing.assert_close(heads(h.bfloat16(), context).float(), stock, rtol=0.05, atol=0.1)
    assert not is_prepacked(MedusaModel.from_pretrained(base, heads=None, prepack=True).heads)  # new heads are for training


@pytest.mark.skipif(not bf16_supported(), reason="no oneDNN bf16 kernels on this CPU")
def test_loaded_heads_draft_in_bf16_packed_on_a_cpu_and_output_stays_the_targets(tmp_path):
    base = tiny_model("llama", seed=5)
    trained = randomize_heads(MedusaModel.from_pretrained(base, heads=None, condition="path", mlp_size=24))
    trained.save_pretrained(tmp_path / "h")
    model = MedusaModel.from_pretrained(base, heads=tmp_path / "h")  # a model passed in: its own kernels stay
    heads = model.heads
    assert not is_prepacked(base) and is_prepacked(heads) and heads.dtype == torch.bfloat16
    assert heads.shared_weight.dtype == torch.bfloat16
    assert heads.embed_weight.data_ptr() == base.get_input_embeddings().weight.data_ptr()  # shared, not copied
    fp32 = MedusaModel.from_pretrained(base, heads=tmp_path / "h", draft_dtype=torch.float32).heads
    assert fp32.dtype == torch.float32 and fp32.embed_weight.data_ptr() == heads.embed_weight.data_ptr()
    h, context = torch.randn(64, 32), torch.randint(0, 96, (64, 4))
    with torch.no_grad():
        got, ref = heads(h, context), fp32(h, context)  # fp32 hidden states are cast on the way in
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, rtol=0.05, atol=0.05)
    assert (got.float().argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    for seed in range(3):
        ids = torch.randint(0, 96, (1, 5 + seed), generator=torch.Generator().manual_seed(seed))
        want = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
        assert torch.equal(model.generate(ids, max_new_tokens=40), want), seed


MKL = torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


@pytest.mark.skipif(not MKL, reason="this PyTorch build has no MKL packed SGEMM")
def test_mkl_packed_linear_serves_any_row_count_and_its_siblings(monkeypatch):
    g = torch.Generator().manual_seed(0)
    for features, bias in ((576, False), (37, True)):
        linear = nn.Linear(features, 3 * features // 2 + 1, bias=bias)
        packed = MklPackedLinear(linear)
        assert packed.shape_only.untyped_storage().nbytes() <= 4  # sizes only: no second copy of the weight
        with torch.no_grad():
            for rows in (1, 2, 5, 8, 9, 16, 33):
                x = torch.randn(1, rows, features, generator=g)
                torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)
    monkeypatch.setenv("MEDUSA_HEADS_FP32_KERNEL", "mkl")
    base, ref = tiny_model("qwen2"), tiny_model("qwen2")  # biased q, k and v
    prepack_linears(base)
    assert {type(m) for m in base.modules() if isinstance(m, PackedLinear)} == {MklPackedLinear}
    assert all(g.kernel.__class__ is MklPackedLinear for g in sibling_groups(base))
    ids = torch.randint(0, 96, (1, 12), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(base(ids).logits, ref(ids).logits, atol=1e-5, rtol=0)
    want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False)
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, tree="cpu-16"))
    assert torch.equal(model.generate(ids, max_new_tokens=30), want)
    # its own cost tables where calibrated on these kernels, else oneDNN's (the same shape: small products)
    assert kernels_key(base, True) == "prepacked-mkl-float32-cpu"
    assert find_cost({"prepacked-float32-cpu-x": 1}, base, True) == "prepacked-float32-cpu-x"
    assert find_cost({"prepacked-float32-cpu-x": 1, "prepacked-mkl-float32-cpu-y": 2}, base, True) == "prepacked-mkl-float32-cpu-y"
    with stock_kernels(base):
        assert kernels_key(base, False) == "stock-float32-cpu"


def test_the_fp32_kernel_is_chosen_by_the_cpu_or_the_environment(monkeypatch):
    monkeypatch.setenv("MEDUSA_HEADS_FP32_KERNEL", "onednn")
    assert not mkl_packs()
    base = tiny_model("llama")
    prepack_linears(base)
    assert {type(m) for m in base.modules() if isinstance(m, PackedLinear)} == {PackedLinear}
    monkeypatch.setenv("MEDUSA_HEADS_FP32_KERNEL", "mkl")
    assert mkl_packs() == MKL
    bf16 = tiny_model("llama").to(torch.bfloat16)
    if packs(torch.bfloat16):  # bf16 stays on oneDNN whatever the fp32 kernel
        prepack_linears(bf16)
        assert {type(m) for m in bf16.modules() if isinstance(m, PackedLinear)} == {PackedLinear}
    monkeypatch.setenv("MEDUSA_HEADS_FP32_KERNEL", "fast")
    with pytest.raises(ValueError, match="MEDUSA_HEADS_FP32_KERNEL='fast': use mkl or onednn"):
        mkl_packs()
