"""Inference: propose -> verify -> accept -> commit."""
from medusa_heads.inference.decode import DecodeStats, decode
from medusa_heads.inference.propose import Drafter, HeadsDrafter
from medusa_heads.engines.hf import Target

__all__ = ["DecodeStats", "Drafter", "HeadsDrafter", "Target", "decode"]
