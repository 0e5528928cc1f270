"""The transformers engine: an unmodified causal LM prefills, and verifies a whole token tree in one forward with a
4D mask; its cache is a DynamicCache the session owns (all surgery on it in engines/hf_cache.py)."""
from __future__ import annotations

import inspect
import os

import torch
from einops import repeat
from transformers import DynamicCache, PreTrainedModel

from medusa_heads.engines.base import TargetOutput
from medusa_heads.engines.hf_cache import crop_to, keep_accepted, keep_accepted_rows, new_cache
from medusa_heads.tree.buffers import TreeBuffers, from_parents
from medusa_heads.kernels.layers import attention_layout
from medusa_heads.kernels.prepack import is_prepacked
from medusa_heads.kernels.screen import ScreenCache
from medusa_heads.kernels.tap import LMHeadTap
from medusa_heads.machine import cost_key, find_cost


def target_cache_kw(model: PreTrainedModel) -> str:
    """The name under which this transformers version passes a KV cache to forward (and generate)."""
    # transformers 5.24 renames `past_key_values` to `cache` (the old name still works, with a warning).
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class Target:
    """The transformers engine (engines/base.Engine): drives an unmodified causal LM. Quirks of versions and
    families live here only."""

    row_cap = None  # its packed kernels split a product past the rows where it would change a row (kernels/prepack.py)

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.cache_kw = target_cache_kw(model)
        self.lm_head = LMHeadTap(model).lm_head  # raises for a model without one
        self.layout = attention_layout(model)  # its layer types (full, sliding, chunked); raises for others
        self.screen = ScreenCache(model)  # greedy verifies: the argmax without the whole fp32 LM head
        self._decoder_kw = (None, "")  # (the screen's decoder, the name it takes its cache by)
        if model.device.type == "cpu":
            # transformers' SDPA path repeats every cached key and value across the query heads of a group
            # (repeat_kv) whenever a mask is given, unless told to pass enable_gqa to PyTorch, which CPU kernels
            # honour with a mask too. Same logits, bit for bit; at 4K cached tokens a 2-token verify of SmolLM2
            # costs ~1.2x a plain step instead of ~2x. Process-wide, as transformers reads it; a user's own setting
            # wins.
            os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def greedy_choices(self) -> bool:
        return self.screen.get() is not None

    def kernels(self) -> str:
        return cost_key(self.model, is_prepacked(self.model))

    def find_cost(self, costs: dict) -> str | None:
        return find_cost(costs, self.model, is_prepacked(self.model))

    def session(self, capacity: int) -> "Session":
        return Session(self, new_cache(self.model, capacity))

    def batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, capacity: int) -> "BatchRows":
        return BatchRows(self, new_cache(self.model, capacity), input_ids, attention_mask)

    def _run(self, **kwargs) -> TargetOutput:
        kwargs[self.cache_kw] = kwargs.pop("cache")
        with LMHeadTap(self.model) as tap:  # only for our own calls
            out = self.model(use_cache=True, return_dict=True, **kwargs)
        return TargetOutput(logits=out.logits, hidden=tap.first())

    def _run_greedy(self, **kwargs) -> TargetOutput | None:
        """_run's argmax of the logits, through the screen (medusa_heads/kernels/screen.py) and the decoder alone;
        None where the screen does not serve this model."""
        screen = self.screen.get()
        if screen is None:
            return None
        decoder = self.screen.decoder
        if self._decoder_kw[0] is not decoder:  # one tuple, replaced whole: safe with many threads
            self._decoder_kw = (decoder, target_cache_kw(decoder))
        kwargs[self._decoder_kw[1]] = kwargs.pop("cache")
        hidden = decoder(use_cache=True, return_dict=True, **kwargs).last_hidden_state
        return TargetOutput(logits=None, hidden=hidden, choices=screen(hidden.flatten(0, -2)).view(hidden.shape[:-1]))

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, cache: DynamicCache) -> TargetOutput:
        """input_ids: (1, L). Fills the cache; returns logits and hidden state of the last position only."""
        return self._run(input_ids=input_ids, cache=cache, logits_to_keep=1).row()

    @torch.no_grad()
    def step(self, token: torch.Tensor, past: int, cache: DynamicCache) -> TargetOutput:
        """token: (1,) one plain decoding step at position `past` (no tree, no mask: the model's own fast path)."""
        return self._run(input_ids=token[None], cache=cache,
                         position_ids=torch.tensor([[past]], device=token.device)).row()

    @torch.no_grad()
    def verify(self, tokens: torch.Tensor, past: int, cache: DynamicCache, buffers: TreeBuffers,
               greedy: bool = False) -> TargetOutput:
        """tokens: (T,) tree tokens (root first). Each node sees the cached prefix and its own ancestors,
        at position past + depth. Appends T entries to the cache. `greedy`: only each node's argmax is needed, so
        the output may hold `choices` instead of logits (where the screen serves the model)."""
        t = tokens.shape[0]
        depth = buffers.depth + past
        if self.layout.full_only:  # the common case, kept to two fills
            dtype = self.model.dtype
            mask = torch.zeros(1, 1, t, past + t, dtype=dtype, device=tokens.device)
            mask[..., past:].masked_fill_(~buffers.mask, torch.finfo(dtype).min)
        else:
            keys = torch.cat([torch.arange(past, device=tokens.device), depth])
            allowed = torch.cat([buffers.mask.new_ones(t, past), buffers.mask], dim=1)
            mask = self.layout.masks(depth[None], keys[None], allowed[None], self.model.dtype)
        inputs = dict(input_ids=tokens[None], attention_mask=mask, position_ids=depth[None], cache=cache)
        return ((greedy and self._run_greedy(**inputs)) or self._run(**inputs)).row()

    @torch.no_grad()
    def prefill_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: DynamicCache) -> TargetOutput:
        """input_ids, attention_mask: (B, L), left-padded. Positions count real tokens only, as transformers'
        generate does. Returns (B, 1, .) outputs at the last position."""
        position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        return self._run(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                         logits_to_keep=1)

    @torch.no_grad()
    def verify_batch(self, tokens: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, cache: DynamicCache,
                     tree_mask: torch.Tensor, depth: torch.Tensor, greedy: bool = False) -> TargetOutput:
        """tokens: (B, T) one tree per row, appended at cache slot P = valid.shape[1] for every row; positions: (B,)
        each row's root position; valid: (B, P) which cached slots hold that row's tokens (its padding and the
        stale slots past its end do not); tree_mask: (B, T, T) each row's ancestor mask; depth: (B, T). `greedy`: as
        in verify."""
        b, t = tokens.shape
        past = valid.shape[1]
        allowed = torch.cat([valid[:, None, :].expand(b, t, past), tree_mask], dim=2)  # (B, T, P + T)
        queries = positions[:, None] + depth  # (B, T)
        keys = torch.cat([valid.long().cumsum(1) - 1, queries], dim=1)  # (B, P + T): a row's own slots' positions
        mask = self.layout.masks(queries, keys, allowed, self.model.dtype)
        inputs = dict(input_ids=tokens, attention_mask=mask, position_ids=queries, cache=cache)
        return (greedy and self._run_greedy(**inputs)) or self._run(**inputs)


class Session:
    """One sequence's cache for one call (engines/base.Session): a tree is verified at the cache's end and cut back
    to its accepted path in place (keep_accepted)."""

    def __init__(self, target: Target, cache: DynamicCache) -> None:
        self.target, self.cache, self.past = target, cache, 0

    def prefill(self, input_ids: torch.Tensor) -> TargetOutput:
        out = self.target.prefill(input_ids, self.cache)
        self.past = input_ids.shape[1]
        return out

    def verify(self, tokens: torch.Tensor, buffers: TreeBuffers, greedy: bool) -> TargetOutput:
        return self.target.verify(tokens, self.past, self.cache, buffers, greedy=greedy)

    def commit(self, keep: torch.Tensor) -> None:
        keep_accepted(self.cache, self.past, keep)
        self.past += keep.shape[0]

    def rollback(self) -> None:
        crop_to(self.cache, self.past)

    def close(self) -> None:
        pass  # the cache goes with the session


class BatchRows:
    """B left-padded prompts in one cache (engines/base.BatchRows). All rows write their trees at the same cache
    slots, after the longest row; then each row's accepted entries move to its own end (keep_accepted_rows), so the
    cache is as long as the longest row, and what lies past a row's end is hidden by its attention mask, as its left
    padding is. Positions count each row's real tokens only, so every row computes exactly what it would alone.
    Finished rows ride along in the verify with their root alone."""

    def __init__(self, target: Target, cache: DynamicCache, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor) -> None:
        if not bool(attention_mask[:, -1].all()):
            raise ValueError("batched prompts must be left-padded: the last position of every row must be a real token")
        self.target, self.cache, self.input_ids = target, cache, input_ids
        self.prompt_valid = attention_mask.bool()  # (B, L): the prompt's cache slots that hold each row's own tokens
        rows, prompt_len = input_ids.shape
        device = input_ids.device
        self.ends = torch.full((rows,), prompt_len, device=device)  # (B,): where each row's entries end
        self.past = prompt_len
        self.root_alone = from_parents((-1,), device)  # a finished row's tree

    def prefill(self) -> TargetOutput:
        return self.target.prefill_batch(self.input_ids, self.prompt_valid.long(), self.cache)

    def verify(self, running, roots, drafts, greedy):
        every = [(roots[0].new_zeros(0), self.root_alone)] * len(roots)  # finished rows: their root alone
        for b, d in zip(running, drafts):
            every[b] = d
        trees, masks, depths = pad_trees(every, roots)
        self.past = int(self.ends.max())  # the cache's length
        prompt_len = self.prompt_valid.shape[1]
        slots = torch.arange(prompt_len, self.past, device=self.ends.device)
        valid = torch.cat([self.prompt_valid, slots[None] < self.ends[:, None]], dim=1)
        positions = valid.long().sum(1)  # (B,): each row's root position = its real tokens so far
        out = self.target.verify_batch(trees, positions, valid, self.cache, masks, depths, greedy=greedy)
        return [(trees[b, : d[1].size], out.row(b, d[1].size)) for b, d in zip(running, drafts)]

    def commit(self, running, keeps):
        """Each row's accepted entries move to its own end; finished rows keep nothing."""
        every = [self.ends.new_zeros(0)] * self.ends.shape[0]
        for b, k in zip(running, keeps):
            every[b] = k
        keep = torch.zeros(len(every), max(k.shape[0] for k in every), dtype=torch.long, device=self.ends.device)
        for b, k in enumerate(every):
            if k.shape[0]:
                keep[b, : k.shape[0]], keep[b, k.shape[0] :] = k, k[-1]
        counts = torch.tensor([k.shape[0] for k in every], device=self.ends.device)
        keep_accepted_rows(self.cache, self.past, keep, counts, self.ends)
        self.ends += counts


def pad_trees(drafts: list, roots: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's tree (root + drafted nodes), padded to the largest: (B, T) tokens, (B, T, T) ancestor masks and
    (B, T) depths. A padding node repeats the root one level below it (a child of the root, seeing only the root
    and itself): its entries are never accepted, so they are dropped with the rest of the tree."""
    size = max(buffers.size for _, buffers in drafts)
    device = drafts[0][1].mask.device
    tokens = repeat(torch.stack(roots), "b -> b t", t=size).clone()
    padded = []
    for row, (drafted, buffers) in enumerate(drafts):
        tokens[row, 1 : buffers.size] = drafted
        padded.append(buffers if buffers.size == size else
                      from_parents((*buffers.parent.tolist(), *[0] * (size - buffers.size)), device))
    return tokens, torch.stack([b.mask for b in padded]), torch.stack([b.depth for b in padded])
