"""medusa-heads: lossless Medusa-style speculative decoding for HuggingFace causal LMs.

The names below are imported on first use, so that `import medusa_heads.cli` (and `medusa-heads --help`) does not
import torch and transformers."""
from importlib import import_module

_WHERE = {
    "DEFAULT_MODEL": "medusa_heads.default_model",
    "MedusaConfig": "medusa_heads.config",
    "MedusaGenerateOutput": "medusa_heads.model",
    "MedusaHeads": "medusa_heads.heads",
    "MedusaModel": "medusa_heads.model",
    "ResBlock": "medusa_heads.heads",
    "default_heads_path": "medusa_heads.default_model",
    "default_model_path": "medusa_heads.default_model",
    "prompt_ids": "medusa_heads.prompting",
}

__all__ = sorted(_WHERE)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'medusa_heads' has no attribute {name!r}")
    value = getattr(import_module(_WHERE[name]), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
