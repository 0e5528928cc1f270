"""All KV-cache surgery: new caches, and keeping only the accepted path after a tree verify."""
from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from medusa_heads.kernels.exact_attention import FREE_TAIL




class PreallocatedLayer(DynamicLayer):
    """A DynamicLayer that writes into buffers allocated once, as gpt-fast's KVCache does, instead of growing
    by torch.cat at every forward (about a tenth of a CPU decoding step for SmolLM2); past its capacity it doubles.
    `keys`/`values` are views."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        b, h, _, d = key_states.shape
        self._k = key_states.new_empty(b, h, self.capacity, d)  # (B, heads, capacity, head_dim)
        self._v = value_states.new_empty(b, h, self.capacity, value_states.shape[-1])
        self.keys, self.values = self._k[:, :, :0], self._v[:, :, :0]
        self._register()

    def _register(self) -> None:
        for buf in (self._k, self._v):
            FREE_TAIL[buf.untyped_storage().data_ptr()] = buf

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        if end > self.capacity:  # a step's tree ran past the guess: grow, as a list does
            self.capacity = max(end, 2 * self.capacity)
            self._k, self._v = (_grown(buf, start, self.capacity) for buf in (self._k, self._v))
            self._register()
        self._k[:, :, start:end] = key_states
        self._v[:, :, start:end] = value_states
        self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
        return self.keys, self.values


def _grown(buf: torch.Tensor, keep: int, capacity: int) -> torch.Tensor:
    """(B, heads, old capacity, D) -> (B, heads, capacity, D) with the first `keep` entries copied."""
    new = buf.new_empty(*buf.shape[:2], capacity, buf.shape[3])
    new[:, :, :keep] = buf[:, :, :keep]
    return new


def new_cache(model: PreTrainedModel, capacity: int | None = None) -> DynamicCache:
    """A DynamicCache whose every layer keeps its whole history (with `capacity`, in preallocated buffers).
    transformers' sliding-window layers keep only the last window of keys, so a tree that is verified and then cut
    back would leave them without the entries it pushed out: here they keep everything, and their masks
    (medusa_heads/kernels/layers.py) show them only their window. The load probe refuses models with other layer
    types."""
    cache = DynamicCache(config=model.config)
    for layer in cache.layers:
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer):  # full, sliding and chunked attention
            raise ValueError(f"{type(model).__name__}: cache layers of type {type(layer).__name__} are not supported")
    cache.layers = [DynamicLayer() if capacity is None else PreallocatedLayer(capacity) for _ in cache.layers]
    return cache


@torch.no_grad()
def keep_accepted(cache: DynamicCache, past: int, keep: torch.Tensor) -> None:
    """After a verify of T tree tokens appended at `past`, keep entries past + keep[i] (in order), drop the rest.
    keep: (n,) tree-node indices (increasing, keep[0] == 0, the root). The cache then ends at past + n."""
    n = keep.shape[0]
    # nodes already in place (a path 0, 1, 2, ... up to the first one that is not) stay where they are
    first = next((i for i, node in enumerate(keep.tolist()) if node != i), n)
    source = keep[first:] + past
    for layer in cache.layers:
        for name in ("keys", "values"):
            kv = getattr(layer, name)  # (B, heads, past + T, head_dim)
            if first < n:
                kv[:, :, past + first : past + n] = kv.index_select(2, source)
            setattr(layer, name, kv[:, :, : past + n])


@torch.no_grad()
def keep_accepted_rows(cache: DynamicCache, past: int, keep: torch.Tensor, counts: torch.Tensor,
                       ends: torch.Tensor) -> int:
    """A batch's keep_accepted, each row packed at its own end: after a verify of T tree tokens per row appended at
    `past`, row b's entries past + keep[b, j] (j < counts[b]) move to ends[b] + j, so that a row that accepted less
    than another leaves no hole behind it. keep: (B, n) tree-node indices per row, padded (by repeating one);
    counts: (B,) how many of them a row keeps (0: none); ends: (B,) <= past, where each row's entries end. What lies
    between a row's new end and the cache's end is stale: the caller's mask hides it. Returns the cache's new
    length, the largest new end."""
    b, n = keep.shape
    source = (keep + past)[:, None, :, None]
    target = (ends[:, None] + torch.arange(n, device=keep.device))[:, None, :, None]  # padding lands on stale slots
    length = int((ends + counts).max())
    for layer in cache.layers:
        for name in ("keys", "values"):
            kv = getattr(layer, name)  # (B, heads, past + T, head_dim): every target lies below past + T
            shape = (b, kv.shape[1], n, kv.shape[3])
            kv.scatter_(2, target.expand(shape), kv.gather(2, source.expand(shape)))
            setattr(layer, name, kv[:, :, :length])
    return length


def crop_to(cache: DynamicCache, length: int) -> None:
    """Drop every entry past `length`."""
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, :length], layer.values[:, :, :length]
