"""Features: the frozen target's LM-head inputs at response positions, with the tokens it chose there, computed
from conversations and stored as shards (medusa_heads/shards.py).

A segment is one assistant answer: hidden (n, H) and tokens (n,), where hidden[i] is the LM head's input that
produced tokens[i]; Medusa head k learns tokens[i + k] from hidden[i]. Shards are safetensors files written
atomically: hidden (N, H) bf16, tokens (N,) int32, offsets (S + 1,) int64, and the segment ids in the metadata."""
from __future__ import annotations

import os
import zlib

import torch

from medusa_heads.faults import crash_point
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


def process_shard() -> tuple[int, int]:
    """(rank, world size) of this process under `accelerate launch` or `torchrun` (their RANK and WORLD_SIZE), else
    (0, 1). Features need no communication between processes: each takes its share of the conversations."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def shard_of(conv_id: str, world: int) -> int:
    return zlib.crc32(conv_id.encode()) % world


@torch.no_grad()
def features_from_conversations(model, tokenizer, conversations: list[dict], folder: str | os.PathLike,
                                max_length: int = 2048, per_shard: int = 64, batch_tokens: int = 8192,
                                max_rows: int = 32, shard: tuple[int, int] = (0, 1), progress: bool = True) -> int:
    """Features for conversations that have none in `folder` (data distilled elsewhere, by a server, or with
    --heads): their chat-template tokens through the model in right-padded batches of up to `batch_tokens` padded
    tokens (`max_rows` rows), longest first. shard (rank, world): this process takes the conversations whose id
    hashes to its rank and names its files apart (process_shard(); several processes or machines share the work).
    Resumable: every `per_shard` segments go to disk, and a rerun skips the conversations written. Returns the
    number of conversations computed."""
    from tqdm import tqdm

    rank, world = shard
    have = feature_ids(folder)
    todo = [c for c in conversations if c["id"] not in have and shard_of(c["id"], world) == rank]
    reused = reused_segments(todo)
    tag = f"r{rank}" if world > 1 else ""
    encoded = sorted(((c, *conversation_ids(tokenizer, c["messages"], max_length)) for c in todo),
                     key=lambda e: -e[1].shape[0])  # longest first: the largest batch is met first, and pads little
    groups, group = [], []
    for e in encoded:
        if group and (len(group) + 1) * group[0][1].shape[0] > batch_tokens or len(group) == max_rows:
            groups.append(group)
            group = []
        group.append(e)
    if group:
        groups.append(group)
    segments: list[Segment] = []
    backbone = model.base_model
    bar = tqdm(total=len(todo), desc="features" + (f" (process {rank} of {world})" if world > 1 else ""),
               unit="conv", disable=not progress)
    for group in groups:
        width = group[0][1].shape[0]
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for j, (_, x, _) in enumerate(group):
            ids[j, : x.shape[0]] = x
            mask[j, : x.shape[0]] = 1
        # the backbone's last hidden state is what every transformers causal LM feeds its LM head; right padding
        # leaves every real token's causal context as it is
        hidden = backbone(input_ids=ids.to(model.device), attention_mask=mask.to(model.device)).last_hidden_state
        for j, (conv, x, loss_mask) in enumerate(group):
            finished = [m.get("finished", True) for m in conv["messages"] if m["role"] == "assistant"]
            h = hidden[j, : x.shape[0]]  # h[p] -> token p + 1
            for s in answer_segments(conv["id"], x, loss_mask, h, tokenizer.eos_token_id, finished):
                if s.id not in reused:
                    segments.append(Segment(s.id, s.hidden.to(torch.bfloat16).cpu(), s.tokens))
            if len(segments) >= per_shard:  # whole conversations a shard: an interruption loses what is not written
                write_shard(next_shard_path(folder, tag), segments)
                crash_point("features")
                segments = []
        bar.update(len(group))
    write_shard(next_shard_path(folder, tag), segments)
    crash_point("features")
    bar.close()
    return len(todo)
