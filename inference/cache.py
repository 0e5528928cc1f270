"""All KV-cache surgery: new caches, and keeping only the accepted path after a tree verify."""
from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel


def new_cache(model: PreTrainedModel) -> DynamicCache:
    return DynamicCache(config=model.config)


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


@torch.no_grad()
def keep_accepted(cache: DynamicCache, past: int, keep: torch.Tensor) -> None:
    """After a verify of T tree tokens appended at `past`, keep entries past + keep[i] (in order), drop the rest.

    keep: (n,) long tree-node indices, increasing, keep[0] == 0 (the root)."""
    n = keep.shape[0]
    src = keep + past
    for layer in cache.layers:
        for name in ("keys", "values"):
            kv = getattr(layer, name)  # (B, heads, past + T, head_dim)
            kv[:, :, past : past + n] = kv.index_select(2, src)
            setattr(layer, name, kv[:, :, : past + n])
        if hasattr(layer, "cumulative_length"):  # sliding-window layers count their tokens themselves
            layer.cumulative_length = past + n
