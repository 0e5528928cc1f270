"""Int8 linears for CPU inference whose rows do not depend on the rows beside them: exact by construction.

Each linear's weight is quantised once, per output channel, symmetric (w = s_w * q_w, q_w in [-127, 127]). At each
call each row of its input is quantised on its own maximum, in two int8 levels: q_hi, the row in 255 steps, and
q_lo, what q_hi leaves out in 254 finer steps, so x = s_x * (q_hi + q_lo / 254) to about 15 bits. Both levels go
through oneDNN's int8 GEMM (`torch.ops.onednn.qlinear_pointwise`, the kernel PyTorch's own x86 int8 path lowers to:
VNNI or AMX) as rows of one product, which sums q q_w in int32. Integer sums are exact, so the order a kernel adds
in, which changes with the number of rows, cannot change a bit; everything else is per element (the row's max, the
rounding, the scales). A tree row's logits are therefore a plain step's, bit for bit, and greedy output equals the
int8 model's own plain greedy decoding. `int8_rows_invariant` checks the one assumption (int32 sums without
saturation) on the machine at hand.

Why two levels: one int8 level per row is coarse wherever a few channels are much larger than the rest (SmolLM2's
top token agreed with fp32's at 92% of positions, KL 0.030); with two, the error is the weights' alone, as
weight-only int8 and llama.cpp's Q8_0 (97%, KL 0.004: `results/transformers/int8/quality.md`), for one GEMM of
twice the rows, which costs about the same on these small products, and a few more small ops.

What stays in the model's dtype (bf16, or fp32 where the CPU has no bf16 kernels): embeddings, norms, attention (the
row-exact attention in bf16), the heads. The original weights stay too (tied embeddings, the heads' shared LM-head
rows, `stock_kernels` baselines): this mode is about exact int8 products, not memory.
"""
from __future__ import annotations

import functools
import threading

import torch
from torch import nn

from medusa_heads.kernels.invariance import COUNTS, rows_change_at
from medusa_heads.kernels.prepack import PackedLinear, fuse_siblings, swap_modules

ZERO_POINT = 128  # oneDNN takes unsigned activations: q_x + 128 in uint8, and the kernel subtracts it back


def int8_supported() -> bool:
    """This PyTorch build has oneDNN's int8 linear for CPUs."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops, "onednn")
            and hasattr(torch.ops.onednn, "qlinear_pointwise") and hasattr(torch.ops.onednn, "qlinear_prepack"))


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, fp32 scale per output channel): symmetric, round to nearest."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


LO_STEPS = 254  # q_lo's steps per step of q_hi


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (rows, in) -> (uint8 (2 rows, in): q_hi + 128 above q_lo + 128, fp32 scale per row s_x), with
    x = s_x * (q_hi + q_lo / 254) up to half a step of q_lo. q_hi is the row times 127 over its absolute maximum,
    rounded half up; q_lo is the remainder in 254 steps. Every op is per row or per element, so a row's bits never
    depend on the others (a product with 127 / max, not a quotient by max / 127: ATen divides a single row by its
    one divisor as a product with the reciprocal, and several rows by true division)."""
    c = _CONSTANTS  # fp32 tensors for the Python numbers: ATen converts a number to a tensor at every op otherwise
    top = x.abs().amax(dim=-1, keepdim=True).float().clamp_min_(1e-30)
    t = torch.mul(x, top.reciprocal().mul_(c["127"])).add_(c["zero+.5"])  # fp32, never x itself; in [1.5, 255.5]
    hi = t.floor()  # q_hi + 128, exact small integers
    lo = t.sub_(hi).mul_(c["lo steps"]).add_(c["lo offset"])  # q_lo + 128 + a fraction, truncated below
    return torch.cat((hi, lo)).to(torch.uint8), top.div_(c["127"])


# 127 / top is top.reciprocal() * 127 (as Python's division by a tensor is), and dividing by a one-element CPU tensor
# is the same product with its reciprocal as dividing by the number: the same ops and bits as with the numbers
_CONSTANTS = {name: torch.tensor(value, dtype=torch.float32) for name, value in (
    ("127", 127.0), ("zero+.5", ZERO_POINT + 0.5), ("lo steps", float(LO_STEPS)),
    ("lo offset", ZERO_POINT + 0.5 - LO_STEPS / 2))}


_last = threading.local()  # per thread: the input the last Int8Linear quantised, its version, and its levels


def rows_of(x: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows of x's rows, reused when the int8 linear before this one, in this thread, quantised this very
    tensor unchanged since (its version counter): the q, k and v projections read one input, as do gate and up, so
    a layer quantises 4 inputs instead of 7. Tensors made under inference mode keep no version counter; theirs are
    quantised at every call."""
    tracked = not torch.is_inference(x)
    if tracked:
        memo = getattr(_last, "memo", None)
        if memo is not None and memo[0] is x and memo[1] == x._version:
            return memo[2], memo[3]
    q, scale = quantize_rows(x.reshape(-1, in_features))
    if tracked:
        _last.memo = (x, x._version, q, scale)
    return q, scale


class Int8Linear(PackedLinear):
    """y = x W^T + b through oneDNN's int8 GEMM, each row of the activations quantised in two levels at each call
    (see the module's docstring). `weight` and `bias` stay the original Parameters; `enabled = False`
    (`stock_kernels`) runs the stock product on them instead."""

    cost_kind = "int8"

    def pack(self, weight: torch.Tensor, batch_hint: int) -> None:
        q, scale = quantize_weight(weight)
        self.packed = torch.ops.onednn.qlinear_prepack(q, None)
        self.register_buffer("weight_scale", scale, persistent=False)
        self.register_buffer("zero_points", torch.zeros(self.out_features, dtype=torch.int64), persistent=False)

    def gemm(self, q: torch.Tensor) -> torch.Tensor:
        """The int8 GEMM of uint8 rows (quantize_rows' levels) with the weights: fp32 sums times the weights' scales."""
        return torch.ops.onednn.qlinear_pointwise(q, 1.0, ZERO_POINT, self.packed, self.weight_scale, self.zero_points,
                                                  None, 1.0, 0, torch.float32, "none", [], "")

    def product(self, x: torch.Tensor) -> torch.Tensor:
        q, scale = rows_of(x, self.in_features)
        y = self.gemm(q)
        n = scale.shape[0]
        y = torch.add(y[:n], y[n:], alpha=1 / LO_STEPS).mul_(scale)
        if self.bias is not None:
            y = y.add_(self.bias.float())
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                "int8 weights, two-level int8 rows (oneDNN)"
                + (", one product with its siblings" if self.siblings is not None else ""))


def quantize_linears(model: nn.Module) -> int:
    """Swap every nn.Linear (or PackedLinear) of a CPU model in bf16 or fp32 for an Int8Linear, siblings sharing one
    product (`fuse_siblings`); returns how many.
    Raises for a model on another device or in another dtype, or a PyTorch without oneDNN's int8 linear."""
    if not int8_supported():
        raise RuntimeError("this PyTorch build has no oneDNN int8 linear (torch.ops.onednn.qlinear_pointwise): "
                           "use dtype bf16 or fp32")
    def quantized(name: str, child: nn.Module) -> Int8Linear:
        if child.weight.device.type != "cpu" or child.weight.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"int8: {name} is {child.weight.dtype} on {child.weight.device}; only bf16 or fp32 "
                             "CPU models are quantised")
        return Int8Linear(child)

    swapped = swap_modules(model, lambda child: type(child) is nn.Linear or (
        isinstance(child, PackedLinear) and not isinstance(child, Int8Linear)), quantized)
    fuse_siblings(model)
    return swapped


def is_int8(model: nn.Module) -> bool:
    """Whether the model's linears run on int8 kernels now (not inside `stock_kernels`)."""
    return any(isinstance(m, Int8Linear) and m.enabled for m in model.modules())


@functools.cache
def int8_rows_invariant(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this machine's int8 linear gives a row the same bits whatever the rows beside it (1 to 32), and the
    integer product exactly: the one assumption behind int8's exactness (an int16 pairwise sum, as on AVX2 without
    VNNI, saturates; invariance.rows_change_at)."""
    if not int8_supported():
        return False
    gen = torch.Generator().manual_seed(0)
    for out_f, in_f in ((576, 576), (1536, 576), (576, 1536), (64, 64)):
        lin = nn.Linear(in_f, out_f, bias=False).to(dtype)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(out_f, in_f, generator=gen))
        layer = Int8Linear(lin)
        x = (torch.randn(32, in_f, generator=gen) * 3).to(dtype)
        with torch.inference_mode():
            if rows_change_at(layer, x, COUNTS) is not None:
                return False
            q, _ = quantize_rows(x)
            wq, _ = quantize_weight(lin.weight)
            exact = (q.double() - ZERO_POINT) @ wq.double().T  # |sums| < 2^53: exact in float64
            if not torch.allclose(layer.gemm(q).double(), exact * layer.weight_scale.double(), rtol=1e-6, atol=0):
                return False  # more than fp32 rounding: the sums were not exact
    return True
