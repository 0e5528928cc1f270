"""Tiny random models of the decoder-only families people run, with windows of 16 tokens where they have any.

One table: family -> (transformers model_type, config overrides). `tiny_family` builds any of them with the shared
tiny sizes; sliding-window, chunked and mixed-layer families get a window of WINDOW tokens and, where their config
lists layer types, one layer of each kind (so a test crosses both)."""
from __future__ import annotations

import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

WINDOW = 16
SIZES = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, head_dim=8, pad_token_id=0, bos_token_id=1,
             eos_token_id=2,
             initializer_range=0.2)  # peaked logits: no near-ties that float noise could flip
SW, HYB = "sliding_attention", ["sliding_attention", "full_attention"]

FAMILIES: dict[str, tuple[str, dict]] = {
    # full attention only
    "llama": ("llama", {}),
    "qwen3": ("qwen3", {}),
    "granite": ("granite", {}),
    "olmo2": ("olmo2", {}),
    "stablelm": ("stablelm", {}),
    "cohere": ("cohere", {}),
    "gemma": ("gemma", {}),
    "glm": ("glm", {}),
    "helium": ("helium", {}),
    "phi": ("phi", {}),
    "gpt_neox": ("gpt_neox", {}),
    # sliding window on every layer
    "mistral": ("mistral", {"sliding_window": WINDOW}),
    "mixtral": ("mixtral", {"sliding_window": WINDOW, "num_local_experts": 4}),
    "phi3": ("phi3", {"sliding_window": WINDOW}),
    "starcoder2": ("starcoder2", {"sliding_window": WINDOW}),
    # sliding and full layers mixed
    "qwen2": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "qwen3-swa": ("qwen3", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "qwen2_moe": ("qwen2_moe", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1,
                                "num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}),
    "gemma2": ("gemma2", {"sliding_window": WINDOW, "layer_types": HYB}),
    "gemma3": ("gemma3_text", {"sliding_window": WINDOW, "layer_types": HYB}),
    "cohere2": ("cohere2", {"sliding_window": WINDOW, "layer_types": HYB}),
    "olmo3": ("olmo3", {"sliding_window": WINDOW, "layer_types": HYB}),
    "exaone4": ("exaone4", {"sliding_window": WINDOW, "layer_types": HYB}),
    "gpt_oss": ("gpt_oss", {"sliding_window": WINDOW, "layer_types": HYB, "num_local_experts": 4}),
    "ministral": ("ministral", {"sliding_window": WINDOW, "layer_types": HYB}),
    "smollm3": ("smollm3", {"sliding_window": WINDOW, "layer_types": HYB, "use_sliding_window": True}),
    "vaultgemma": ("vaultgemma", {"sliding_window": WINDOW, "layer_types": HYB}),
    # chunked attention
    "llama4": ("llama4_text", {"attention_chunk_size": WINDOW, "layer_types": ["chunked_attention", "full_attention"]}),
}

# families refused at load, each for the reason its layers give (docs/models.md)
REFUSED: dict[str, tuple[str, dict]] = {
    "gemma3n": ("gemma3n_text", {"sliding_window": WINDOW, "num_hidden_layers": 4, "layer_types": HYB * 2,
                                 "num_kv_shared_layers": 2, "vocab_size_per_layer_input": 96}),
    "qwen3_next": ("qwen3_next", {}),
    "lfm2": ("lfm2", {"layer_types": ["conv", "full_attention"]}),
    "falcon_h1": ("falcon_h1", {}),
    "jamba": ("jamba", {}),
}


def tiny_family(family: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A tiny random model of `family` (FAMILIES), in eval mode."""
    model_type, extra = FAMILIES[family] if family in FAMILIES else REFUSED[family]
    torch.manual_seed(seed)
    config = CONFIG_MAPPING[model_type](**{**SIZES, **extra, **overrides})
    model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    return model_class(config).eval()
