"""Weight-only int8 products for the heads' drafting on a CPU.

A drafting level is a few rows through each head's block and the shared LM-head rows, so its products are bound
by reading the weights, and between two levels the target's step has streamed its own weights through the caches
(a llama.cpp Q8_0 step of SmolLM2-135M reads 145 MB): the heads' weights come from memory every step. Here each
weight is stored once in int8 per output channel (symmetric, `kernels.int8.quantize_weight`), a quarter of fp32's
bytes, and multiplied by PyTorch's weight-only int8 kernel (`torch._weight_int8pack_mm`, bf16 activations; the
kernel gpt-fast's int8 mode runs), whose result comes back in the heads' dtype. Drafts only: the heads' guesses may
change a little, never the output, which the target's verify decides."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from medusa_heads.kernels.int8 import quantize_weight
from medusa_heads.kernels.prepack import PackedLinear, swap_modules

INT8 = torch.int8  # the draft_dtype that asks for these products (from_pretrained, --draft-dtype int8)


def draft_int8_supported() -> bool:
    """This PyTorch build has the CPU weight-only int8 product."""
    return hasattr(torch, "_weight_int8pack_mm")


K_BLOCK = 16  # the kernel's AVX-512 path reads the inner dimension in blocks of 16 and dies past a partial one


def _int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 weight, its inner dimension zero-padded to a multiple of K_BLOCK, and its per-row scales."""
    q, scale = quantize_weight(weight)
    return F.pad(q, (0, -q.shape[1] % K_BLOCK)).contiguous(), scale.to(torch.bfloat16)


def _product(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    if rows.shape[1] != q.shape[1]:  # the padded columns multiply zeros: the sums are unchanged
        rows = F.pad(rows, (0, q.shape[1] - rows.shape[1]))
    return torch._weight_int8pack_mm(rows, q, scale).to(x.dtype).view(*x.shape[:-1], q.shape[0])


class Int8DraftLinear(PackedLinear):
    """A heads' nn.Linear on weight-only int8 (`weight` and `bias` stay the original Parameters)."""

    kernel = "int8 weight-only"

    def pack(self, weight: torch.Tensor, batch_hint: int) -> None:
        self.q, self.scale = _int8(weight)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        y = _product(x, self.q, self.scale)
        return y if self.bias is None else y + self.bias


class Int8DraftWeight:
    """x W^T on weight-only int8 for a weight that belongs to no nn.Linear (the shared LM-head rows, the joint
    context projections); the stock product once the owner's tensor has been replaced (a .to())."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.packed_as = (weight.dtype, weight.device)
        self.q, self.scale = _int8(weight)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if weight is not self.weight or x.requires_grad or (x.dtype, x.device) != self.packed_as:
            return x @ weight.T
        return _product(x, self.q, self.scale)


def int8_heads(heads: nn.Module) -> int:
    """Every product of CPU heads (MedusaHeads) on weight-only int8; returns how many nn.Linear were swapped. The
    heads stay in their dtype (fp32 or bf16) for everything else."""
    if not draft_int8_supported():
        raise RuntimeError("this PyTorch build has no weight-only int8 product (torch._weight_int8pack_mm): "
                           "draft in fp32 or bf16")
    def quantized(name: str, child: nn.Linear) -> Int8DraftLinear:
        if child.weight.device.type != "cpu":
            raise ValueError(f"int8 drafting runs on a CPU; the heads' {name} is on {child.weight.device}")
        return Int8DraftLinear(child)

    swapped = swap_modules(heads, lambda child: type(child) is nn.Linear, quantized)
    heads.use_kernels(_weight_kernel)
    return swapped


def _weight_kernel(weight: torch.Tensor) -> Int8DraftWeight | None:
    return Int8DraftWeight(weight) if weight.device.type == "cpu" else None
