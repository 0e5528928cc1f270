"""Feature shards: the frozen target's LM-head inputs at answer positions, with the tokens it chose there, as
training writes them and training and calibration read them.

A segment is one assistant answer: hidden (n, H) and tokens (n,), where hidden[i] is the LM head's input that
produced tokens[i]; Medusa head k learns tokens[i + k] from hidden[i]. Shards are safetensors files written
atomically: hidden (N, H) bf16, tokens (N,) int32, offsets (S + 1,) int64, and the segment ids in the metadata."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from medusa_heads.checkpoint import follow_umask


@dataclass
class Segment:
    id: str  # "<conversation id>#<turn>"
    hidden: torch.Tensor  # (n, H)
    tokens: torch.Tensor  # (n,)

    @property
    def conv_id(self) -> str:
        return conversation_of(self.id)


def conversation_of(segment_id: str) -> str:
    """The conversation a segment ("<conversation id>#<turn>") belongs to."""
    return segment_id.rsplit("#", 1)[0]


def write_shard(path: Path, segments: list[Segment]) -> None:
    if not segments:
        return
    hidden = torch.cat([s.hidden for s in segments]).to(torch.bfloat16).contiguous()
    tokens = torch.cat([s.tokens for s in segments]).to(torch.int32)
    offsets = torch.tensor([0] + [len(s.tokens) for s in segments]).cumsum(0)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({"hidden": hidden, "tokens": tokens, "offsets": offsets}, tmp,
              metadata={"ids": json.dumps([s.id for s in segments])})
    follow_umask(tmp)  # save_file writes 0600
    os.replace(tmp, path)


def shard_paths(folder: str | os.PathLike) -> list[Path]:
    return sorted(Path(folder).glob("shard-*.safetensors"))


def next_shard_path(folder: str | os.PathLike, tag: str = "") -> Path:
    """The next shard's path; `tag` (e.g. "r1": a process's rank) keeps the names of processes that write into one
    folder at once apart ("shard-00007-r1"), and folders written apart merge by copying their files together."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    existing = shard_paths(folder)
    n = 1 + max((int(p.stem.split("-")[1]) for p in existing), default=-1)
    return folder / f"shard-{n:05d}{'-' + tag if tag else ''}.safetensors"


def feature_ids(folder: str | os.PathLike) -> set[str]:
    """The conversations that have features in `folder` (read from the shards' metadata only)."""
    out = set()
    for path in shard_paths(folder):
        with safe_open(path, "pt") as f:
            out.update(conversation_of(sid) for sid in json.loads(f.metadata()["ids"]))
    return out


def load_segments(folder: str | os.PathLike, keep_ids: set[str] | None = None) -> list[Segment]:
    """All segments, each id once (a shard written just before a crash may repeat rows redone later)."""
    out, seen = [], set()
    for path in shard_paths(folder):
        with safe_open(path, "pt") as f:
            ids = json.loads(f.metadata()["ids"])
            hidden, tokens, offsets = f.get_tensor("hidden"), f.get_tensor("tokens"), f.get_tensor("offsets")
        for i, sid in enumerate(ids):
            conv_id = conversation_of(sid)
            if sid in seen or (keep_ids is not None and conv_id not in keep_ids):
                continue
            seen.add(sid)
            a, b = int(offsets[i]), int(offsets[i + 1])
            out.append(Segment(sid, hidden[a:b], tokens[a:b].long()))
    return out


def segment_context(tokens: torch.Tensor, width: int) -> torch.Tensor:
    """(n,) -> (n, width): row i is tokens[i : i + width], the root (the target's own token from hidden[i]) and
    the true path after it, repeating the last token past the end (where no head has a target left)."""
    n = tokens.shape[0]
    idx = (torch.arange(n)[:, None] + torch.arange(width)[None]).clamp(max=n - 1)
    return tokens[idx]
