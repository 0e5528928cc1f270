"""Features: the frozen target's LM-head inputs at response positions, with the tokens it chose there, computed
from conversations and stored as shards (medusa_heads/shards.py).

A segment is one assistant answer: hidden (n, H) and tokens (n,), where hidden[i] is the LM head's input that
produced tokens[i]; Medusa head k learns tokens[i + k] from hidden[i]. Shards are safetensors files written
atomically: hidden (N, H) bf16, tokens (N,) int32, offsets (S + 1,) int64, and the segment ids in the metadata."""
from __future__ import annotations

import os

import torch

from medusa_heads.prompting import conversation_ids, mask_runs
from medusa_heads.shards import Segment, feature_ids, next_shard_path, write_shard


def answer_segments(conv_id: str, ids: torch.Tensor, mask: torch.Tensor, hidden: torch.Tensor | None,
                    eos: int | None = None, finished: list[bool] | None = None) -> list[Segment]:
    """One Segment per assistant turn (a run of the loss mask), id "<conv_id>#<turn>": hidden[p] (the LM-head
    input at p) produced ids[p + 1]. With `eos`, a turn ends at its first eos token, which is kept unless
    finished[turn] is False (the answer was cut off: the model never wrote it). Empty turns are left out."""
    out = []
    for turn, (start, end) in enumerate(mask_runs(mask)):
        p = max(start, 1)  # a token at 0 has no hidden state before it
        length = end - p
        if eos is not None:
            stop = (ids[p:end] == eos).nonzero()
            if len(stop):
                length = int(stop[0]) + (1 if finished is None or finished[turn] else 0)
        if length > 0:
            h = hidden[p - 1 : p - 1 + length] if hidden is not None else None
            out.append(Segment(f"{conv_id}#{turn}", h, ids[p : p + length]))
    return out


def reused_segments(conversations: list[dict]) -> set[str]:
    """Segment ids of answers that distill took from earlier data ("reused": true): the earlier data trains on
    them, so they are counted once."""
    return {f"{c['id']}#{t}" for c in conversations
            for t, m in enumerate(m for m in c["messages"] if m["role"] == "assistant") if m.get("reused")}


@torch.no_grad()
def features_from_conversations(model, tokenizer, conversations: list[dict], folder: str | os.PathLike,
                                max_length: int = 2048, per_shard: int = 64) -> int:
    """Features for conversations that have none in `folder` (data distilled elsewhere, or with --heads): one
    forward per conversation over its chat-template tokens. Resumable: every `per_shard` segments go to disk, and a
    rerun skips the conversations written. Returns the number of conversations computed."""
    from tqdm import tqdm

    have = feature_ids(folder)
    todo = [c for c in conversations if c["id"] not in have]
    reused = reused_segments(todo)
    segments: list[Segment] = []
    for conv in tqdm(todo, desc="features", unit="conv"):
        ids, mask = conversation_ids(tokenizer, conv["messages"], max_length)
        # the backbone's last hidden state is what every transformers causal LM feeds its LM head
        hidden = model.base_model(ids[None].to(model.device)).last_hidden_state[0]  # (L, H): hidden[p] -> token p + 1
        finished = [m.get("finished", True) for m in conv["messages"] if m["role"] == "assistant"]
        for s in answer_segments(conv["id"], ids, mask, hidden, tokenizer.eos_token_id, finished):
            if s.id in reused:
                continue
            segments.append(Segment(s.id, s.hidden.to(torch.bfloat16), s.tokens))
        if len(segments) >= per_shard:
            write_shard(next_shard_path(folder), segments)
            segments = []
    write_shard(next_shard_path(folder), segments)
    return len(todo)


