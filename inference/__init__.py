"""Inference: propose -> verify -> accept -> commit."""
from .decode import DecodeStats, decode
from .propose import Drafter, HeadsDrafter
from .verify import Target

__all__ = ["DecodeStats", "Drafter", "HeadsDrafter", "Target", "decode"]
