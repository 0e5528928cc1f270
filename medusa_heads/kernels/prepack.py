"""CPU inference: run a model's nn.Linear layers through oneDNN with prepacked weights, as IPEX's `optimize` does.

Why: PyTorch's CPU builds send fp32 nn.Linear to MKL, whose small-batch GEMM is slow on some CPUs (on the AMD
EPYC this project is measured on, 8 rows cost 1.5x one row, and one row is memory-bound at half the bandwidth).
oneDNN with weights reordered once into its blocked layout is faster for one row and nearly flat up to 16 rows,
which is what a tree verify needs. The modeling code is untouched: each Linear is swapped for a module that keeps
the very same `weight` Parameter (state dict keys, tied embeddings and `get_output_embeddings().weight` stay as
they were) plus a packed copy. Inference only: the packed copy does not follow later changes to the weights.
"""
from __future__ import annotations

import functools
import os
import threading
from typing import Callable

import torch
from torch import nn

from medusa_heads.machine import is_intel


def prepack_supported() -> bool:
    """oneDNN's packed linear ops exist in this PyTorch build (x86 and aarch64 CPU builds have them)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def bf16_supported() -> bool:
    """oneDNN runs bf16 kernels on this CPU (AVX-512 bf16 or AMX; elsewhere it would emulate them, slower than fp32)."""
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return prepack_supported() and supported is not None and bool(supported())


def packs(dtype: torch.dtype) -> bool:
    """oneDNN can pack linears of this dtype on this CPU: fp32 wherever it has packed linears at all, bf16 only with
    bf16 kernels (on an AVX2-only CPU, packing a bf16 weight fails, and stock bf16 products run there instead)."""
    return prepack_supported() and (dtype == torch.float32 or (dtype == torch.bfloat16 and bf16_supported()))


class PackedLinear(nn.Module):
    """y = x W^T + b through oneDNN with W packed once; `weight` and `bias` are the original Parameters."""

    kernel = "oneDNN"  # named in repr and the step profile
    # the kernels' part of the key their cost tables are stored under (tree.adaptive.kernels_key)
    cost_kind = "prepacked"

    def __init__(self, linear: nn.Linear, batch_hint: int = 8) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.enabled = True  # False: plain nn.functional.linear (the stock kernels), for comparisons
        self.siblings: Siblings | None = None  # the product this linear shares with the others reading its input
        # at most this many rows a product (medusa_heads/kernels/exactness.py: cap_rows)
        self.row_cap: int | None = None
        self.packed_as = (linear.weight.dtype, linear.weight.device)
        with torch.no_grad():
            self.pack(linear.weight.detach(), batch_hint)

    def pack(self, weight: torch.Tensor, batch_hint: int) -> None:
        """The weight in the kernel's own layout, made once (a subclass packs for its own kernel)."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)

    def serves(self, x: torch.Tensor) -> bool:
        """Whether the packed copy computes this call: enabled, no gradient, and the dtype and device it was made for
        (a later .to() or .half() falls back to the stock product)."""
        if not self.enabled or x.requires_grad:
            return False
        weight = self._parameters["weight"]  # what self.weight gives, without Module.__getattr__ (a hot path)
        dtype, device = self.packed_as
        return x.dtype == weight.dtype == dtype and x.device == weight.device == device

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T + b on the packed copy (a subclass computes it with its own kernel)."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """product(x), in products of at most `row_cap` rows where one is set: past that many rows this CPU's kernel
        gives a row other bits than alone (bf16 on oneDNN from 33 rows on an Intel Xeon with AMX), and a verify's rows
        must be the plain steps' bit for bit."""
        cap = self.row_cap
        if cap is None or x.numel() <= cap * x.shape[-1]:
            return self.product(x)
        rows = x.reshape(-1, x.shape[-1])
        return torch.cat([self.product(rows[i : i + cap]) for i in range(0, rows.shape[0], cap)]).view(
            *x.shape[:-1], -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.serves(x):
            return nn.functional.linear(x, self.weight, self.bias)
        if self.siblings is not None:
            return self.siblings.columns(self, x)
        return self.product(x) if self.row_cap is None else self.run(x)  # no second call where nothing is capped

    def extra_repr(self) -> str:
        shared = ", one product with its siblings" if self.siblings is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self.kernel} packed{shared}")


class MklPackedLinear(PackedLinear):
    """An fp32 PackedLinear on MKL's packed SGEMM (cblas_sgemm_pack/compute, the kernel inductor's freezing picks
    for fp32 linears) instead of oneDNN's. On a 2-core Intel Xeon (AVX-512) at SmolLM2's sizes it takes 1 to 16 rows
    in 0.45-0.9x oneDNN's time (q, k and v stacked, one row: 15 against 33 us), and gives each row the same bits
    whatever the rows beside it (oneDNN's fp32 product does not for 1536 -> 576). The packed copy serves any row
    count: the product is asked for the rows it gets. Packed for 16 rows: packed for 8, 9 to 16 rows of gate and up
    took 1.3-1.4x oneDNN's time (`results/ab/fp32_kernel_ab.md`)."""

    kernel = "MKL"
    cost_kind = "prepacked-mkl"
    batch_hint = 16

    def pack(self, weight: torch.Tensor, batch_hint: int) -> None:
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, self.batch_hint)
        # the op reads only the weight's sizes (the output's columns, the leading dimension): no second copy
        self.shape_only = weight.new_zeros(()).expand(weight.shape)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        return torch.ops.mkl._mkl_linear(x, self.packed, self.shape_only, self.bias, rows)


def mkl_packs() -> bool:
    """Whether fp32 linears are packed for MKL (MklPackedLinear) rather than oneDNN: on Intel CPUs, where it was
    measured faster, with MKL's packed SGEMM in this build. MEDUSA_HEADS_FP32_KERNEL=mkl or onednn decides instead."""
    choice = os.environ.get("MEDUSA_HEADS_FP32_KERNEL", "").strip().lower()
    if choice not in ("", "mkl", "onednn"):
        raise ValueError(f"MEDUSA_HEADS_FP32_KERNEL={choice!r}: use mkl or onednn (or leave it unset)")
    available = torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    if choice or not available:
        return choice == "mkl" and available
    return is_intel()


# Linears of one module that read one input, by the names decoder layers give them: attention's q, k and v, the
# gated MLP's gate and up (Llama, Mistral, Qwen, Gemma, SmolLM and most others).
SIBLING_NAMES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

_last = threading.local()  # per thread: the last sibling product, its input, and which members have taken theirs


class Siblings:
    """One packed product for linears that read one input (q, k and v; gate and up): their weights stacked, so a
    layer makes 4 small products instead of 7, each about as costly as the larger one alone at these sizes. Each
    member returns its own columns of the product. The first member called with an input computes it; the others
    take theirs while it is the same tensor, unchanged (its version counter; tensors made under inference mode have
    none, so there each member may take its columns once). Otherwise, or in another thread, the product is made
    again. Not a Module: nothing is registered or saved, and state dicts keep the members' own weights."""

    def __init__(self, members: list[PackedLinear]) -> None:
        lead = members[0]
        with torch.no_grad():
            stacked = nn.Linear(lead.in_features, sum(m.out_features for m in members), bias=lead.bias is not None,
                                device="meta")
            stacked.weight = nn.Parameter(torch.cat([m.weight.detach() for m in members]), requires_grad=False)
            if lead.bias is not None:
                stacked.bias = nn.Parameter(torch.cat([m.bias.detach() for m in members]), requires_grad=False)
            self.kernel = type(lead)(stacked)
        self.kernel.weight = None  # the packed copy is all the product reads; the members keep the original weights
        self.sizes = [m.out_features for m in members]
        for i, m in enumerate(members):
            m.siblings, m.sibling_index, m.packed = self, i, None

    def columns(self, member: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        try:
            version = x._version
        except RuntimeError:  # an inference tensor
            version = None
        memo = getattr(_last, "memo", None)
        i = member.sibling_index
        if memo is None or memo[0] is not self or memo[1] is not x or memo[2] != version or memo[4][i]:
            kernel = self.kernel
            y = kernel.product(x) if kernel.row_cap is None else kernel.run(x)
            memo = (self, x, version, y.split(self.sizes, dim=-1), [False] * len(self.sizes))
            _last.memo = memo
        taken = memo[4]
        taken[i] = True
        if all(taken):
            _last.memo = None  # every member has its columns: hold nothing past the layer
        return memo[3][i]


def swap_modules(model: nn.Module, take: Callable[[nn.Module], bool],
                 make: Callable[[str, nn.Module], nn.Module]) -> int:
    """Each submodule `take` accepts replaced, in place, by make(its attribute name, it); returns how many. The one
    walk behind every kernel swap (prepack_linears, int8.quantize_linears, draft_int8.int8_heads)."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if take(child):
                setattr(parent, name, make(name, child))
                swapped += 1
    return swapped


def fuse_siblings(model: nn.Module) -> int:
    """Give each group of SIBLING_NAMES under one module one product (Siblings), where all are PackedLinears of one
    class, input size, dtype and device, with biases all or none; returns how many groups. Each member's columns are
    the stacked product's: for fp32 the same values as its own product up to rounding; for bf16 and int8 the same
    kernels' rows, which stay independent of the rows beside them (`rows_invariant`, `int8_rows_invariant`)."""
    groups = 0
    for parent in list(model.modules()):
        for names in SIBLING_NAMES:
            members = [getattr(parent, n, None) for n in names]
            if not all(isinstance(m, PackedLinear) and m.siblings is None for m in members):
                continue
            lead = members[0]
            if any(type(m) is not type(lead) or m.in_features != lead.in_features or m.packed_as != lead.packed_as
                   or (m.bias is None) != (lead.bias is None) for m in members):
                continue
            Siblings(members)
            groups += 1
    return groups


class PackedWeight:
    """x W^T through oneDNN for a weight that belongs to no nn.Linear (the heads' shared LM-head rows): not a
    Module, so nothing is registered or saved; `weight` stays the tensor it was given."""

    def __init__(self, weight: torch.Tensor, batch_hint: int = 8) -> None:
        self.weight = weight
        self.packed_as = (weight.dtype, weight.device)
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x weight^T, where `weight` is the owner's tensor now: once a .to() has replaced it, or for another
        dtype or device, the packed copy no longer serves and the stock product runs."""
        if weight is not self.weight or x.requires_grad or (x.dtype, x.device) != self.packed_as:
            return x @ weight.T
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


def prepack_linears(model: nn.Module, batch_hint: int = 8) -> int:
    """Swap every nn.Linear of a CPU model in fp32 or bf16 for a PackedLinear, and give siblings one product
    (`fuse_siblings`); returns how many were swapped. Raises for a model on another device or in another dtype, or a
    PyTorch without oneDNN."""
    if not prepack_supported():
        raise RuntimeError("this PyTorch build has no oneDNN packed linear (torch.ops.mkldnn._linear_pointwise)")
    mkl = mkl_packs()

    def packed(name: str, child: nn.Linear) -> PackedLinear:
        if child.weight.device.type != "cpu" or child.weight.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"prepack_linears: {name} is {child.weight.dtype} on {child.weight.device}; "
                             "only fp32 or bf16 CPU models are packed")
        if not packs(child.weight.dtype):
            raise ValueError(f"prepack_linears: {name} is bf16, and this CPU has no oneDNN bf16 kernels (they need "
                             "AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT); leave a bf16 model on the stock kernels")
        kind = MklPackedLinear if child.weight.dtype == torch.float32 and mkl else PackedLinear
        return kind(child, batch_hint)

    swapped = swap_modules(model, lambda child: type(child) is nn.Linear, packed)
    fuse_siblings(model)
    from medusa_heads.kernels.exactness import cap_rows

    cap_rows(model)
    return swapped


def pack_weight(weight: torch.Tensor, batch_hint: int = 8) -> PackedWeight | None:
    """A PackedWeight for a CPU weight oneDNN packs here (fp32, or bf16 with bf16 kernels: `packs`); None (the
    plain product) for any other."""
    if weight.device.type != "cpu" or not packs(weight.dtype):
        return None
    return PackedWeight(weight, batch_hint)


def prepack_heads(heads: nn.Module, batch_hint: int = 8) -> int:
    """prepack_linears for MedusaHeads, plus the products that belong to no Linear (scoring through the shared
    LM-head rows, the joint context projections): drafting is a few rows per level, where the stock kernels are
    slowest. Heads in a dtype this CPU cannot pack (bf16 without bf16 kernels) keep the stock products. Drafts only:
    exactness never depends on it."""
    if not packs(next(heads.parameters()).dtype):
        heads.use_kernels(None)
        return 0
    swapped = prepack_linears(heads, batch_hint)
    heads.use_kernels(functools.partial(pack_weight, batch_hint=batch_hint))
    return swapped


class stock_kernels:
    """`with stock_kernels(model):` runs a prepacked model's linears on the stock kernels again (for baselines)."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, PackedLinear)]

    def __enter__(self) -> "stock_kernels":
        for m in self.layers:
            m.enabled = False
        return self

    def __exit__(self, *exc) -> None:
        for m in self.layers:
            m.enabled = True


def is_prepacked(model: nn.Module) -> bool:
    """Whether the model's linears run on packed kernels now (not inside `stock_kernels`)."""
    return any(isinstance(m, PackedLinear) and m.enabled for m in model.modules())
