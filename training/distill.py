"""Self-distillation: the target answers prompts with its own chat template. Append-only and resumable."""
from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from medusa_heads.prompting import eos_ids, has_chat_template, prompt_text
from medusa_heads.corpus import PromptRow, append_conversations, batches, prompt_id, read_conversations
from medusa_heads.engines.hf_cache import new_cache
from medusa_heads.kernels.tap import LMHeadTap
from medusa_heads.engines.hf import target_cache_kw
from medusa_heads.shards import Segment, next_shard_path, write_shard


@torch.no_grad()
def distill(
    model,
    tokenizer,
    rows: list[PromptRow],
    out: str | os.PathLike,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_prompt_tokens: int = 1024,
    medusa=None,
    seed: int = 0,
    features: str | os.PathLike | None = None,
    reuse: dict[str, list[dict]] | None = None,
    progress: bool = True,
) -> dict:
    """Answer every row not yet in `out` and append one conversation per row. Rows are batched with left padding
    (by length, to waste little); with `medusa` (a MedusaModel) rows are drafted one by one with its heads.
    With `features` (a folder), the LM head's inputs at every answer token are kept as training features, taken
    from the generation itself (no second pass over the data). With `reuse` (prompt id -> the messages of an earlier
    distillation of that prompt, see reusable_answers), a turn whose user turns so far are the earlier
    conversation's takes its answer from there instead of generating it again, marked "reused" (training counts
    it once, from the earlier data; no features are written for it). progress=False: no progress bar (a caller
    that shows its own). Returns counts: done before, written now,
    answers reused, skipped (prompt too long)."""
    vocab = model.get_output_embeddings().weight.shape[0]
    if len(tokenizer) > vocab:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary has {vocab}: "
                         "they do not belong together")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {r["id"] for r in read_conversations(out, repair=True)}
    todo = _in_order([r for r in rows if r.id not in done], batch_size)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    sample = (dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0
              else dict(do_sample=False))
    counts = {"done_before": len(done), "written": 0, "reused": 0, "skipped_too_long": 0}
    bar = tqdm(total=len(todo), desc="distill", unit="prompt", disable=not progress)
    special = not has_chat_template(tokenizer)  # a template writes its own BOS; plain text needs the tokenizer's
    how = _Answering(model, tokenizer, medusa, sample, max_new_tokens, max_prompt_tokens, seed,
                     features is not None and medusa is None, reuse, counts, special,
                     set(eos_ids(tokenizer, model.generation_config)))
    for group in batches(todo, 1 if medusa is not None else batch_size):
        convs, segments = _answer_group(how, group)
        written = [
            {"id": r.id, "source": r.source, "messages": c}
            for r, c in zip(group, convs)
            if c and c[-1]["role"] == "assistant" and not all(m.get("reused") for m in c if m["role"] == "assistant")
        ]
        if features is not None:
            write_shard(next_shard_path(features), segments)  # before the rows: a crash in between only repeats
        append_conversations(out, written)
        counts["written"] += len(written)
        bar.update(len(group))
    bar.close()
    return counts


def _in_order(todo: list[PromptRow], batch_size: int) -> list[PromptRow]:
    """Sorted by prompt length within windows of 16 batches, so that a batch pads little while a partial run still
    covers the (shuffled) input evenly."""
    window = 16 * batch_size
    return [r for i in range(0, len(todo), window) for r in sorted(todo[i : i + window], key=lambda r: len(r.turns[0]))]


@dataclass
class _Answering:
    """How every turn of a distill call is answered; `counts` are the call's, added to as it goes."""
    model: Any
    tokenizer: Any
    medusa: Any
    sample: dict
    max_new_tokens: int
    max_prompt_tokens: int
    seed: int
    features: bool  # the LM head's inputs at every generated answer token are kept
    reuse: dict[str, list[dict]] | None
    counts: dict
    special: bool  # the tokenizer's special tokens are added to a prompt
    eos: set[int]


def _answer_group(how: _Answering, group: list[PromptRow]) -> tuple[list[list[dict]], list[Segment]]:
    """The group's conversations, turn by turn (a row whose prompt grew too long is left empty), and the features of
    the answers generated."""
    convs = [[] for _ in group]
    segments: list[Segment] = []
    alive = list(range(len(group)))
    for turn in range(max(len(r.turns) for r in group)):
        alive = [i for i in alive if turn < len(group[i].turns)]
        for i in alive:
            convs[i].append({"role": "user", "content": group[i].turns[turn]})
        asking = alive  # the rows whose answer to this turn is generated now
        if how.reuse:  # answered before, in the same conversation so far: taken from there
            asking = _reused(how, group, convs, alive)
            if not asking:
                continue
        enc, asking, alive = _prompts(how, convs, asking, alive)
        if enc is None:
            continue
        new, tap = _generate(how, enc.to(how.model.device), group[asking[0]].id)
        for j, i in enumerate(asking):
            row = new[j].tolist()
            n = next((k + 1 for k, t in enumerate(row) if t in how.eos), len(row))  # through the first EOS
            answer = how.tokenizer.decode(row[:n], skip_special_tokens=True)
            convs[i].append({"role": "assistant", "content": answer, "finished": n < len(row) or row[-1] in how.eos})
            if how.features:
                segments.append(Segment(f"{group[i].id}#{turn}", tap.hidden()[j, :n].cpu(), new[j, :n].cpu()))
    return convs, segments


def _reused(how: _Answering, group: list[PromptRow], convs: list[list[dict]], alive: list[int]) -> list[int]:
    """The earlier answers of the rows alive that asked the same so far, appended (marked reused): the rows left to
    answer."""
    earlier = {i: _earlier_answer(how.reuse.get(prompt_id(group[i].id)), convs[i]) for i in alive}
    for i, m in earlier.items():
        if m is not None:
            convs[i].append({"role": "assistant", "content": m["content"],
                             "finished": m.get("finished", True), "reused": True})
            how.counts["reused"] += 1
    return [i for i in alive if earlier[i] is None]


def _prompts(how: _Answering, convs: list[list[dict]], asking: list[int], alive: list[int]):
    """The prompts of the rows asking, encoded (padded on the left), less those longer than max_prompt_tokens (their
    conversations emptied, counted): (the encoding, None where no row is left; the rows asking; the rows alive)."""
    enc = _encode(how, convs, asking)
    too_long = [i for i, n in zip(asking, enc["attention_mask"].sum(1).tolist()) if n > how.max_prompt_tokens]
    if not too_long:
        return enc, asking, alive
    how.counts["skipped_too_long"] += len(too_long)
    alive = [i for i in alive if i not in too_long]
    asking = [i for i in asking if i not in too_long]
    for i in too_long:
        convs[i] = []
    return (_encode(how, convs, asking) if asking else None), asking, alive


def _encode(how: _Answering, convs: list[list[dict]], asking: list[int]):
    texts = [prompt_text(how.tokenizer, convs[i]) for i in asking]
    return how.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=how.special)


def _generate(how: _Answering, enc, row_id: str) -> tuple[torch.Tensor, LMHeadTap]:
    """The new tokens of each row (after its prompt), and the tap that kept the LM head's inputs."""
    torch.manual_seed(how.seed + zlib.crc32(row_id.encode()))  # same draws on a rerun
    with LMHeadTap(how.model, last_only=True) as tap:
        if how.medusa is not None:
            gen = how.medusa.generate(enc["input_ids"], max_new_tokens=how.max_new_tokens, **how.sample)
        else:  # the KV cache written in place, not grown by a copy per step (~15% of a batch-32 step here)
            cache = new_cache(how.model, enc["input_ids"].shape[1] + how.max_new_tokens)
            gen = how.model.generate(**enc, max_new_tokens=how.max_new_tokens, pad_token_id=how.tokenizer.pad_token_id,
                                     **{target_cache_kw(how.model): cache}, **how.sample)
    return gen[:, enc["input_ids"].shape[1] :], tap


def reusable_answers(path: str | os.PathLike) -> dict[str, list[dict]]:
    """Prompt id -> messages of each conversation in a distilled file (its variants left out: a variant is another
    answer to the same prompt), for distill's `reuse`."""
    return {c["id"]: c["messages"] for c in read_conversations(path) if prompt_id(c["id"]) == c["id"]}


def _earlier_answer(messages: list[dict] | None, conv: list[dict]) -> dict | None:
    """The earlier conversation's answer to the last user turn of `conv`, if it asked the same so far."""
    if not messages or len(messages) <= len(conv) or messages[len(conv)]["role"] != "assistant":
        return None
    same = all(m["role"] == c["role"] and m["content"] == c["content"] for m, c in zip(messages, conv))
    return messages[len(conv)] if same else None
