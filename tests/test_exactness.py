"""bf16 and int8 promise greedy output equal to the model's plain decoding bit for bit: checked on the model at hand
(medusa_heads/kernels/exactness.py), with products split where this CPU's kernel changes with the rows, and a warning where the
promise cannot hold.

The probes are tested on products built to be row-invariant and products built not to be, whatever this CPU's own
kernels are; the load check's questions about a model (its attention, its sinks) are asked as on a CPU whose products
are row-invariant (`invariant_cpu`), so that they are tested on every CPU too."""
from __future__ import annotations

import sys
import warnings

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from medusa_heads import MedusaModel
from medusa_heads.engines.hf_cache import crop_to, new_cache
from medusa_heads.kernels.exact_attention import rows_invariant, use_exact_attention
from medusa_heads.kernels.exactness import cap_rows, first_dependent_rows
from medusa_heads.kernels.int8 import Int8Linear, int8_rows_invariant, int8_supported, quantize_weight
from medusa_heads.kernels.prepack import PackedLinear, packs
from medusa_heads.engines.hf import Target
from medusa_heads.tree.buffers import from_parents

from conftest import TINY, tiny_model
from test_exact import ROUNDING, bf16_step

BF16_ROWS = rows_invariant(torch.bfloat16)
PACKS_BF16 = packs(torch.bfloat16)
needs_packed_bf16 = pytest.mark.skipif(not PACKS_BF16, reason="no oneDNN bf16 linears to pack on this CPU (they need "
                                       "AVX-512 or AVX-NE-CONVERT)")
needs_int8 = pytest.mark.skipif(not int8_supported(), reason="this PyTorch build has no oneDNN int8 linear")


@pytest.fixture
def invariant_cpu(monkeypatch):
    """As on a CPU whose bf16 and int8 products are row-invariant: every module of the project that holds the probes
    gets ones that say so."""
    for name, module in list(sys.modules.items()):
        if name.startswith("medusa_heads"):
            for probe in (rows_invariant, int8_rows_invariant):
                if getattr(module, probe.__name__, None) is probe:
                    monkeypatch.setattr(module, probe.__name__, lambda *args, **kwargs: True)


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
    # only where a row holds large values (as a kernel whose path depends on them): the second, larger input finds it
    large = lambda a: a * w + (1e-3 if a.shape[0] > 7 and a.abs().max() > 6 else 0.0)  # noqa: E731
    assert first_dependent_rows(large, 16, torch.float32, max_rows=12) == 8


def _per_row(product):
    """product, one row at a time: row-invariant by construction."""
    return lambda a, *args: torch.cat([product(a[..., i : i + 1, :], *args) for i in range(a.shape[-2])], dim=-2)


def _from_rows(product, first: int):
    """product (nn.functional.linear or torch.matmul) but, from `first` rows on, summed in two halves each rounded to
    the input's dtype: a kernel that takes many rows another way."""

    in_rows = product is torch.matmul  # matmul's b is (in, out), linear's (out, in)

    def rounded(a, b):
        if a.shape[-2] < first:
            return product(a, b)
        h = a.shape[-1] // 2
        if in_rows:
            halves = product(a[..., :h], b[:h]), product(a[..., h:], b[h:])
        else:
            halves = product(a[..., :h], b[:, :h]), product(a[..., h:], b[:, h:])
        return (halves[0].float() + halves[1].float()).to(a.dtype)

    return rounded


@pytest.mark.parametrize("linear, matmul, invariant", [
    ("per row", "per row", True),
    ("from 2 rows", "per row", False),
    ("from 16 rows", "per row", False),
    ("per row", "from 2 rows", False),  # the batched product of the attention
], ids=["invariant", "linear-from-2", "linear-from-16", "matmul-from-2"])
def test_rows_invariant_tells_row_invariant_products_from_others(monkeypatch, linear, matmul, invariant):
    real = {"linear": nn.functional.linear, "matmul": torch.matmul}

    def built(kind, how):
        return _per_row(real[kind]) if how == "per row" else _from_rows(real[kind], int(how.split()[1]))

    monkeypatch.setattr(nn.functional, "linear", built("linear", linear))
    monkeypatch.setattr(torch, "matmul", built("matmul", matmul))
    monkeypatch.setattr("medusa_heads.kernels.prepack.packs", lambda dtype: False)  # the stock products only
    probe = rows_invariant.__wrapped__  # uncached
    assert probe(torch.bfloat16, "cpu", ((48, 64), (64, 48))) is invariant


def _exact_gemm(self, q):
    """The int8 GEMM as defined: integer sums (exact in float64) times the weights' scales."""
    wq, _ = quantize_weight(self.weight)
    return ((q.double() - 128) @ wq.double().T * self.weight_scale.double()).float()


def _unpacked(self, weight, batch_hint):
    """Int8Linear.pack without oneDNN: the scales only (the GEMMs below compute from the weight itself)."""
    self.register_buffer("weight_scale", quantize_weight(weight)[1], persistent=False)
    self.register_buffer("zero_points", torch.zeros(self.out_features, dtype=torch.int64), persistent=False)


INT8_GEMMS = {
    "exact": (_exact_gemm, True),
    # sums through an int16 accumulator that saturates, as pairwise int16 sums without VNNI do: the same for any rows
    "saturating": (lambda self, q: _exact_gemm(self, q).div(self.weight_scale).clamp(-32768, 32767)
                   .mul(self.weight_scale), False),
    # exact up to 16 rows (8 of activations, two levels each), rounded to bf16 past them
    "row-dependent": (lambda self, q: _exact_gemm(self, q) if q.shape[0] <= 16 else
                      _exact_gemm(self, q).to(torch.bfloat16).float(), False),
}


@pytest.mark.parametrize("gemm", sorted(INT8_GEMMS))
def test_int8_rows_invariant_tells_exact_integer_sums_from_others(monkeypatch, gemm):
    fake, exact = INT8_GEMMS[gemm]
    monkeypatch.setattr("medusa_heads.kernels.int8.int8_supported", lambda: True)
    monkeypatch.setattr(Int8Linear, "pack", _unpacked)
    monkeypatch.setattr(Int8Linear, "gemm", fake)
    assert int8_rows_invariant.__wrapped__(torch.bfloat16) is exact


class _RowDependentLinear(PackedLinear):
    """A bf16 packed product whose rows depend on each other from 21 rows on (built from one-row products)."""

    def pack(self, weight, batch_hint):
        pass

    def product(self, x):
        rows = x.reshape(-1, self.in_features)
        alone = _per_row(nn.functional.linear)(rows, self.weight)
        if rows.shape[0] > 20:
            alone = _from_rows(nn.functional.linear, 1)(rows, self.weight)
        return alone.view(*x.shape[:-1], self.out_features)


def test_cap_rows_splits_a_product_where_its_rows_start_to_depend_on_each_other():
    holder = nn.Sequential(_RowDependentLinear(nn.Linear(64, 40, bias=False).to(torch.bfloat16)))
    linear = holder[0]
    x = torch.randn(100, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        alone = torch.cat([linear(x[i : i + 1]) for i in range(100)])
        assert not torch.equal(linear(x), alone)  # the product really does depend on the rows
        assert cap_rows(holder) == {("_RowDependentLinear", 40, 64, False): 16} and linear.row_cap == 16
        for m in (2, 16, 21, 32, 33, 100):
            assert torch.equal(linear(x[:m]), alone[:m]), m


@needs_packed_bf16
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


def test_every_row_of_a_large_real_bf16_verify_is_its_plain_step(real_base):
    """41 rows at once, as a batch's verify takes (rows x tree tokens): past 32 rows oneDNN's bf16 kernel on an Intel
    Xeon with AMX rounds a row otherwise, and without the split rows 33 on differ there. Bit for bit where this CPU's
    products are row-invariant, else by rounding only."""
    base = AutoModelForCausalLM.from_pretrained(real_base[0].name_or_path, dtype=torch.bfloat16).eval()
    model, problems = _load(base, prepack=PACKS_BF16)  # passed in: the row-exact attention is switched on below
    assert problems  # said at load: sdpa, or this CPU's products
    use_exact_attention(base)
    target = Target(base)
    past, n = 20, 41
    ids = torch.randint(100, 20000, (1, past + n), generator=torch.Generator().manual_seed(0))
    cache = new_cache(base, past + n + 4)
    target.prefill(ids[:, :past], cache)
    tree = target.verify(ids[0, past:], past, cache, from_parents(tuple(range(-1, n - 1)))).logits  # a chain
    crop_to(cache, past)
    steps = [target.step(ids[0, past + d : past + d + 1], past + d, cache).logits[-1] for d in range(n)]
    differ = [d for d in range(n) if not torch.equal(tree[d], steps[d])]
    if BF16_ROWS:
        assert differ == []
    else:
        assert all(float((tree[d].float() - steps[d].float()).abs().max())
                   <= ROUNDING * bf16_step(float(steps[d].float().abs().max())) for d in differ), differ


def test_bf16_with_the_row_exact_attention_is_exact_where_the_cpus_products_are_row_invariant():
    base = tiny_model().to(torch.bfloat16)
    use_exact_attention(base)
    model, problems = _load(base, prepack=PACKS_BF16)
    if BF16_ROWS:
        assert model.exact and problems == []
    else:
        assert not model.exact and len(problems) == 1 and "bf16 products give a row other bits" in problems[0]


def test_bf16_with_sdpa_says_how_to_make_it_exact(invariant_cpu):
    model, problems = _load(tiny_model().to(torch.bfloat16), prepack=PACKS_BF16)
    assert not model.exact
    assert len(problems) == 1 and "attn_implementation='medusa_exact'" in problems[0]


def _tiny_falcon():
    torch.manual_seed(0)
    config = AutoConfig.for_model("falcon", **TINY, new_decoder_architecture=True, num_kv_heads=2)
    return AutoModelForCausalLM.from_config(config).eval()


def test_a_model_that_computes_its_own_attention_is_said_not_exact(invariant_cpu, tmp_path):
    _tiny_falcon().save_pretrained(tmp_path)  # loaded by path: transformers would refuse the row-exact attention
    model, problems = _load(str(tmp_path), dtype=torch.bfloat16)
    assert not model.exact and model.base_model.config._attn_implementation == "sdpa"
    assert len(problems) == 1 and "computes its attention itself" in problems[0]
    ids = torch.tensor([[5, 9, 13, 2]])
    out = model.generate(ids, max_new_tokens=12, do_sample=False)  # still decodes
    assert out.shape[1] > ids.shape[1]


@needs_int8
def test_int8_on_a_model_with_sdpa_is_said_not_exact(invariant_cpu):
    model, problems = _load(tiny_model(), quantize="int8")  # fp32 activations, sdpa
    assert not model.exact and len(problems) == 1 and "'sdpa'" in problems[0]


def test_fp32_promises_rounding_only_and_says_nothing():
    model, problems = _load(tiny_model())
    assert not model.exact and problems == []


def test_a_checkpoint_with_attention_sinks_loads_in_bf16_on_eager_attention(invariant_cpu, tmp_path):
    from families import tiny_family

    tiny_family("gpt_oss").save_pretrained(tmp_path)  # the row-exact attention refuses sinks: it used to fail here
    model, problems = _load(str(tmp_path), dtype=torch.bfloat16)
    assert model.base_model.config._attn_implementation == "eager" and not model.exact
    assert len(problems) == 1 and "sinks" in problems[0]


def test_the_attention_counter_counts_this_threads_calls_only():
    """The load check reads it before and after its probe: a forward in another thread must not move it."""
    import threading

    from medusa_heads.kernels import exact_attention

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
