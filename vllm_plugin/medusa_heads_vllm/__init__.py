"""vLLM plugin: serves the heads medusa-heads trains (every shape: conditioned on the root or the drafted path,
square or MLP blocks, a draft or the full vocabulary, shared or own LM head) through vLLM's own Medusa proposer.

Installed into vLLM's environment, vLLM loads it in every process (entry point group `vllm.general_plugins`); it
registers one draft architecture, which `medusa-heads export --format vllm` names in the export's config.json."""
from __future__ import annotations

__version__ = "0.1.0"
VLLM_VERSION = "0.32.0"  # what it is tested against (make test-vllm)


def register() -> None:
    from vllm import ModelRegistry

    from medusa_heads_vllm.model import ARCHITECTURE

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "medusa_heads_vllm.model:MedusaHeadsDraft")
