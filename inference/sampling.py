"""Turning the target's logits into choices, with transformers' own logits warpers."""
from __future__ import annotations

import torch
from transformers import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from transformers.generation import GenerationConfig


def build_warpers(gc: GenerationConfig) -> LogitsProcessorList:
    """The sampling warpers transformers' generate builds for `gc`, in the same order and with the same skips."""
    w = LogitsProcessorList()
    if not gc.do_sample:
        return w
    if gc.temperature is not None and gc.temperature != 1.0:
        w.append(TemperatureLogitsWarper(gc.temperature))
    if gc.top_k is not None and gc.top_k != 0:
        w.append(TopKLogitsWarper(top_k=gc.top_k, min_tokens_to_keep=1))
    if gc.top_p is not None and gc.top_p < 1.0:
        w.append(TopPLogitsWarper(top_p=gc.top_p, min_tokens_to_keep=1))
    if gc.min_p is not None:
        w.append(MinPLogitsWarper(min_p=gc.min_p, min_tokens_to_keep=1))
    if gc.typical_p is not None and gc.typical_p < 1.0:
        w.append(TypicalLogitsWarper(mass=gc.typical_p, min_tokens_to_keep=1))
    return w


def target_probs(logits: torch.Tensor, warpers: LogitsProcessorList) -> torch.Tensor:
    """(T, V) raw logits -> (T, V) the target's processed sampling distribution at each node.
    The warpers used here read no context, so one call covers all nodes."""
    scores = warpers(None, logits.float()) if len(warpers) else logits.float()
    return torch.softmax(scores, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """(T, V) -> (T,) one independent draw per row."""
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def build_processors(gc: GenerationConfig, prompt_length: int, extra: LogitsProcessorList | None = None) -> LogitsProcessorList:
    """The context-dependent processors transformers' generate builds for `gc` (same order), then the user's."""
    eos = gc.eos_token_id
    p = LogitsProcessorList()
    if gc.repetition_penalty is not None and gc.repetition_penalty != 1.0:
        p.append(RepetitionPenaltyLogitsProcessor(penalty=gc.repetition_penalty))
    if gc.no_repeat_ngram_size is not None and gc.no_repeat_ngram_size > 0:
        p.append(NoRepeatNGramLogitsProcessor(gc.no_repeat_ngram_size))
    if gc.bad_words_ids is not None:
        p.append(NoBadWordsLogitsProcessor(gc.bad_words_ids, eos))
    if gc.min_new_tokens is not None and gc.min_new_tokens > 0 and eos is not None:
        p.append(MinNewTokensLengthLogitsProcessor(prompt_length, gc.min_new_tokens, eos))
    p.extend(extra or [])
    return p


def process_tree(processors: LogitsProcessorList, prefix: torch.Tensor, tree_tokens: torch.Tensor, logits: torch.Tensor,
                 ancestors: torch.Tensor) -> torch.Tensor:
    """Run context-dependent processors at every node with that node's own path as its context.
    prefix: (L,) tokens before the root; tree_tokens: (T,); logits: (T, V); ancestors: (T, T) bool tree mask."""
    out = torch.empty_like(logits, dtype=torch.float32)
    for i in range(tree_tokens.shape[0]):
        context = torch.cat([prefix, tree_tokens[ancestors[i]]])[None]  # (1, L + depth + 1)
        out[i] = processors(context, logits[i : i + 1].float())[0]
    return out
