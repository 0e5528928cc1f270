"""Token trees: specs, buffers built once per spec, and calibration. Pure tensor code, no model."""
from medusa_heads.tree.buffers import TreeBuffers, build_buffers
from medusa_heads.tree.spec import TreeSpec, list_presets, load_tree

__all__ = ["TreeBuffers", "TreeSpec", "build_buffers", "list_presets", "load_tree"]
