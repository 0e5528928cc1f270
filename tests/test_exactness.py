"""bf16 and int8 promise greedy output equal to the model's plain decoding bit for bit: checked on the model at hand
(inference/exactness.py), with products split where this CPU's kernel changes with the rows, and a warning where the
promise cannot hold."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from medusa_heads import MedusaModel
from medusa_heads.inference.cache import crop_to, new_cache
from medusa_heads.inference.exact_attention import rows_invariant, use_exact_attention
from medusa_heads.inference.exactness import cap_rows, first_dependent_rows
from medusa_heads.inference.int8 import int8_rows_invariant, int8_supported
from medusa_heads.inference.prepack import PackedLinear, packs
from medusa_heads.inference.verify import Target
from medusa_heads.tree.buffers import from_parents

from conftest import TINY, tiny_model

BF16_ROWS = packs(torch.bfloat16) and rows_invariant(torch.bfloat16)
needs_bf16 = pytest.mark.skipif(not BF16_ROWS, reason="no row-invariant oneDNN bf16 kernels on this CPU")


def _load(base, **kwargs) -> tuple[MedusaModel, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = MedusaModel.from_pretrained(base, heads=None, **kwargs)
    return model, [str(w.message) for w in caught if "near-ties" in str(w.message)]


def test_the_first_row_count_that_changes_a_row_is_found():
    w = torch.randn(16)  # elementwise "products": a row's bits are its own, whatever the rows beside it
    assert first_dependent_rows(lambda a: a * w, 16, torch.float32, max_rows=12) is None
    changes = lambda a: a * w + (1e-3 if a.shape[0] > 5 else 0.0)  # noqa: E731: a kernel that changes past 5 rows
    assert first_dependent_rows(changes, 16, torch.float32, max_rows=12) == 6
    late = lambda a: torch.cat([a[:3] * w, a[3:] * w + 1e-3])  # noqa: E731: only the rows past a block change
    assert first_dependent_rows(late, 16, torch.float32, max_rows=12) == 4


@needs_bf16
@pytest.mark.parametrize("shape", [(3072, 576), (576, 1536), (960, 576)])
def test_a_bf16_product_gives_every_row_its_own_bits_at_any_row_count(shape):
    out_f, in_f = shape
    holder = nn.Sequential(PackedLinear(nn.Linear(in_f, out_f, bias=False).to(torch.bfloat16)))
    cap_rows(holder)
    linear = holder[0]
    x = torch.randn(100, in_f, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        alone = torch.cat([linear(x[i : i + 1]) for i in range(100)])
        for m in (2, 16, 32, 33, 40, 64, 65, 100):
            assert torch.equal(linear(x[:m]), alone[:m]), (m, linear.row_cap)


@needs_bf16
def test_every_row_of_a_large_real_bf16_verify_is_its_plain_step(real_base):
    """41 rows at once, as a batch's verify takes (rows x tree tokens): past 32 rows oneDNN's bf16 kernel on an Intel
    Xeon with AMX rounds a row otherwise, and without the split rows 33 on differ here."""
    base = AutoModelForCausalLM.from_pretrained(real_base[0].name_or_path, dtype=torch.bfloat16).eval()
    model, problems = _load(base, prepack=True)  # a model passed in: the row-exact attention is switched on below
    assert problems  # sdpa: said at load
    use_exact_attention(base)
    target = Target(base)
    past, n = 20, 41
    ids = torch.randint(100, 20000, (1, past + n), generator=torch.Generator().manual_seed(0))
    cache = new_cache(base, past + n + 4)
    target.prefill(ids[:, :past], cache)
    tree = target.verify(ids[0, past:], past, cache, from_parents(tuple(range(-1, n - 1)))).logits  # a chain
    crop_to(cache, past)
    differ = [d for d in range(n) if not torch.equal(tree[d], target.step(ids[0, past + d : past + d + 1], past + d,
                                                                               cache).logits[-1])]
    assert differ == []


@needs_bf16
def test_bf16_with_the_row_exact_attention_is_exact_and_says_nothing():
    base = tiny_model().to(torch.bfloat16)
    use_exact_attention(base)
    model, problems = _load(base, prepack=True)
    assert model.exact and problems == []


@needs_bf16
def test_bf16_with_sdpa_says_how_to_make_it_exact():
    model, problems = _load(tiny_model().to(torch.bfloat16), prepack=True)
    assert not model.exact
    assert len(problems) == 1 and "attn_implementation='medusa_exact'" in problems[0]


def _tiny_falcon():
    torch.manual_seed(0)
    config = AutoConfig.for_model("falcon", **TINY, new_decoder_architecture=True, num_kv_heads=2)
    return AutoModelForCausalLM.from_config(config).eval()


@needs_bf16
def test_a_model_that_computes_its_own_attention_is_said_not_exact(tmp_path):
    _tiny_falcon().save_pretrained(tmp_path)  # loaded by path: transformers would refuse the row-exact attention
    model, problems = _load(str(tmp_path), dtype=torch.bfloat16)
    assert not model.exact and model.base_model.config._attn_implementation == "sdpa"
    assert len(problems) == 1 and "computes its attention itself" in problems[0]
    ids = torch.tensor([[5, 9, 13, 2]])
    out = model.generate(ids, max_new_tokens=12, do_sample=False)  # still decodes
    assert out.shape[1] > ids.shape[1]


@pytest.mark.skipif(not (int8_supported() and int8_rows_invariant(torch.bfloat16)), reason="no exact int8 kernels")
def test_int8_on_a_model_with_sdpa_is_said_not_exact():
    model, problems = _load(tiny_model(), quantize="int8")  # fp32 activations, sdpa
    assert not model.exact and len(problems) == 1 and "'sdpa'" in problems[0]


def test_fp32_promises_rounding_only_and_says_nothing():
    model, problems = _load(tiny_model())
    assert not model.exact and problems == []


@needs_bf16
def test_a_checkpoint_with_attention_sinks_loads_in_bf16_on_eager_attention(tmp_path):
    from families import tiny_family

    tiny_family("gpt_oss").save_pretrained(tmp_path)  # the row-exact attention refuses sinks: it used to fail here
    model, problems = _load(str(tmp_path), dtype=torch.bfloat16)
    assert model.base_model.config._attn_implementation == "eager" and not model.exact
    assert len(problems) == 1 and "sinks" in problems[0]


@needs_bf16
def test_the_attention_counter_counts_this_threads_calls_only():
    """The load check reads it before and after its probe: a forward in another thread must not move it."""
    import threading

    from medusa_heads.inference import exact_attention

    base = tiny_model("llama").to(torch.bfloat16)
    use_exact_attention(base)
    ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(0))
    seen = {}

    def other():
        before = exact_attention.calls()
        with torch.no_grad():
            base(ids)
        seen["other"] = exact_attention.calls() - before

    here = exact_attention.calls()
    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen["other"] == base.config.num_hidden_layers and exact_attention.calls() == here
    with torch.no_grad():
        base(ids)
    assert exact_attention.calls() == here + base.config.num_hidden_layers
