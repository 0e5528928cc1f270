"""The target side: prefill, and one forward over a whole token tree with a 4D mask."""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from medusa_heads.tree.buffers import TreeBuffers
from medusa_heads.inference.layers import attention_layout
from medusa_heads.inference.screen import ScreenCache
from medusa_heads.inference.tap import LMHeadTap


@dataclass
class TargetOutput:
    logits: torch.Tensor | None  # ([B,] T, V): the target's logits for the token after each input position
    hidden: torch.Tensor  # ([B,] T, H): the LM head's input at each position
    choices: torch.Tensor | None = None  # ([B,] T): the logits' argmax instead, where only that was asked for

    def row(self, b: int = 0, n: int | None = None) -> "TargetOutput":
        """Row b of a batch's output (its first n positions, with n)."""
        pick = lambda x: None if x is None else x[b, :n]  # noqa: E731
        return TargetOutput(pick(self.logits), self.hidden[b, :n], pick(self.choices))


def target_cache_kw(model: PreTrainedModel) -> str:
    """The name under which this transformers version passes a KV cache to forward (and generate)."""
    # transformers 5.24 renames `past_key_values` to `cache` (the old name still works, with a warning).
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class Target:
    """Drives an unmodified transformers causal LM. Quirks of versions and families live here only."""

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
            # costs ~1.2x a plain step instead of ~2x. Process-wide, as transformers reads it; a user's own setting wins.
            os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")

    def _run(self, **kwargs) -> TargetOutput:
        kwargs[self.cache_kw] = kwargs.pop("cache")
        with LMHeadTap(self.model) as tap:  # only for our own calls
            out = self.model(use_cache=True, return_dict=True, **kwargs)
        return TargetOutput(logits=out.logits, hidden=tap.first())

    def _run_greedy(self, **kwargs) -> TargetOutput | None:
        """_run's argmax of the logits, through the screen (inference/screen.py) and the decoder alone; None where
        the screen does not serve this model."""
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
