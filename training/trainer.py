"""Train Medusa heads on cached features with HF accelerate (DDP/FSDP come from `accelerate launch`); `train` is
also the one entry point of joint (LoRA) training."""
from __future__ import annotations

import time
from functools import lru_cache, partial
from pathlib import Path
from typing import Callable

import torch

from medusa_heads.checkpoint import save_heads
from medusa_heads.loading import load_base, load_tokenizer
from medusa_heads.corpus import is_eval
from medusa_heads.shards import Segment, feature_ids, load_segments
from medusa_heads.training.features import features_from_conversations, reused_segments
from medusa_heads.training.joint import train_joint
from medusa_heads.training.loop import (OOV, Job, Split, build_split, draft_index, evaluate, load_checkpoint, run,
                                        save_checkpoint, start_heads)
from medusa_heads.training.loss import IGNORE, SoftTargets, medusa_loss, teacher_topk
from medusa_heads.training.recipe import TrainRecipe


def train(recipe: TrainRecipe, resume: bool = False, deadline: float | None = None,
          now: Callable[[], float] = time.time) -> Path:
    """Train heads per the recipe (with LoRA on the base when recipe.lora_rank > 0); returns the heads directory.
    Rerun with resume=True after an interruption. deadline (in the time of `now`, wall time unless fit passes its
    clock; one process only): stop at the step it is on once it has passed, evaluated and saved as if it were the
    last."""
    if recipe.lora_rank > 0:
        if deadline is not None:
            raise ValueError("a deadline is for heads-only training (fit), not joint LoRA training")
        return train_joint(recipe, resume)
    return run(recipe, resume, partial(_job, recipe), deadline, now)


def soft_batch(teacher: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor, targets: torch.Tensor) -> SoftTargets:
    """Soft targets for the split rows `rows` (B,) with their targets (B, K): head k at row r guesses the token
    written at row r + k (segments lie back to back in a split), so its soft target is the teacher's top-m there."""
    index, prob = teacher
    k_heads = targets.shape[1]
    at = (rows[:, None] + torch.arange(1, k_heads + 1)).clamp(max=index.shape[0] - 1)  # (B, K)
    return SoftTargets(index[at].long(), prob[at], targets != IGNORE)


def coverage(split: Split) -> float:
    valid = split.targets[:, 0] != IGNORE
    return float((split.targets[valid, 0] != OOV).float().mean())


MIN_FEATURE_CONVERSATIONS = 32  # computed at the least when max_steps bounds what train computes (a minute or two)


def features_to_compute(recipe: TrainRecipe, convs: list[dict], have: set[str], tokenizer,
                        processes: int = 1) -> list[dict]:
    """The conversations without features that this run computes them for: all of them, unless max_steps reads
    far fewer answer tokens than they hold. Then, in a seeded order, as many as give max_steps * batch_size *
    grad_accum * processes training tokens (answer tokens as the tokenizer counts them), at least
    MIN_FEATURE_CONVERSATIONS, and one held-out conversation if none has features yet. The same on every process."""
    import random

    missing = [c for c in convs if c["id"] not in have]
    if len(missing) <= MIN_FEATURE_CONVERSATIONS:
        return missing
    need = recipe.max_steps * recipe.batch_size * recipe.grad_accum * processes
    order = missing[:]
    random.Random(recipe.seed).shuffle(order)
    chosen, tokens, chunk = [], 0, 256
    for a in range(0, len(order), chunk):
        part = order[a : a + chunk]
        texts = [[m["content"] for m in c["messages"] if m["role"] == "assistant"] for c in part]
        counts = tokenizer([t for ts in texts for t in ts] or [""], add_special_tokens=False)["input_ids"]
        i = 0
        for c, ts in zip(part, texts):
            n = sum(len(counts[i + j]) + 1 for j in range(len(ts)))  # + the turn's end token
            i += len(ts)
            chosen.append(c)
            if not is_eval(c["id"], recipe.eval_fraction):
                tokens += n
            if tokens >= need and len(chosen) >= MIN_FEATURE_CONVERSATIONS:
                break
        else:
            continue
        break
    if len(chosen) == len(missing):
        return missing
    if (not any(is_eval(i, recipe.eval_fraction) for i in have)
            and not any(is_eval(c["id"], recipe.eval_fraction) for c in chosen)):
        chosen += [next(c for c in order if is_eval(c["id"], recipe.eval_fraction))]  # the split is checked non-empty
    return chosen


def _segments(recipe: TrainRecipe, convs: list[dict], base, accelerator) -> tuple[list[Segment], set[str]]:
    """The features of the conversations to train on, and those conversations' ids: those that have none in
    recipe.features get them first (where max_steps needs fewer, only some: features_to_compute)."""
    have = feature_ids(recipe.features)
    todo = features_to_compute(recipe, convs, have, load_tokenizer(recipe.model), accelerator.num_processes) \
        if not {c["id"] for c in convs} <= have else []
    missing = sum(c["id"] not in have for c in convs)
    if todo:
        if len(todo) < missing:
            accelerator.print(f"train: max_steps {recipe.max_steps} reads "
                              f"~{recipe.max_steps * recipe.batch_size * recipe.grad_accum:,} answer tokens: features "
                              f"are computed for {len(todo):,} of the {missing:,} conversations that have none in "
                              f"{recipe.features} (the others are left out of this run; a larger max_steps computes "
                              "more)")
        else:
            accelerator.print(f"train: computing features for {len(todo):,} conversations into {recipe.features} "
                              "before the first step (padded batches; each process a share)")
        features_from_conversations(base.to(accelerator.device), load_tokenizer(recipe.model), todo, recipe.features,
                                    shard=(accelerator.process_index, accelerator.num_processes),
                                    progress=accelerator.is_main_process)
        base.cpu()
    accelerator.wait_for_everyone()
    known = ({c["id"] for c in convs} & have) | {c["id"] for c in todo}
    used = [c for c in convs if c["id"] in known]
    reused = reused_segments(used)  # answers taken from data that trains on them already
    segments = [s for s in load_segments(recipe.features, keep_ids=known) if s.id not in reused]
    if not segments:
        raise ValueError(f"no answer in {recipe.data} has a token to train on")
    return segments, known


def _job(recipe: TrainRecipe, convs: list[dict], accelerator, ckpt: Path, resume: bool) -> Job:
    from transformers import get_cosine_schedule_with_warmup

    base = load_base(recipe.model, prepack=False)
    segments, used = _segments(recipe, convs, base, accelerator)
    train_segs = [s for s in segments if not is_eval(s.conv_id, recipe.eval_fraction)]
    if not train_segs or len(train_segs) == len(segments):  # the conversations split, but one side's answers are empty
        side = "training" if not train_segs else "evaluation"
        raise ValueError(f"{recipe.data}: no answer in the {side} split has a token to learn (eval_fraction "
                         f"{recipe.eval_fraction}); distill more prompts, or change eval_fraction "
                         "(--set eval_fraction=...)")
    torch.manual_seed(recipe.seed)
    heads = start_heads(recipe, base, train_segs)
    vocab = heads.config.draft_vocab or list(range(heads.config.vocab_size))
    index = draft_index(vocab, heads.config.vocab_size)
    train_split = build_split(train_segs, recipe.num_heads, index, heads.config.context_size)
    eval_split = build_split([s for s in segments if is_eval(s.conv_id, recipe.eval_fraction)], recipe.num_heads, index,
                             heads.config.context_size)
    teacher = None
    if recipe.soft_weight > 0:  # the target's distribution at every train position, once (features are fixed)
        rows = base.get_output_embeddings().weight.detach()[torch.tensor(vocab)].to(torch.bfloat16)
        teacher = teacher_topk(train_split.hidden, rows, recipe.soft_topk)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, recipe.warmup_steps, recipe.max_steps)
    step = load_checkpoint(ckpt, heads, optimizer, scheduler) if resume else 0
    model, optimizer, scheduler = accelerator.prepare(heads, optimizer, scheduler)

    world, rank, n = accelerator.num_processes, accelerator.process_index, train_split.hidden.shape[0]
    per_step = recipe.batch_size * world
    order = lru_cache(1)(lambda epoch: torch.randperm(
        n, generator=torch.Generator().manual_seed(recipe.seed * 100_003 + epoch)))

    def batch(epoch: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(this process's share of micro-batch p, the whole micro-batch): split rows."""
        whole = order(epoch)[p * per_step : (p + 1) * per_step]
        return whole[rank * recipe.batch_size : (rank + 1) * recipe.batch_size], whole

    def loss(rows: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        idx, whole = rows
        t = train_split.targets[idx]
        logits = model(train_split.hidden[idx].float(), train_split.context[idx])
        soft = soft_batch(teacher, idx, t) if teacher is not None else None
        # each head's targets over the whole micro-batch, every process's share (DDP averages over the processes):
        # N processes then take the very steps one process takes on the whole micro-batch
        every = train_split.targets[whole]
        shares = (((every != IGNORE) & (every != OOV)).sum(0) / world, (every != IGNORE).sum(0) / world)
        return medusa_loss(logits, t.masked_fill(t == OOV, IGNORE), recipe.decay, soft, recipe.soft_weight,
                           shares)[0], {}

    def save(step: int) -> None:
        save_checkpoint(ckpt, lambda folder: save_heads(folder, accelerator.unwrap_model(model)), optimizer, scheduler,
                        step, recipe)

    info = {"conversations": len(used), "train_tokens": int(n), "eval_tokens": int(eval_split.hidden.shape[0]),
            "draft_vocab": len(vocab), "coverage_train": coverage(train_split), "coverage_eval": coverage(eval_split)}
    return Job(step, (model,), optimizer, scheduler, max(n // per_step, 1), batch, loss,
               lambda: evaluate(accelerator.unwrap_model(model), eval_split, recipe.decay), save, info, {"data": info},
               eval_first=bool(recipe.init_heads))
