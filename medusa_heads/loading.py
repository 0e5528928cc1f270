"""The one way a base model is loaded: from_pretrained, the commands, the trainers and the scripts all come here."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from medusa_heads.default_model import DEFAULT_MODEL, check_model_name, resolve_model  # noqa: F401 (check_model_name: its old home)
from medusa_heads.kernels.prepack import packs, prepack_linears


def is_gguf(name: str | os.PathLike) -> bool:
    return str(name).endswith(".gguf") and Path(name).is_file()


def source(name: str | os.PathLike) -> str | Path:
    """The default model's name -> its converted directory; a GGUF file as it is; anything else, checked, as given."""
    if is_gguf(name):
        return Path(name)
    check_model_name(name)
    return resolve_model(str(name))


def load_base(name: str | os.PathLike = DEFAULT_MODEL, *, dtype: torch.dtype = torch.float32,
              prepack: bool | None = None, frozen: bool = True, **kwargs) -> PreTrainedModel:
    """A causal LM by name (the embedded default's, a local directory or a hub id), in eval mode, frozen unless
    `frozen=False` (joint training adapts it). prepack: run its linears through oneDNN
    (medusa_heads/kernels/prepack.py); None = on when it lands on a CPU that packs its dtype (`packs`). kwargs go to
    AutoModelForCausalLM.from_pretrained."""
    where = source(name)
    if is_gguf(name):  # dequantised by transformers' GGUF loader
        where, kwargs = Path(name).parent, {**kwargs, "gguf_file": Path(name).name}
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **kwargs).eval()
    except OSError as e:  # transformers' "is not a local folder and is not a valid model identifier ..."
        raise FileNotFoundError(f"cannot load a model from {str(name)!r}: give a model directory saved by "
                                f"transformers, a hub id, or {DEFAULT_MODEL!r} ({e.__class__.__name__}: "
                                f"{str(e).splitlines()[0]})") from e
    if frozen:
        model.requires_grad_(False)
    if prepack is None:
        prepack = model.device.type == "cpu" and packs(model.dtype)
    if prepack:
        prepack_linears(model)
    return model


def load_tokenizer(name: str | os.PathLike = DEFAULT_MODEL):
    if is_gguf(name):
        return AutoTokenizer.from_pretrained(Path(name).parent, gguf_file=Path(name).name)
    return AutoTokenizer.from_pretrained(source(name))
