"""A compiled target step for CPU decoding: the decoder as one torch.compile graph over a preallocated (static) KV
cache, as gpt-fast runs its model, with the tree padded to one of a few sizes so that a handful of graphs serve every
step.

Why: eager transformers spends about 20 ms of a SmolLM2 step on Python, module calls and small ATen ops around the
weights (`results/profile/step_profile.md`); one inductor graph per shape runs the same step in fused C++ loops.

What is compiled: the decoder only (`model.get_decoder()`), unmodified; the LM head, the greedy screen and the
prefill stay eager. The packed linears (inference/prepack.py, int8.py) enter the graph as one opaque custom op each
(`medusa_heads::packed_linear`), so a compiled step computes every product with the very kernels an eager step
uses, and the graph holds no weights: inductor's on-disk cache serves later processes in seconds.

Shapes: the query length is padded to a bucket (`BUCKETS`); the cache length to a power of two (at least 512).
Padding rows see the cached prefix and themselves, write their keys and values past the tree, where every later
mask hides them, and their outputs are dropped. Each (bucket, cache length) compiles once a process (about 30 s on
two cores the first time, a few seconds from inductor's cache).
"""
from __future__ import annotations

import sys
import threading

import torch
from tqdm import tqdm
from transformers import PreTrainedModel, StaticCache

from medusa_heads.inference.verify import Target, TargetOutput, target_cache_kw
from medusa_heads.tree.buffers import TreeBuffers

BUCKETS = (1, 4, 8, 16, 32)
MIN_CACHE = 512
MAX_LENGTHS = 8  # cache lengths a process compiles for (512 to 64K entries)

def bucket(tokens: int) -> int:
    """The smallest bucket that holds `tokens` query rows."""
    for size in BUCKETS:
        if tokens <= size:
            return size
    raise ValueError(f"a tree of {tokens} tokens is larger than the largest compiled bucket ({BUCKETS[-1]})")


def cache_length(capacity: int) -> int:
    """The static cache's length for `capacity` entries: a power of two, at least MIN_CACHE."""
    length = MIN_CACHE
    while length < capacity:
        length *= 2
    return length


class CompiledTarget(Target):
    """Target whose plain steps and verifies run the decoder as a compiled graph over a static cache. Full-attention
    CPU models only (`compile_supported`); everything else about Target holds (prefill, the LM head, the screen)."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__(model)
        reason = compile_unsupported(model, self)
        if reason:
            raise ValueError(f"compile: {reason}")
        self.decoder = model.get_decoder()
        self.decoder_kw = target_cache_kw(self.decoder)
        self.graph = torch.compile(self.decoder.forward, dynamic=False)
        # one graph per (bucket, cache length): past dynamo's 8 a function by default, later shapes would run eager
        limit = len(BUCKETS) * MAX_LENGTHS
        if torch._dynamo.config.recompile_limit < limit:
            torch._dynamo.config.recompile_limit = limit
        self.compiled: set[tuple[int, int]] = set()  # (bucket, cache length) graphs this process has made
        self._compiling = threading.Lock()  # dynamo compiles one graph at a time; calls of made graphs run freely

    def warm_up(self, capacities=(MIN_CACHE,), buckets=BUCKETS) -> None:
        """Compile every bucket for every cache length from the one that holds the least of `capacities` to the one
        that holds the most now, with progress, instead of at
        the first step that needs each (a step that compiles takes seconds, or half a minute the first time)."""
        lengths = [cache_length(min(capacities))]
        while lengths[-1] < cache_length(max(capacities)):
            lengths.append(2 * lengths[-1])
        todo = [(b, n) for n in lengths for b in buckets if (b, n) not in self.compiled]
        if not todo:
            return
        print(f"compiling the target step for {len(todo)} shapes: about 30 s each the first time on two cores, "
              "a few seconds from inductor's cache", file=sys.stderr)
        for b, n in tqdm(todo, desc="compile", unit="shape"):
            cache = StaticCache(config=self.model.config, max_cache_len=n)
            self.prefill(torch.zeros(1, 1, dtype=torch.long, device=self.model.device), cache)
            tokens = torch.zeros(b, dtype=torch.long, device=self.model.device)
            self._forward(tokens, torch.arange(1, 1 + b), 1, cache, torch.ones(b, b, dtype=torch.bool).tril(), False)

    def new_cache(self, capacity: int) -> StaticCache:
        cache = StaticCache(config=self.model.config, max_cache_len=cache_length(capacity))
        return cache

    def keep_accepted(self, cache: StaticCache, past: int, keep: torch.Tensor) -> None:
        keep_accepted_static(cache, past, keep)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, cache: StaticCache) -> TargetOutput:
        length = input_ids.shape[1]
        hidden = self.decoder(input_ids=input_ids, use_cache=True, cache_position=torch.arange(length),
                              **{self.decoder_kw: cache}).last_hidden_state[:, -1:]
        _unmark(cache)
        return TargetOutput(logits=self.lm_head(hidden), hidden=hidden).row()

    @torch.no_grad()
    def step(self, token: torch.Tensor, past: int, cache: StaticCache) -> TargetOutput:
        return self._forward(token, torch.tensor([past]), past, cache, None, greedy=False)

    @torch.no_grad()
    def verify(self, tokens: torch.Tensor, past: int, cache: StaticCache, buffers: TreeBuffers,
               greedy: bool = False) -> TargetOutput:
        return self._forward(tokens, buffers.depth + past, past, cache, buffers.mask, greedy)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, past: int, cache: StaticCache,
                 tree_mask: torch.Tensor | None, greedy: bool) -> TargetOutput:
        t = tokens.shape[0]
        b = bucket(t)
        size = cache.layers[0].max_cache_len
        if past + b > size:
            raise RuntimeError(f"the static cache holds {size} entries; a tree of {b} at {past} does not fit")
        dtype = self.model.dtype
        low = torch.finfo(dtype).min
        ids = tokens.new_zeros(1, b)
        ids[0, :t] = tokens
        pos = positions.new_full((1, b), past)
        pos[0, :t] = positions
        mask = torch.full((1, 1, b, size), low, dtype=dtype)
        mask[..., :past] = 0
        tree = mask[0, 0, :, past : past + b]
        tree.fill_diagonal_(0)  # a padding row sees the prefix and itself: finite values, never seen by another
        if tree_mask is not None:
            tree[:t, :t].masked_fill_(tree_mask, 0)
        for layer in cache.layers:
            layer.cumulative_length.fill_(past)
        inputs = dict(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                      cache_position=torch.arange(past, past + b), **{self.decoder_kw: cache})
        if (b, size) in self.compiled:
            hidden = self.graph(**inputs).last_hidden_state
        else:
            with self._compiling:
                hidden = self.graph(**inputs).last_hidden_state
                self.compiled.add((b, size))
        hidden = hidden[0, :t]
        if greedy:
            screen = self.screen.get()
            if screen is not None:
                return TargetOutput(logits=None, hidden=hidden, choices=screen(hidden))
        return TargetOutput(logits=self.lm_head(hidden), hidden=hidden)


def _unmark(cache: StaticCache) -> None:
    """transformers marks a static cache's tensors as fixed addresses (for CUDA graphs), which makes dynamo guard on
    their identity and compile again for every new cache; CPU graphs do not need it."""
    for layer in cache.layers:
        for t in (layer.keys, layer.values, layer.cumulative_length):
            if hasattr(t, "_dynamo_static_input_type"):
                del t._dynamo_static_input_type


def compile_unsupported(model: PreTrainedModel, target: Target) -> str | None:
    """Why the compiled target cannot serve this model, or None."""
    if model.device.type != "cpu":
        return f"the compiled target runs on CPU models; this one is on {model.device.type}"
    attention = getattr(model.config, "_attn_implementation", None)
    if attention not in ("sdpa", "eager"):
        return (f"the compiled target runs SDPA or eager attention; this model's is {attention!r} (a bf16 model gets "
                "the row-exact attention: load it with attn_implementation='sdpa', or leave out compile)")
    if not target.layout.full_only:
        return f"{type(model).__name__} has sliding-window or chunked layers; the compiled target serves full attention only"
    return None


@torch.no_grad()
def keep_accepted_static(cache: StaticCache, past: int, keep: torch.Tensor) -> None:
    """keep_accepted for a static cache: the kept entries move in place; the length is only the next write's
    position (every mask hides what lies past it)."""
    n = keep.shape[0]
    first = next((i for i, node in enumerate(keep.tolist()) if node != i), n)
    if first < n:
        source = keep[first:] + past
        for layer in cache.layers:
            for kv in (layer.keys, layer.values):
                kv[:, :, past + first : past + n] = kv.index_select(2, source)
    for layer in cache.layers:
        layer.cumulative_length.fill_(past + n)
