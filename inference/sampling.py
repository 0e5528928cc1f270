"""Turning the target's logits into choices, with transformers' own logits warpers."""
from __future__ import annotations

import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
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
