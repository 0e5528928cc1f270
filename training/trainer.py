"""Train Medusa heads on cached features with HF accelerate (DDP/FSDP come from `accelerate launch`); `train` is
also the one entry point of joint (LoRA) training."""
from __future__ import annotations

from functools import lru_cache, partial
from pathlib import Path

import torch

from medusa_heads.checkpoint import save_heads
from medusa_heads.loading import load_base, load_tokenizer
from medusa_heads.training.data import is_eval
from medusa_heads.training.features import Segment, feature_ids, features_from_conversations, load_segments, reused_segments
from medusa_heads.training.joint import train_joint
from medusa_heads.training.loop import (OOV, Job, Split, build_split, draft_index, evaluate, load_checkpoint, run,
                                        save_checkpoint, start_heads)
from medusa_heads.training.loss import IGNORE, SoftTargets, medusa_loss, teacher_topk
from medusa_heads.training.recipe import TrainRecipe


def train(recipe: TrainRecipe, resume: bool = False) -> Path:
    """Train heads per the recipe (with LoRA on the base when recipe.lora_rank > 0); returns the heads directory.
    Rerun with resume=True after an interruption."""
    if recipe.lora_rank > 0:
        return train_joint(recipe, resume)
    return run(recipe, resume, partial(_job, recipe))


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


def _segments(recipe: TrainRecipe, convs: list[dict], base, accelerator) -> list[Segment]:
    """The features of the conversations to train on; those that have none in recipe.features get them first."""
    known = {c["id"] for c in convs}
    if accelerator.is_main_process and not known <= feature_ids(recipe.features):
        features_from_conversations(base.to(accelerator.device), load_tokenizer(recipe.model), convs, recipe.features)
        base.cpu()
    accelerator.wait_for_everyone()
    reused = reused_segments(convs)  # answers taken from data that trains on them already
    segments = [s for s in load_segments(recipe.features, keep_ids=known) if s.id not in reused]
    if not segments:
        raise ValueError(f"no answer in {recipe.data} has a token to train on")
    return segments


def _job(recipe: TrainRecipe, convs: list[dict], accelerator, ckpt: Path, resume: bool) -> Job:
    from transformers import get_cosine_schedule_with_warmup

    base = load_base(recipe.model, prepack=False)
    segments = _segments(recipe, convs, base, accelerator)
    train_segs = [s for s in segments if not is_eval(s.conv_id, recipe.eval_fraction)]
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
    order = lru_cache(1)(lambda epoch: torch.randperm(n, generator=torch.Generator().manual_seed(recipe.seed * 100_003 + epoch)))

    def batch(epoch: int, p: int) -> torch.Tensor:  # (B,) split rows: this process's share of micro-batch p
        return order(epoch)[p * per_step + rank * recipe.batch_size : p * per_step + (rank + 1) * recipe.batch_size]

    def loss(idx: torch.Tensor) -> tuple[torch.Tensor, dict]:
        t = train_split.targets[idx]
        logits = model(train_split.hidden[idx].float(), train_split.context[idx])
        soft = soft_batch(teacher, idx, t) if teacher is not None else None
        return medusa_loss(logits, t.masked_fill(t == OOV, IGNORE), recipe.decay, soft, recipe.soft_weight)[0], {}

    def save(step: int) -> None:
        save_checkpoint(ckpt, lambda folder: save_heads(folder, accelerator.unwrap_model(model)), optimizer, scheduler, step, recipe)

    info = {"conversations": len({c["id"] for c in convs}), "train_tokens": int(n), "eval_tokens": int(eval_split.hidden.shape[0]),
            "draft_vocab": len(vocab), "coverage_train": coverage(train_split), "coverage_eval": coverage(eval_split)}
    return Job(step, (model,), optimizer, scheduler, max(n // per_step, 1), batch, loss,
               lambda: evaluate(accelerator.unwrap_model(model), eval_split, recipe.decay), save, info, {"data": info},
               eval_first=bool(recipe.init_heads))
