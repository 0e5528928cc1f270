"""medusa-heads: lossless Medusa-style speculative decoding for HuggingFace causal LMs."""
from .config import MedusaConfig
from .heads import MedusaHeads, ResBlock
from .model import MedusaGenerateOutput, MedusaModel
from .models import DEFAULT_MODEL, default_heads_path, default_model_path

__all__ = [
    "DEFAULT_MODEL",
    "MedusaConfig",
    "MedusaGenerateOutput",
    "MedusaHeads",
    "MedusaModel",
    "ResBlock",
    "default_heads_path",
    "default_model_path",
]
__version__ = "0.1.0"
