"""RMS norms on ATen's rms_norm where it gives the very bits of the model's own norm.

A decoder's RMS norm (Llama, Qwen2, Mistral, SmolLM2, ...) is six to eight small ATen ops called from Python: the
cast up, the square, the mean, the epsilon, the reciprocal square root, the product, the cast back and the weight.
On a 2-core CPU each costs a few microseconds for a decoding step's few rows, and a 30-layer model runs 61 norms a
step. `torch.nn.functional.rms_norm` on the CPU is the same ops in the same order, composed in C++: the same bits,
about 13 us less a norm (37 against 24 us for one row of 576 on an Intel Xeon).

Nothing is assumed about a model's norm: each norm module is run against the candidate forms on random inputs
(rows 1 to 33, with outlier channels), in its own dtype, and takes the first form that equals its own forward bit
for bit on every input. A norm of another form (Gemma's 1 + weight, a norm with a bias, LayerNorm) matches none
and keeps its forward. The module keeps its class, its Parameter and its state dict; only its instance `forward`
is set. Calls in another dtype than the one checked (after a later .to()) run the module's own forward.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

ROWS = (1, 2, 7, 33)


def _eps(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = module.__dict__.get(name)
        if isinstance(value, float):
            return value
    return None


def _forms(module: nn.Module, eps: float):
    """(name, form(x, weight)) for the forms an RMS norm's forward may take."""
    shape = (module._parameters["weight"].shape[0],)

    def same_dtype(x, weight):  # x * rsqrt(mean(x^2) + eps) * weight, in x's dtype (fp32 models)
        return F.rms_norm(x, shape, weight, eps)

    def upcast(x, weight):  # Llama's form for low precision: the norm in fp32, cast back, then the weight
        return weight * F.rms_norm(x.float(), shape, None, eps).to(x.dtype)

    return (("rms_norm", same_dtype), ("rms_norm in fp32", upcast))


def _probe_inputs(width: int, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    inputs = []
    for rows in ROWS:
        x = torch.randn(1, rows, width, generator=gen) * 4
        x[..., torch.randint(0, width, (3,), generator=gen)] *= 60  # a residual stream's few large channels
        inputs.append(x.to(dtype))
    return inputs


class _Fused:
    """The forward set on a norm module: `form` for calls it was checked for, the module's own otherwise."""

    def __init__(self, module: nn.Module, form, dtype: torch.dtype, name: str) -> None:
        self.module, self.form, self.dtype, self.name = module, form, dtype, name

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.module._parameters["weight"]  # read at each call: it follows the Parameter (no copy is kept)
        if x.dtype is not self.dtype or weight.dtype is not self.dtype:
            return type(self.module).forward(self.module, x)
        return self.form(x, weight)


def fuse_norms(model: nn.Module) -> int:
    """Give each RMS norm of `model` whose output ATen's rms_norm reproduces bit for bit that one op (the module
    docstring); returns how many. Idempotent; `unfuse_norms` undoes it."""
    fused = 0
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), _Fused):
            fused += 1
            continue
        weight = module._parameters.get("weight")
        eps = _eps(module)
        if ("rmsnorm" not in type(module).__name__.lower() or weight is None or weight.dim() != 1 or eps is None
                or module._parameters.get("bias") is not None or weight.device.type != "cpu"):
            continue
        own = type(module).forward
        with torch.no_grad():
            inputs = _probe_inputs(weight.shape[0], weight.dtype)
            try:
                expected = [own(module, x) for x in inputs]
            except Exception:  # noqa: BLE001 - a norm that does not take a plain tensor keeps its forward
                continue
            for name, form in _forms(module, eps):
                if all(torch.equal(form(x, weight), y) for x, y in zip(inputs, expected)):
                    module.forward = _Fused(module, form, weight.dtype, name)
                    fused += 1
                    break
    return fused


def fused_norms(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m.__dict__.get("forward"), _Fused)]


def unfuse_norms(model: nn.Module) -> int:
    """The modules' own forwards again; returns how many were fused."""
    modules = fused_norms(model)
    for m in modules:
        del m.forward
    return len(modules)
