"""Token trees: specs, buffers built once per spec, and calibration. Pure tensor code, no model."""
from .buffers import TreeBuffers, build_buffers
from .spec import TreeSpec, list_presets, load_tree

__all__ = ["TreeBuffers", "TreeSpec", "build_buffers", "list_presets", "load_tree"]
