"""Prompt and conversation files (JSONL, plain or .gz), their ids, and the training/evaluation split by prompt: what
distillation writes and training, calibration and the benchmarks read."""
from __future__ import annotations

import gzip
import json
import os
import random
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator



@dataclass
class PromptRow:
    id: str  # stable id: the row's "id", else "<file stem>:<line number>"
    turns: list[str]  # user turns; turn i+1 is asked after the model's own answer to turn i
    source: str | None = None
    category: str | None = None


def read_prompts(path: str | os.PathLike) -> list[PromptRow]:
    """Read JSONL rows (gzipped if the name ends in .gz) {"prompt": str} or {"turns": [str, ...]}, optionally with
    "id", "source", "category". A malformed line raises ValueError naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no prompts file at {path}")
    stem = Path(path.name.removesuffix(".gz")).stem  # ids "<stem>:<line>" of data/x.jsonl.gz and x.jsonl agree
    rows, seen = [], set()
    with (gzip.open(path, "rt", encoding="utf-8", errors="surrogateescape") if path.suffix == ".gz"
          else path.open(encoding="utf-8", errors="surrogateescape")) as f:
        for n, line in enumerate(f, 1):
            if any("\udc80" <= c <= "\udcff" for c in line):
                raise ValueError(f"{path}:{n}: not valid UTF-8 text; convert the file to UTF-8 "
                                 "(e.g. iconv -f latin1 -t utf-8)")
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            if ("prompt" in obj) == ("turns" in obj):
                raise ValueError(f'{where}: a row needs exactly one of "prompt" or "turns"')
            turns = [obj["prompt"]] if "prompt" in obj else obj["turns"]
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
                raise ValueError(f'{where}: "turns" must be a non-empty list of strings')
            if any(not t.strip() for t in turns):
                raise ValueError(f"{where}: empty prompt")
            rid = str(obj.get("id", f"{stem}:{n}"))
            if VARIANT_SEP in rid or "#" in rid:
                raise ValueError(f"{where}: id {rid!r} contains '{VARIANT_SEP}' or '#', which mark answer variants "
                                 "and turns")
            if rid in seen:
                raise ValueError(f"{where}: duplicate id {rid!r}")
            seen.add(rid)
            rows.append(PromptRow(rid, turns, obj.get("source"), obj.get("category")))
    return rows


VARIANT_SEP = "~"  # "<prompt id>~<variant>": a further answer to the same prompt (e.g. sampled at T > 0)


def prompt_id(conv_id: str) -> str:
    """The prompt a conversation answers: its id without a variant suffix."""
    return conv_id.split(VARIANT_SEP, 1)[0]


def as_variant(rows: list[PromptRow], variant: str) -> list[PromptRow]:
    """The same prompts under ids "<id>~<variant>", so that a further pass of distill appends a second answer to
    each prompt instead of skipping it as done."""
    if not variant or any(c in variant for c in (VARIANT_SEP, "#")) or variant != variant.strip():
        raise ValueError("a variant name must be non-empty, without spaces around it and without '~' or '#', "
                         f"got {variant!r}")
    return [PromptRow(f"{r.id}{VARIANT_SEP}{variant}", r.turns, r.source, r.category) for r in rows]


def subsample(rows: list[PromptRow], caps: dict[str, int], seed: int = 0) -> list[PromptRow]:
    """Keep at most caps[source] rows of each capped source (a seeded choice), then shuffle all rows."""
    rng = random.Random(seed)
    by_source: dict[str | None, list[PromptRow]] = {}
    for r in rows:
        by_source.setdefault(r.source, []).append(r)
    out = []
    for source, group in by_source.items():
        cap = caps.get(source) if source is not None else None
        out += rng.sample(group, cap) if cap is not None and len(group) > cap else group
    rng.shuffle(out)
    return out


# ---- distilled conversations (JSONL, append-only, resumable) ----------------------------------------------------

def read_conversations(path: str | os.PathLike, repair: bool = False) -> list[dict]:
    """Rows {"id", "source", "messages": [{"role", "content"}, ...]}, from JSONL or gzipped JSONL (.gz: what the
    repo ships, read-only). A truncated last line (a killed writer) is dropped with repair=True (the file is cut
    back to its last complete line) and is an error otherwise."""
    path = Path(path)
    if not path.exists():
        return []
    compressed = path.suffix == ".gz"
    try:
        data = gzip.decompress(path.read_bytes()) if compressed else path.read_bytes()
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise ValueError(f"{path}: not a complete gzip file ({e})") from None
    rows = []
    complete = data.rfind(b"\n") + 1
    if complete < len(data):
        if not repair or compressed:
            how = "decompress it to repair it" if compressed else "rerun distill to repair it"
            raise ValueError(f"{path}: last line is truncated (an interrupted write); {how}")
        with path.open("r+b") as f:
            f.truncate(complete)
    # split on "\n" only: str.splitlines() would also split inside strings holding U+2028 and friends
    for n, line in enumerate(data[:complete].decode("utf-8", errors="surrogateescape").split("\n"), 1):
        if any("\udc80" <= c <= "\udcff" for c in line):
            raise ValueError(f"{path}:{n}: not valid UTF-8 text; convert the file to UTF-8 "
                             "(e.g. iconv -f latin1 -t utf-8)")
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list):
            raise ValueError(f'{path}:{n}: expected an object with a "messages" list')
        rows.append(obj)
    return rows


def append_conversations(path: str | os.PathLike, rows: list[dict]) -> None:
    """Append whole lines in one write, then fsync: a kill leaves at most one truncated last line."""
    if not rows:
        return
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def batches(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def check_eval_split(conv_ids: list[str], fraction: float, where: str) -> None:
    """Refuse, before any work, conversations that leave the evaluation split or the training split empty (the
    split goes by a hash of each prompt's id: a handful of conversations may all fall on one side). The one line
    names an eval_fraction that splits them."""
    prompts = sorted({prompt_id(c) for c in conv_ids})
    held = sum(is_eval(p, fraction) for p in prompts)
    if 0 < held < len(prompts):
        return
    if len(prompts) < 2:
        raise ValueError(f"{where}: {len(conv_ids)} conversation(s) of one prompt cannot be split into training and "
                         f"evaluation (eval_fraction {fraction}); distill answers to at least two prompts (dozens to "
                         "train useful heads)")
    hashes = sorted(zlib.crc32(p.encode()) % 10_000 for p in prompts)
    suggest = (hashes[0] + 1) / 10_000  # the smallest fraction that holds out the first prompt (and not the last)
    side = "evaluation" if held == 0 else "training"
    raise ValueError(f"{where}: none of the {len(prompts)} prompts falls in the {side} split "
                     f"(eval_fraction {fraction}, chosen by a hash of each id); pass --set eval_fraction={suggest:g} "
                     f"(it holds out {sum(h < suggest * 10_000 for h in hashes)} of them), or distill more prompts")


def is_eval(conv_id: str, fraction: float) -> bool:
    """Held out or not, decided by the prompt: every answer to a prompt (its variants "<id>~<name>") falls on
    the same side, so a second answer never leaks a held-out prompt into training."""
    return zlib.crc32(prompt_id(conv_id).encode()) % 10_000 < fraction * 10_000
