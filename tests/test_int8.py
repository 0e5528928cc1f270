"""int8 made exact: weights per channel, activations per row, summed in int32 by oneDNN (medusa_heads/kernels/int8.py), so a
tree verify's every row is the int8 model's plain step bit for bit, and greedy output equals its plain greedy
decoding token for token.

That rests on this CPU's int8 sums being exact and row-invariant (`int8_rows_invariant`), and, in bf16, on its bf16
products being row-invariant (`rows_invariant`). Where they are, the tests below check bit for bit; where they are
not, the weaker promise of tests/test_exact.py (a warning at load, `model.exact` False, rounding only, near-ties only)
and that the probe's no has a cause measured on this CPU's kernel."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from medusa_heads import MedusaModel
from medusa_heads.kernels.exact_attention import NAME, rows_invariant, use_exact_attention, uses_exact_attention
from medusa_heads.kernels.int8 import LO_STEPS, Int8Linear, int8_rows_invariant, int8_supported, is_int8, quantize_linears, quantize_rows, quantize_weight
from medusa_heads.kernels.prepack import bf16_supported, is_prepacked, stock_kernels
from medusa_heads.machine import find_cost, kernels_key

from conftest import randomize_heads, tiny_model
from test_exact import assert_greedy_is_plain_greedy, assert_rows_keep_the_promise, load, rows_that_differ

INT8_ROWS = int8_supported() and int8_rows_invariant(torch.bfloat16)
EXACT = INT8_ROWS and rows_invariant(torch.bfloat16)  # int8 in bf16 with the row-exact attention
needs_int8 = pytest.mark.skipif(not int8_supported(), reason="this PyTorch build has no oneDNN int8 linear")


def int8_memo():
    """The levels the last int8 linear of this thread quantised (what its siblings would reuse)."""
    from medusa_heads.kernels import int8

    return int8._last.memo[2]


def int8_model(arch: str = "llama", seed: int = 0, attention: str = NAME):
    base = tiny_model(arch, seed=seed).to(torch.bfloat16)
    if attention == NAME:
        use_exact_attention(base)
    else:
        base.set_attn_implementation(attention)
    quantize_linears(base)
    return base


@needs_int8
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_row_is_the_same_bits_whatever_rows_are_beside_it_where_the_probe_says_so(dtype):
    """Where int8_rows_invariant says yes, a row's bits never depend on the rows beside it and the GEMM is the integer
    product; where it says no, one of the two fails on this CPU's kernel."""
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(48, 80, bias=True).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(80, 48, generator=g))
    layer = Int8Linear(lin)
    x = (torch.randn(24, 48, generator=g) * 4).to(dtype)
    with torch.no_grad():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(24)])
        rows_invariant_here = all(torch.equal(layer(x[:m]), alone[:m]) for m in (2, 7, 16, 24)) and torch.equal(
            layer(x.view(2, 12, 48)), alone.view(2, 12, 80))  # leading dimensions are rows too
        q, _ = quantize_rows(x)
        integer = (q.double() - 128) @ quantize_weight(lin.weight)[0].double().T  # exact in float64
        sums_exact = torch.allclose(layer.gemm(q).double(), integer * layer.weight_scale.double(), rtol=1e-6, atol=0)
    if int8_rows_invariant(dtype):
        assert rows_invariant_here and sums_exact
    else:
        assert not (rows_invariant_here and sums_exact)


@needs_int8
def test_the_product_is_the_integer_product_times_the_scales():
    """What the kernel must compute, from the quantised integers of both levels (an int16 pairwise sum, as without
    VNNI, would saturate and fail this); and within int8 weights' error of the float product. The quantisation
    itself is checked on any CPU; the kernel's sums where int8_rows_invariant says they are exact."""
    g = torch.Generator().manual_seed(1)
    lin = nn.Linear(256, 64, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(64, 256, generator=g))
    x = torch.randn(8, 256, generator=g) * 10
    x[3] = 0  # an all-zero row quantises to zeros, not NaN
    with torch.no_grad():
        y = Int8Linear(lin)(x)
        ref = lin(x)
    q, s = quantize_rows(x)
    wq, ws = quantize_weight(lin.weight)
    assert q.shape == (16, 256) and q[3].eq(128).all() and q[11].eq(128).all() and q.min() >= 1  # both levels of row 3
    rebuilt = s * ((q[:8].float() - 128) + (q[8:].float() - 128) / LO_STEPS)  # two levels: about 15 bits of the row
    assert float((rebuilt - x).abs().max() / x.abs().max()) < 2e-5
    if int8_rows_invariant(torch.float32):
        levels = (q.double() - 128) @ wq.double().T  # the integer products of q_hi (rows 0-7) and q_lo (rows 8-15)
        exact = (levels[:8] + levels[8:] / LO_STEPS) * s.double() * ws.double() + lin.bias.double()
        torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-4)
        assert float((y - ref).norm() / ref.norm()) < 0.01  # int8 weights: about 0.4% here


@needs_int8
def test_siblings_share_the_rows_of_one_input_and_never_a_changed_one():
    """q, k and v read one input: the second quantises nothing, and gives what it gives alone; an input changed in
    place since (its version counter) is quantised again."""
    g = torch.Generator().manual_seed(2)
    a, b = (Int8Linear(nn.Linear(32, 16).requires_grad_(False)) for _ in range(2))
    x = torch.randn(3, 32, generator=g)
    with torch.no_grad():
        alone = b(x.clone())
        a(x)
        q_then = int8_memo()
        assert torch.equal(b(x), alone) and int8_memo() is q_then  # shared
        x.mul_(2)
        assert torch.equal(b(x), b(x.clone())) and int8_memo() is not q_then  # changed: quantised anew


@needs_int8
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biased q, k and v projections
def test_every_tree_row_is_its_plain_step(arch):
    rows = rows_that_differ(int8_model(arch))
    assert rows.total > 30
    assert_rows_keep_the_promise(rows, EXACT)


@needs_int8
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_greedy_is_its_plain_greedy(arch):
    """The int8 model's own plain greedy decoding is the reference, and a twin quantised alike on transformers' eager
    attention a second one, that shares no attention code with the verify (near-ties only)."""
    base = tiny_model(arch).to(torch.bfloat16)
    use_exact_attention(base)
    model, problems = load(base, tree="cpu-16", quantize="int8")
    randomize_heads(model)
    assert is_int8(base) and isinstance(base.lm_head, Int8Linear)  # quantised in place, LM head included
    assert model.exact == EXACT and (problems == []) == EXACT
    assert_greedy_is_plain_greedy(base, model, EXACT, eager=int8_model(arch, attention="eager"), prompts=4)


@needs_int8
def test_every_tree_row_of_the_real_model_is_its_plain_step():
    """SmolLM2's int8 linears at their real sizes (the LM head's 49,152 rows included). Long contexts are the
    attention's part, the same as in bf16: tests/test_exact.py checks them up to 1,024 tokens."""
    from medusa_heads import default_model_path
    from medusa_heads.kernels.exact_attention import register
    from medusa_heads.loading import load_base

    base = load_base(default_model_path(), dtype=torch.bfloat16, attn_implementation=register(), prepack=False)
    quantize_linears(base)
    rows = rows_that_differ(base, trees=3, seed=2, vocab=20000, contexts=(16, 129, 300))
    assert rows.total >= 9
    assert_rows_keep_the_promise(rows, EXACT)


@needs_int8
def test_from_pretrained_loads_int8_in_bf16_with_the_exact_attention_where_the_cpu_runs_them(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "m")
    model = MedusaModel.from_pretrained(tmp_path / "m", heads=None, quantize="int8")
    base = model.base_model
    linears = [m for m in base.modules() if isinstance(m, nn.Linear)]
    assert not linears and is_int8(base)  # every projection and the LM head
    assert base.dtype == (torch.bfloat16 if bf16_supported() else torch.float32)  # bf16 where oneDNN runs it
    assert uses_exact_attention(base) == (base.dtype == torch.bfloat16 and rows_invariant(torch.bfloat16))
    assert model.exact == (EXACT and base.dtype == torch.bfloat16)  # fp32 activations: the stock attention
    assert kernels_key(base, True) == f"int8-{str(base.dtype).removeprefix('torch.')}-cpu"
    if base.dtype == torch.bfloat16:
        # not calibrated as int8: the bf16 prepacked table sizes its trees; its own table comes first
        assert find_cost({"prepacked-bfloat16-cpu-x": 1}, base, True) == "prepacked-bfloat16-cpu-x"
        assert find_cost({"prepacked-bfloat16-cpu-x": 1, "int8-bfloat16-cpu-y": 2}, base, True) == "int8-bfloat16-cpu-y"
        with stock_kernels(base):
            assert not is_int8(base) and kernels_key(base, is_prepacked(base)) == "stock-bfloat16-cpu"


@needs_int8
def test_a_cpu_whose_int8_sums_are_not_exact_is_warned_of_and_not_exact(monkeypatch):
    """Even where the load check's small probe finds no row that differs: the probe cannot see a kernel that changes
    past its rows, and the int8 products are split nowhere."""
    for module in ("medusa_heads.model", "medusa_heads.kernels.int8"):
        monkeypatch.setattr(f"{module}.int8_rows_invariant", lambda dtype: False)
    base = tiny_model("llama").to(torch.bfloat16)
    use_exact_attention(base)
    with pytest.warns(UserWarning, match="int8 products are not exact integer sums"):
        model = MedusaModel.from_pretrained(base, heads=None, quantize="int8")
    assert not model.exact


def test_an_unknown_quantisation_is_one_line_before_the_model_loads(tmp_path):
    with pytest.raises(ValueError, match=r"quantize='int4': the one quantisation is 'int8'"):
        MedusaModel.from_pretrained(tmp_path / "nothing-here", heads=None, quantize="int4")
