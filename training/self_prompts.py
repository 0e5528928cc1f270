"""User prompts that the target itself asks (Magpie's method): given only its chat template up to the opening of a
user turn, an instruct model samples what a user would write there. The heads' training prompts come from a few
public sets, while people ask a model everyday assistant questions; these prompts are that kind, in the target's own
idea of a user, and `distill` answers them like any other prompt.

A sample is kept only if the model closed its turn within max_new_tokens, it has 4 words or more and no role
markers, it is new (case- and space-normalised), and it shares no 13-word n-gram with the `exclude` prompt files
(the bench's, so that the bench keeps judging prompts the heads never trained on). Resumable: rows already in `out`
are kept and counted, and batch i is always sampled with seed + i; `out` is replaced whole after each batch, so a
kill leaves the file of the batch before or after."""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
from pathlib import Path

import torch
from tqdm import tqdm

from medusa_heads.corpus import PromptRow, read_prompts
from medusa_heads.prompting import eos_ids, has_chat_template

MARKER = "\x00USER\x00"  # stands for the user's text while the template is cut at its opening
SOURCE = "self-magpie"


def user_turn_opening(tokenizer) -> str:
    """The chat template rendered up to where a user's first message begins (with the template's default system
    turn, if it has one). Raises for a tokenizer without a chat template: there is no user turn to open."""
    if not has_chat_template(tokenizer):
        raise ValueError("the model's tokenizer has no chat template: a prompt written by the model needs the "
                         "template's opening of a user turn")
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARKER}], tokenize=False,
                                         add_generation_prompt=False)
    return text.split(MARKER, 1)[0]


def normalised(text: str) -> str:
    return " ".join(text.lower().split())


def ngrams(text: str, n: int = 13) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def keep(text: str, seen: set[str], banned: set[tuple[str, ...]]) -> bool:
    return (len(text.split()) >= 4 and "<|" not in text and not re.search(r"(?im)^\s*(user|assistant|system)\s*:", text)
            and normalised(text) not in seen and not (ngrams(text) & banned))


def write_self_prompts(model, tokenizer, out: str | os.PathLike, count: int, *, exclude: list[str] = (),
                       batch_size: int = 16, max_new_tokens: int = 96, temperature: float = 1.0, top_p: float = 0.95,
                       seed: int = 0, max_batches: int | None = None, progress: bool = True) -> list[PromptRow]:
    """Sample until `out` (JSONL, gzipped) holds `count` prompts, or max_batches batches were sampled in all (a model
    that seldom closes its turn); returns the prompts in `out`."""
    out = Path(out)
    rows = read_prompts(out) if out.exists() else []
    seen = {normalised(r.turns[0]) for r in rows}
    banned = set().union(*(ngrams(t) for f in exclude for r in read_prompts(f) for t in r.turns))
    opening = tokenizer(user_turn_opening(tokenizer), return_tensors="pt", add_special_tokens=False).input_ids
    opening = opening.to(model.device)
    stop = set(eos_ids(model.generation_config, tokenizer))
    state = out.with_suffix(".state")  # batches sampled so far: batch i is sampled with seed + i
    tried = json.loads(state.read_text())["batches"] if state.exists() else 0
    bar = tqdm(total=count, initial=min(len(rows), count), desc="prompts the model writes", unit="prompt",
               disable=not progress)
    while len(rows) < count and (max_batches is None or tried < max_batches):
        torch.manual_seed(seed + tried)
        ids = opening.expand(batch_size, -1)
        with torch.no_grad():
            seqs = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=temperature,
                                  top_p=top_p, top_k=0, max_new_tokens=max_new_tokens, eos_token_id=sorted(stop),
                                  pad_token_id=(tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                                                else min(stop)))
        new = []
        for seq in seqs[:, ids.shape[1] :].tolist():
            closed = next((i for i, t in enumerate(seq) if t in stop), None)
            if closed is None:
                continue  # the turn did not end within the budget
            text = tokenizer.decode(seq[:closed], skip_special_tokens=True).strip()
            if keep(text, seen, banned):
                seen.add(normalised(text))
                new.append(PromptRow(f"self:{hashlib.sha1(text.encode()).hexdigest()[:12]}", [text], SOURCE))
        tried += 1
        rows += new[: count - len(rows)]
        tmp = out.with_name(f".{out.name}.tmp")  # the file is rewritten whole, then replaced: a kill leaves one whole
        with gzip.open(tmp, "wt", encoding="utf-8") as f:
            f.writelines(json.dumps({"id": r.id, "prompt": r.turns[0], "source": r.source}, ensure_ascii=False) + "\n"
                         for r in rows)
        os.replace(tmp, out)
        state.write_text(json.dumps({"batches": tried}))  # after a kill before this line: batch i again, all seen
        bar.update(len(rows) - bar.n)
    bar.close()
    return rows


__all__ = ["user_turn_opening", "write_self_prompts"]
