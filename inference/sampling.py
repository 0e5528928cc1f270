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


# Warpers that give the same distribution over a top-k cut as over the whole vocabulary with the rest at -inf
# (tokens outside the cut have probability 0 either way, and these read nothing but the relative scores).
_CUT_SAFE = (TemperatureLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)


def draw(logits: torch.Tensor, warpers: LogitsProcessorList, generator: torch.Generator | None = None) -> torch.Tensor:
    """(T, V) raw logits -> (T,) one draw per row from the target's processed distribution (target_probs).

    Where the warpers cut to the top k first (transformers' default, top_k=50), the warpers after the cut run on the
    k kept scores only: the same distribution, but top-p sorts k scores instead of the whole vocabulary (0.1 ms
    instead of 5 ms a draw for SmolLM2). A tie at the k-th score keeps every tied token in TopKLogitsWarper; such a
    row takes the full path."""
    cut = next((i for i, w in enumerate(warpers) if isinstance(w, TopKLogitsWarper)), None)
    if cut is None or not all(isinstance(w, _CUT_SAFE) for i, w in enumerate(warpers) if i != cut):
        return sample(target_probs(logits, warpers), generator)
    scores, chain = logits.float(), list(warpers)
    for w in chain[:cut]:
        scores = w(None, scores)
    k = min(max(warpers[cut].top_k, warpers[cut].min_tokens_to_keep), scores.shape[-1])
    kept, ids = scores.topk(k, dim=-1)  # (T, k), best first
    if bool(((scores >= kept[:, -1:]).sum(-1) > k).any()):  # a tie at the k-th score: the cut keeps more than k
        return sample(target_probs(logits, warpers), generator)
    for w in chain[cut + 1 :]:
        kept = w(None, kept)
    return ids.gather(-1, sample(torch.softmax(kept, dim=-1), generator)[:, None])[:, 0]


def build_processors(gc: GenerationConfig, prompt_length: int,
                     extra: LogitsProcessorList | None = None) -> LogitsProcessorList:
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
