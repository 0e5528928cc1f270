"""Facts about the machine at hand, and the keys that name the kernels a target runs on it.

The lowest layer: anything may import it, and it imports nothing of the project's. Cost tables are stored per key
("prepacked-float32-cpu-avx512"): what the kernels are, and what they run on."""
from __future__ import annotations

import platform
import re
from pathlib import Path

import torch


def cpuinfo(field: str) -> str | None:
    """The first value of `field` in /proc/cpuinfo ("model name", "vendor_id", "flags"), whitespace collapsed; None
    where the file or the field is missing."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, sep, value = line.partition(":")
            if sep and name.strip() == field:
                return " ".join(value.split())
    except OSError:
        pass
    return None


def cpu_name() -> str:
    return cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    return set((cpuinfo("flags") or "").split())


def is_intel() -> bool:
    return cpuinfo("vendor_id") == "GenuineIntel"


def isa() -> str:
    """The CPU's vector ISA as ATen dispatches it ("avx2", "avx512", "avx512_amx")."""
    return torch.backends.cpu.get_cpu_capability().lower()


def hardware(device: torch.device) -> str:
    """What the same kernels run on: a CPU's vector ISA (the AVX2 fp32 GEMM works on blocks of 6 rows and reads the
    weights at other rates, so the verify's cost by tree size has another shape), a GPU's name ("nvidia-h200"); ""
    where neither is known."""
    if device.type == "cpu":
        return isa()
    if device.type == "cuda":
        return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")
    return ""


def kernels_key(model: torch.nn.Module, prepacked: bool) -> str:
    """The kernels a transformers model's verify runs: "<prepacked|prepacked-mkl|stock|int8>-<dtype>-<device type>"
    (a packed linear names its kind in `cost_kind`: kernels/prepack.py, kernels/int8.py)."""
    param = next(model.parameters())
    kind = "stock"
    if prepacked:  # a model packs all its linears alike
        kind = next((m.cost_kind for m in model.modules()
                     if getattr(m, "cost_kind", None) and getattr(m, "enabled", True)), "prepacked")
    return f"{kind}-{str(param.dtype).removeprefix('torch.')}-{param.device.type}"


def cost_key(model: torch.nn.Module, prepacked: bool) -> str:
    """The key `calibrate` stores a cost model under: "<kernels_key>-<hardware>" ("prepacked-float32-cpu-avx2")."""
    kernels, where = kernels_key(model, prepacked), hardware(next(model.parameters()).device)
    return f"{kernels}-{where}" if where else kernels


def find_cost(costs: dict, model: torch.nn.Module, prepacked: bool) -> str | None:
    """The stored cost model (its key in `costs`) for this model's kernels, best first: measured on this hardware;
    stored without hardware; the same kernels on other hardware (the first key in sorted order: a tree from another
    machine's costs is still lossless, only sized less well). None: not calibrated for these kernels. An int8 model
    not calibrated as such takes its dtype's prepacked table (small products bound by overhead, nearly flat in the
    tree's size), and so does an fp32 model on MKL's packed products (oneDNN's table). Deterministic for a machine,
    so a seed reproduces a sample."""
    exact, kernels = cost_key(model, prepacked), kernels_key(model, prepacked)
    tries = [(exact, kernels)]
    for kind in ("int8-", "prepacked-mkl-"):
        if kernels.startswith(kind):
            tries.append(tuple(k.replace(kind, "prepacked-", 1) for k in (exact, kernels)))
    for exact, kernels in tries:
        for key in (exact, kernels):
            if key in costs:
                return key
        found = next((k for k in sorted(costs) if k.startswith(kernels + "-")), None)
        if found is not None:
            return found
    return None
