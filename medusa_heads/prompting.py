"""Conversations as token ids, and the tokens a model stops on: the one place that knows about chat templates.

A tokenizer with a chat template gets it (generation prompt included). One without (a base model) gets plain-text
continuation: the turns joined by a blank line, an answer closed by the EOS token. Distillation, features,
training, calibration, bench and the commands all go through here, so a model sees the same text everywhere."""
from __future__ import annotations

import torch

TURN_SEPARATOR = "\n\n"  # between turns, for a tokenizer without a chat template


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def user_turn(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def prompt_text(tokenizer, messages: list[dict]) -> str:
    """The text a reply to `messages` continues: the chat template with its generation prompt, else the turns."""
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return TURN_SEPARATOR.join(m["content"] for m in messages) + TURN_SEPARATOR


def prompt_ids(tokenizer, messages: list[dict] | str) -> torch.Tensor:
    """(1, L) token ids of the prompt for a reply to `messages` (a string: one user turn)."""
    if isinstance(messages, str):
        messages = user_turn(messages)
    if has_chat_template(tokenizer):
        return torch.tensor([_ids(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))])
    return tokenizer(prompt_text(tokenizer, messages), return_tensors="pt")["input_ids"]


def conversation_ids(tokenizer, messages: list[dict], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens (L,) of a whole conversation and a loss mask (L,), True on the assistant's tokens only (its answers,
    with the end-of-turn or EOS token), cut to max_length."""
    ids: list[int] = []
    mask: list[bool] = []
    if not has_chat_template(tokenizer):
        for i, msg in enumerate(messages):
            piece = _ids(tokenizer(msg["content"] + (TURN_SEPARATOR if msg["role"] != "assistant" else ""),
                                   add_special_tokens=i == 0)["input_ids"])
            if msg["role"] == "assistant":
                piece = piece + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
                piece += (_ids(tokenizer(TURN_SEPARATOR, add_special_tokens=False)["input_ids"])
                          if i + 1 < len(messages) else [])
            ids += piece
            mask += [msg["role"] == "assistant"] * len(piece)
        return torch.tensor(ids[:max_length]), torch.tensor(mask[:max_length])
    for i, msg in enumerate(messages):
        prefix = (tokenizer.apply_chat_template(messages[:i], tokenize=True,
                                                add_generation_prompt=msg["role"] == "assistant") if i else [])
        full = tokenizer.apply_chat_template(messages[: i + 1], tokenize=True)
        prefix, full = _ids(prefix), _ids(full)
        if full[: len(ids)] != ids:
            raise ValueError("the chat template does not extend turn by turn; cannot build loss masks")
        start = len(prefix) if msg["role"] == "assistant" else len(ids)
        mask += [False] * (start - len(ids)) + [msg["role"] == "assistant"] * (len(full) - start)
        ids = full
    return torch.tensor(ids[:max_length]), torch.tensor(mask[:max_length])


def mask_runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of True in a loss mask (L,): the assistant's answers, turn t the t-th run."""
    edges = torch.diff(mask.to(torch.int8), prepend=mask.new_zeros(1, dtype=torch.int8),
                       append=mask.new_zeros(1, dtype=torch.int8))
    return list(zip((edges == 1).nonzero().flatten().tolist(), (edges == -1).nonzero().flatten().tolist()))


def eos_ids(*sources) -> list[int]:
    """The stop tokens named by any of `sources` (an id, a list of ids, None, or a tokenizer / generation config
    with eos_token_id), without repeats, in order."""
    out: list[int] = []
    for s in sources:
        if s is not None and not isinstance(s, (int, list, tuple, set)):
            s = getattr(s, "eos_token_id", None)
        for t in [] if s is None else [s] if isinstance(s, int) else s:
            if t not in out:
                out.append(int(t))
    return out


def _ids(x) -> list[int]:
    if isinstance(x, dict) or hasattr(x, "input_ids"):
        x = x["input_ids"]
    return list(x)

