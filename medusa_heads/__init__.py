"""medusa-heads: lossless Medusa-style speculative decoding for HuggingFace causal LMs."""
from medusa_heads.config import MedusaConfig
from medusa_heads.heads import MedusaHeads, ResBlock
from medusa_heads.model import MedusaGenerateOutput, MedusaModel
from medusa_heads.default_model import DEFAULT_MODEL, default_heads_path, default_model_path
from medusa_heads.prompting import prompt_ids

__all__ = [
    "DEFAULT_MODEL",
    "MedusaConfig",
    "MedusaGenerateOutput",
    "MedusaHeads",
    "MedusaModel",
    "ResBlock",
    "default_heads_path",
    "default_model_path",
    "prompt_ids",
]
__version__ = "0.1.0"
