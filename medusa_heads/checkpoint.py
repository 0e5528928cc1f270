"""The one save/load path for heads: config.json + heads.safetensors, strict keys and shapes."""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from .config import MedusaConfig
from .heads import MedusaHeads

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "heads.safetensors"


def base_fingerprint(base: PreTrainedModel) -> dict:
    """What heads must match: architecture, sizes, and a hash of the LM head (taken in bf16, so an fp32
    and a bf16 load of the same weights agree)."""
    weight = base.get_output_embeddings().weight.detach()
    digest = hashlib.sha256(weight.to(device="cpu", dtype=torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return {
        "architecture": type(base).__name__,
        "hidden_size": weight.shape[1],
        "vocab_size": weight.shape[0],
        "lm_head_sha256": digest.hexdigest(),
    }


def check_fingerprint(config: MedusaConfig, base: PreTrainedModel, allow_mismatch: bool = False) -> None:
    """Refuse heads trained for another base (sizes always; architecture and LM-head hash unless allowed)."""
    weight = base.get_output_embeddings().weight
    if (config.vocab_size, config.hidden_size) != tuple(weight.shape):
        raise ValueError(
            f"heads expect vocab_size={config.vocab_size}, hidden_size={config.hidden_size}, but the base model's "
            f"LM head is {tuple(weight.shape)} (vocab_size, hidden_size)"
        )
    if config.base_fingerprint is None or allow_mismatch:
        return
    have = base_fingerprint(base)
    for key in ("architecture", "lm_head_sha256"):
        if config.base_fingerprint.get(key) != have[key]:
            raise ValueError(
                f"these heads were trained for another base model ({key}: heads {config.base_fingerprint.get(key)!r}, "
                f"base {have[key]!r}); pass allow_base_mismatch=True to use them anyway"
            )


def _atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_heads(directory: str | os.PathLike, heads: MedusaHeads, config: MedusaConfig | None = None) -> Path:
    """Write config.json and heads.safetensors (each atomically). The shared base LM head is never saved."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = config or heads.config
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in heads.state_dict().items()}
    _atomic_write(out / WEIGHTS_NAME, lambda p: save_file(tensors, p, metadata={"format": "medusa-heads"}))
    _atomic_write(out / CONFIG_NAME, config.save)
    return out


def save_config(directory: str | os.PathLike, config: MedusaConfig) -> None:
    """Rewrite a heads directory's config.json atomically (e.g. after calibration chose its tree)."""
    _atomic_write(Path(directory) / CONFIG_NAME, config.save)


def load_config(directory: str | os.PathLike) -> MedusaConfig:
    d = Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(f"heads directory {d} does not exist")
    if not (d / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"heads directory {d} has no {CONFIG_NAME}")
    return MedusaConfig.load(d / CONFIG_NAME)


def load_heads(directory: str | os.PathLike, lm_head_weight: torch.Tensor, config: MedusaConfig | None = None) -> MedusaHeads:
    """Build heads from a directory, with strict key and shape checks. Loads safetensors only."""
    d = Path(directory)
    config = config or load_config(d)
    if not (d / WEIGHTS_NAME).is_file():
        raise FileNotFoundError(f"heads directory {d} has no {WEIGHTS_NAME}")
    heads = MedusaHeads(config, lm_head_weight)
    state = load_file(d / WEIGHTS_NAME)
    expected = heads.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{d / WEIGHTS_NAME}: missing keys {missing}, unexpected keys {unexpected}")
    for key, tensor in state.items():
        if tensor.shape != expected[key].shape:
            raise ValueError(
                f"{d / WEIGHTS_NAME}: {key} has shape {tuple(tensor.shape)}, the config implies {tuple(expected[key].shape)}"
            )
    heads.load_state_dict(state, strict=True)
    return heads
