"""Medusa-2: train the heads jointly with peft LoRA adapters on the target (lora_rank > 0 in the recipe).

The target runs on every step (no cached features): its hidden states now move with the adapters. The loss is
the heads' Medusa loss + lm_weight * the target's CE on the distilled answers + kl_weight * KL(frozen target ||
adapted target), on answer tokens only. The output is a heads directory with the adapter in `adapter/`;
MedusaModel.from_pretrained merges it into the base, and generation is then lossless with respect to the
ADAPTED model (not the original one)."""
from __future__ import annotations

import sys
from functools import lru_cache, partial
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from accelerate.utils import extract_model_from_parallel
from safetensors.torch import load_file, save_file

from medusa_heads.checkpoint import save_heads
from medusa_heads.heads import MedusaHeads
from medusa_heads.kernels.tap import LMHeadTap
from medusa_heads.loading import load_base, load_tokenizer
from medusa_heads.prompting import conversation_ids, mask_runs
from medusa_heads.corpus import is_eval
from medusa_heads.shards import Segment
from medusa_heads.training.features import answer_segments
from medusa_heads.training.loss import IGNORE, medusa_loss
from medusa_heads.training.recipe import TrainRecipe
from medusa_heads.training.loop import (OOV, Job, build_split, draft_index, evaluate, load_checkpoint, run, start_heads,
                                        save_checkpoint)

ADAPTER_DIR = "adapter"


class Seq(NamedTuple):
    id: str
    ids: torch.Tensor  # (L,) chat-template tokens
    mask: torch.Tensor  # (L,) True on answer tokens
    finished: list[bool]  # per assistant turn: did the model end it itself


def _segments(seq: Seq, hidden: torch.Tensor | None, eos: int | None) -> list[Segment]:
    return answer_segments(seq.id, seq.ids, seq.mask, hidden, eos, seq.finished)


def _forward(model, batch: list[Seq], device):
    """Right-padded forward of the adapted model, and of the frozen one (adapters off, no grad), at the answer-
    predicting positions. Returns (adapted logits (N, V), frozen logits (N, V), hidden (B, L, H), rows, cols)."""
    width = max(seq.ids.shape[0] for seq in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, seq in enumerate(batch):
        ids[b, : seq.ids.shape[0]], attn[b, : seq.ids.shape[0]] = seq.ids, 1
    ids, attn = ids.to(device), attn.to(device)
    rows, cols = _positions(batch)
    inner = extract_model_from_parallel(model)  # what accelerator.unwrap_model does
    with LMHeadTap(inner) as tap:
        logits = model(input_ids=ids, attention_mask=attn).logits
    hidden = tap.first()
    with torch.no_grad(), inner.disable_adapter():
        frozen = model(input_ids=ids, attention_mask=attn).logits[rows, cols].float()
    return logits[rows, cols].float(), frozen, hidden, rows, cols


def _kl(adapted: torch.Tensor, frozen: torch.Tensor, reduction: str = "batchmean") -> torch.Tensor:
    """KL(frozen || adapted) per position."""
    return F.kl_div(F.log_softmax(adapted, -1), F.log_softmax(frozen, -1), log_target=True, reduction=reduction)


def _positions(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, position) of every answer-predicting position: hidden at p predicts answer token p + 1."""
    rows, cols = [], []
    for b, seq in enumerate(batch):
        p = (seq.mask[1:]).nonzero()[:, 0]
        rows.append(torch.full_like(p, b))
        cols.append(p)
    return torch.cat(rows), torch.cat(cols)


def epoch_batches(lengths: list[int], batch_size: int, seed: int, pool: int = 32) -> list[list[int]]:
    """One epoch's batches of conversation indices, of similar length: a seeded shuffle, cut into pools of `pool`
    batches, each pool sorted by length and cut into batches, then the batches shuffled. Right padding then costs
    little (random batches of 8 distilled conversations pad about 2x); a pure function of the seed, so a resumed
    run sees the very same batches. The last len(lengths) % batch_size conversations of the shuffle wait for the
    next epoch, as in the trainer."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(lengths), generator=g).tolist()
    perm = perm[: max(len(perm) // batch_size, 1) * batch_size]
    batches = []
    for start in range(0, len(perm), pool * batch_size):
        chunk = sorted(perm[start : start + pool * batch_size], key=lambda i: lengths[i])
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def train_joint(recipe: TrainRecipe, resume: bool = False) -> Path:
    """Heads and LoRA adapters on the target together; returns the heads directory (the adapter in adapter/)."""
    return run(recipe, resume, partial(_job, recipe))


def _without_reused(mask: torch.Tensor, answers: list[dict]) -> tuple[torch.Tensor, list[bool]]:
    """The loss mask without the answers distill took from earlier data ("reused": true; the earlier data trains
    on them, as features.reused_segments leaves them out of Medusa-1 training), and the kept answers' finished
    flags. Turn t is the mask's t-th run (prompting.mask_runs), as in features.answer_segments."""
    reused = [bool(m.get("reused")) for m in answers]
    finished = [m.get("finished", True) for m, r in zip(answers, reused) if not r]
    if not any(reused):
        return mask, finished
    mask = mask.clone()
    for turn, (start, end) in enumerate(mask_runs(mask)):
        if turn < len(reused) and reused[turn]:
            mask[start:end] = False
    return mask, finished


def _seqs(recipe: TrainRecipe, tokenizer, convs: list[dict]) -> tuple[list[Seq], list[Seq]]:
    """The conversations as chat-template tokens: those with an answer token within recipe.max_length, and the rest."""
    seqs, cut = [], []
    for conv in convs:
        ids, mask = conversation_ids(tokenizer, conv["messages"], recipe.max_length)
        answers = [m for m in conv["messages"] if m["role"] == "assistant"]
        mask, finished = _without_reused(mask, answers)
        (seqs if mask[1:].any() else cut).append(Seq(conv["id"], ids, mask, finished))
    if cut:  # said, not silently dropped
        print(f"joint training: {len(cut)} conversations have no answer token within max_length={recipe.max_length} "
              f"and are left out (first: {cut[0].id})", file=sys.stderr)
    if not seqs:
        raise ValueError(f"no answers to train on in {recipe.data}")
    return seqs, cut


def _job(recipe: TrainRecipe, convs: list[dict], accelerator, ckpt: Path, resume: bool) -> Job:
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import get_cosine_schedule_with_warmup
    if accelerator.num_processes > 1:
        raise NotImplementedError("joint (LoRA) training runs in one process; Medusa-1 training runs distributed")
    base, tokenizer = load_base(recipe.model, prepack=False, frozen=False), load_tokenizer(recipe.model)
    seqs, cut = _seqs(recipe, tokenizer, convs)
    eos = tokenizer.eos_token_id
    train_seqs = [s for s in seqs if not is_eval(s.id, recipe.eval_fraction)]
    eval_seqs = [s for s in seqs if is_eval(s.id, recipe.eval_fraction)]
    torch.manual_seed(recipe.seed)
    heads = start_heads(recipe, base, [seg for s in train_seqs for seg in _segments(s, None, eos)])
    config = heads.config
    vocab = config.draft_vocab or list(range(config.vocab_size))
    index = draft_index(vocab, config.vocab_size)
    model = get_peft_model(base, LoraConfig(r=recipe.lora_rank, lora_alpha=recipe.lora_alpha, lora_dropout=0.0,
                                            target_modules=[t.strip() for t in recipe.lora_targets.split(",")
                                                            if t.strip()]))
    optimizer = torch.optim.AdamW([{"params": list(heads.parameters()), "lr": recipe.lr},
                                   {"params": [p for p in model.parameters() if p.requires_grad],
                                    "lr": recipe.lora_lr}], weight_decay=recipe.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, recipe.warmup_steps, recipe.max_steps)
    step = 0
    if resume:
        step = load_checkpoint(ckpt, heads, optimizer, scheduler)
        set_peft_model_state_dict(model, load_file(ckpt / "adapter.safetensors"))
    model, heads, optimizer, scheduler = accelerator.prepare(model, heads, optimizer, scheduler)
    device = accelerator.device
    lengths = [s.ids.shape[0] for s in train_seqs]
    order = lru_cache(1)(lambda epoch: epoch_batches(lengths, recipe.batch_size, recipe.seed * 100_003 + epoch))

    def loss(batch: list[Seq]) -> tuple[torch.Tensor, dict]:
        adapted, frozen, hidden, rows, cols = _forward(model, batch, device)
        segments = [seg for b, s in enumerate(batch) for seg in _segments(s, hidden[b], eos)]
        split = build_split(segments, recipe.num_heads, index, config.context_size)
        t = split.targets
        head_loss, _ = medusa_loss(heads(split.hidden.float(), split.context.to(device)),
                                   t.masked_fill(t == OOV, IGNORE).to(device), recipe.decay)
        ids = torch.stack([batch[b].ids[c + 1] for b, c in zip(rows.tolist(), cols.tolist())]).to(device)
        lm = F.cross_entropy(adapted, ids)
        kl = _kl(adapted, frozen)
        total = head_loss + recipe.lm_weight * lm + recipe.kl_weight * kl
        return total, {"heads": float(head_loss.detach()), "lm": float(lm.detach()), "kl": float(kl.detach())}

    def save(step: int) -> None:
        def write(folder: Path) -> None:
            save_heads(folder, accelerator.unwrap_model(heads))
            adapter = get_peft_model_state_dict(accelerator.unwrap_model(model))
            save_file({k: v.detach().cpu().contiguous() for k, v in adapter.items()}, folder / "adapter.safetensors")
        save_checkpoint(ckpt, write, optimizer, scheduler, step, recipe)

    info = {"conversations": len(seqs), "left_out_too_long": len(cut), "train_conversations": len(train_seqs),
            "eval_conversations": len(eval_seqs), "draft_vocab": len(vocab), "joint": True}
    return Job(step, (heads, model), optimizer, scheduler, max(len(train_seqs) // recipe.batch_size, 1),
               lambda epoch, p: [train_seqs[i] for i in order(epoch)[p]], loss,
               lambda: evaluate_joint(model, accelerator.unwrap_model(heads), eval_seqs or train_seqs[:8], index,
                                      recipe, device, eos),
               save, info, {"adapter": ADAPTER_DIR}, eval_first=bool(recipe.init_heads),
               finish=lambda out: accelerator.unwrap_model(model).save_pretrained(out / ADAPTER_DIR,
                                                                                  safe_serialization=True))


@torch.no_grad()
def evaluate_joint(model, heads: MedusaHeads, seqs: list[Seq], index: torch.Tensor, recipe: TrainRecipe, device,
                   eos: int | None) -> dict:
    """Held-out heads accuracy on the adapted model's hidden states, and its KL to the frozen target."""
    segments, kl_sum, n = [], 0.0, 0
    seqs = sorted(seqs, key=lambda s: s.ids.shape[0])  # batches of like length pad little
    for i in range(0, len(seqs), recipe.batch_size):
        batch = seqs[i : i + recipe.batch_size]
        adapted, frozen, hidden, rows, _ = _forward(model, batch, device)
        kl_sum += float(_kl(adapted, frozen, "sum"))
        n += rows.shape[0]
        segments += [Segment(g.id, g.hidden.cpu(), g.tokens)
                     for b, s in enumerate(batch) for g in _segments(s, hidden[b], eos)]
    metrics = evaluate(heads, build_split(segments, recipe.num_heads, index, heads.config.context_size), recipe.decay)
    return {**metrics, "kl_to_frozen": kl_sum / max(n, 1)}
