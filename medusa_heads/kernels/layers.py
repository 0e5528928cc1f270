"""The target's attention layer types, as transformers reads them from the config, and the masks a tree needs for each.

Every layer keeps its whole history in our cache (medusa_heads/engines/hf_cache.py), so keeping a tree's accepted path
is the same cut for every layer; a sliding-window or chunked layer sees only part of that history, which is what its
mask says. Masks are built in *position* space (a key's position against the query's), not in cache slots: a tree node
sits at position past + depth whatever its slot, and a batch's rows leave stale slots between their ends. One table
below holds what each layer type lets a query see; a type not in it is refused at load, with the reason."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import get_layer_types_and_kwargs

FULL = "full_attention"

# layer type -> does a query at position q see a key at position k <= q, given the type's window (or chunk) w;
# full attention sees every earlier position, so its mask is the causal/tree one as it is
_SEES: dict[str, Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]] = {
    "sliding_attention": lambda q, k, w: k > q - w,  # the w latest positions, the query's own included
    "chunked_attention": lambda q, k, w: (torch.div(k, w, rounding_mode="floor")
                                          == torch.div(q, w, rounding_mode="floor")),
}

# cache layer types that hold no per-token keys and values, so no tree can be verified and cut back on them
_WHY_NOT = {
    "linear_attention": ("its linear-attention layers keep a recurrent state, which a rejected draft would leave "
                         "changed"),
    "conv": "its convolution layers keep a rolling state, which a rejected draft would leave changed",
    "hybrid": "its hybrid layers keep a recurrent state, which a rejected draft would leave changed",
    "hybrid_sliding": "its hybrid layers keep a recurrent state, which a rejected draft would leave changed",
    "dummy": "some of its layers share another layer's keys and values (or have no attention cache)",
    "indexed_attention": "its indexed (sparse) attention layers select keys by their own index, not by a mask",
}


@dataclass(frozen=True)
class AttentionLayout:
    kinds: tuple[str, ...]  # the distinct layer types the model's layers read a mask for, in config order
    windows: tuple[int | None, ...]  # each kind's window (sliding) or chunk (chunked); None for full attention
    by_type: bool  # the model takes a dict {layer type: mask} (transformers' mask mapping), not one mask

    @property
    def full_only(self) -> bool:
        return self.kinds == (FULL,)

    @property
    def smallest_window(self) -> int | None:
        return min((w for w in self.windows if w is not None), default=None)

    def masks(self, q_pos: torch.Tensor, k_pos: torch.Tensor, allowed: torch.Tensor,
              dtype: torch.dtype) -> torch.Tensor | dict[str, torch.Tensor]:
        """q_pos: (B, T) query positions; k_pos: (B, K) key positions; allowed: (B, T, K) what full attention may see
        (causal, the tree's ancestors, a row's own slots). -> (B, 1, T, K) additive masks, one per kind (a dict
        where the model reads one per layer type)."""
        low = torch.finfo(dtype).min
        out = {}
        for kind, window in zip(self.kinds, self.windows):
            sees = allowed if kind == FULL else allowed & _SEES[kind](q_pos[:, :, None], k_pos[:, None, :], window)
            out[kind] = torch.zeros(sees.shape, dtype=dtype, device=sees.device).masked_fill_(~sees, low)[:, None]
        return out if self.by_type else out[self.kinds[0]]


def attention_layout(model: PreTrainedModel) -> AttentionLayout:
    """The model's layer types as transformers' own DynamicCache reads them; ValueError naming a type that a tree
    cannot be verified on."""
    config = model.config.get_text_config(decoder=True)
    cache_types, kwargs = get_layer_types_and_kwargs(config)
    name = type(model).__name__
    for kind in dict.fromkeys(cache_types):
        if kind != FULL and kind not in _SEES:
            why = _WHY_NOT.get(kind, f"it has layers of type {kind!r}, which medusa-heads does not know")
            raise ValueError(f"{name} is not supported: {why}; tree decoding needs attention layers whose cache can be "
                             "cut back to the accepted path")
    windows: dict[str, set] = {}
    for kind, kw in zip(cache_types, kwargs):
        windows.setdefault(kind, set()).add(kw.get("sliding_window"))
    for kind, values in windows.items():
        if len(values) > 1:
            raise ValueError(f"{name} is not supported: its {kind} layers have different windows {sorted(values)}")
    kinds = tuple(windows)
    # transformers' models with more than one layer type read a mask per type (`layer_types` in their config)
    by_type = getattr(config, "layer_types", None) is not None and (len(kinds) > 1 or kinds != (FULL,))
    return AttentionLayout(kinds, tuple(next(iter(windows[k])) for k in kinds), by_type)
