"""Medusa-2: train the heads jointly with peft LoRA adapters on the target (lora_rank > 0 in the recipe).

The target runs on every step (no cached features): its hidden states now move with the adapters. The loss is
the heads' Medusa loss + lm_weight * the target's CE on the distilled answers + kl_weight * KL(frozen target ||
adapted target), on answer tokens only. The output is a heads directory with the adapter in `adapter/`;
MedusaModel.from_pretrained merges it into the base, and generation is then lossless with respect to the
ADAPTED model (not the original one)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from accelerate.utils import extract_model_from_parallel
from safetensors.torch import load_file
from tqdm import tqdm

from medusa_heads.checkpoint import base_fingerprint, save_heads
from medusa_heads.heads import MedusaHeads
from medusa_heads.inference.tap import LMHeadTap
from medusa_heads.prompting import conversation_ids
from medusa_heads.training.data import is_eval, read_conversations
from medusa_heads.training.features import Segment, answer_segments
from medusa_heads.training.loss import IGNORE, medusa_loss
from medusa_heads.training.recipe import TrainRecipe
from medusa_heads.training.trainer import OOV, build_split, choose_draft_vocab, draft_index, evaluate, load_checkpoint, plot_log, prepare_output, save_checkpoint

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
    from accelerate import Accelerator
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

    from medusa_heads.default_model import resolve_model

    out, ckpt = prepare_output(recipe, resume)
    accelerator = Accelerator(mixed_precision=recipe.mixed_precision, gradient_accumulation_steps=recipe.grad_accum)
    if accelerator.num_processes > 1:
        raise NotImplementedError("joint (LoRA) training runs in one process; Medusa-1 training runs distributed")
    path = resolve_model(recipe.model)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    fingerprint = base_fingerprint(base)
    lm_weight = base.get_output_embeddings().weight.detach()
    embed_weight = base.get_input_embeddings().weight.detach()

    seqs, cut = [], []
    eos = tokenizer.eos_token_id
    for conv in read_conversations(recipe.data):
        ids, mask = conversation_ids(tokenizer, conv["messages"], recipe.max_length)
        finished = [m.get("finished", True) for m in conv["messages"] if m["role"] == "assistant"]
        (seqs if mask[1:].any() else cut).append(Seq(conv["id"], ids, mask, finished))
    if cut:  # said, not silently dropped
        print(f"joint training: {len(cut)} conversations have no answer token within max_length={recipe.max_length} "
              f"and are left out (first: {cut[0].id})", file=sys.stderr)
    if not seqs:
        raise ValueError(f"no answers to train on in {recipe.data}")
    train_seqs = [s for s in seqs if not is_eval(s.id, recipe.eval_fraction)]
    eval_seqs = [s for s in seqs if is_eval(s.id, recipe.eval_fraction)]
    torch.manual_seed(recipe.seed)
    if recipe.init_heads:  # stage 2 of Medusa-2: heads trained on the frozen target first
        from medusa_heads.checkpoint import check_fingerprint, load_config, load_heads

        config = load_config(recipe.init_heads)
        check_fingerprint(config, base)
        if (config.num_heads, config.condition) != (recipe.num_heads, recipe.condition):
            raise ValueError(f"init_heads {recipe.init_heads} has num_heads={config.num_heads}, condition={config.condition!r}; "
                             f"the recipe says num_heads={recipe.num_heads}, condition={recipe.condition!r}")
        heads = load_heads(recipe.init_heads, lm_weight, config, embed_weight)
        vocab = config.draft_vocab or list(range(lm_weight.shape[0]))
    else:  # the draft vocabulary from the training answers, as in Medusa-1 training
        vocab = choose_draft_vocab([seg for s in train_seqs for seg in _segments(s, None, eos)],
                                   recipe.draft_vocab_size, lm_weight.shape[0])
        config = recipe.heads_config(*lm_weight.shape, vocab, fingerprint)
        heads = MedusaHeads(config, lm_weight, embed_weight)
    index = draft_index(vocab, lm_weight.shape[0])
    lora = LoraConfig(r=recipe.lora_rank, lora_alpha=recipe.lora_alpha, lora_dropout=0.0,
                      target_modules=[t.strip() for t in recipe.lora_targets.split(",") if t.strip()])
    model = get_peft_model(base, lora)
    adapter_params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": list(heads.parameters()), "lr": recipe.lr},
                                   {"params": adapter_params, "lr": recipe.lora_lr}], weight_decay=recipe.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, recipe.warmup_steps, recipe.max_steps)
    step = 0
    if resume and ckpt.exists():
        step = load_checkpoint(ckpt, heads, optimizer, scheduler)
        set_peft_model_state_dict(model, load_file(ckpt / "adapter.safetensors"))
    model, heads, optimizer, scheduler = accelerator.prepare(model, heads, optimizer, scheduler)
    device = accelerator.device

    def losses(batch) -> tuple[torch.Tensor, dict]:
        adapted, frozen, hidden, rows, cols = _forward(model, batch, device)
        segments = [seg for b, s in enumerate(batch) for seg in _segments(s, hidden[b], eos)]
        split = build_split(segments, recipe.num_heads, index, config.context_size)
        t = split.targets
        head_loss, _ = medusa_loss(heads(split.hidden.float(), split.context.to(device)), t.masked_fill(t == OOV, IGNORE).to(device), recipe.decay)
        ids = torch.stack([batch[b].ids[c + 1] for b, c in zip(rows.tolist(), cols.tolist())]).to(device)
        lm = F.cross_entropy(adapted, ids)
        kl = _kl(adapted, frozen)
        total = head_loss + recipe.lm_weight * lm + recipe.kl_weight * kl
        return total, {"heads": float(head_loss.detach()), "lm": float(lm.detach()), "kl": float(kl.detach())}

    log_path = out / "train_log.jsonl"
    if step == 0:
        log_path.write_text(json.dumps({"kind": "data", "conversations": len(seqs), "left_out_too_long": len(cut), "train_conversations": len(train_seqs),
                                        "eval_conversations": len(eval_seqs), "draft_vocab": len(vocab), "joint": True}) + "\n")
    if step == 0 and recipe.init_heads:  # where stage 2 starts: the heads on the unadapted target
        metrics = evaluate_joint(model, accelerator.unwrap_model(heads), eval_seqs or train_seqs[:8], index, recipe, device, eos)
        with log_path.open("a") as f:
            f.write(json.dumps({"kind": "eval", "step": 0, **metrics}) + "\n")
    per_step = recipe.batch_size
    steps_per_epoch = max(len(train_seqs) // per_step, 1)
    bar = tqdm(total=recipe.max_steps, initial=step, desc="train (joint)")
    lengths, batches_of = [s.ids.shape[0] for s in train_seqs], {}
    last_eval = None  # the evaluation at max_steps, reused for the heads' config (it costs two forwards per answer)
    t0 = time.time()
    while step < recipe.max_steps:
        epoch, pos = divmod(step * recipe.grad_accum, steps_per_epoch)
        if epoch not in batches_of:  # once an epoch
            batches_of = {epoch: epoch_batches(lengths, per_step, recipe.seed * 100_003 + epoch)}
        batches = batches_of[epoch]
        for micro in range(recipe.grad_accum):
            batch = [train_seqs[i] for i in batches[(pos + micro) % steps_per_epoch]]
            with accelerator.accumulate(model, heads):
                loss, parts = losses(batch)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"loss is {float(loss.detach())} at step {step}; the last good checkpoint is {ckpt}")
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        step += 1
        bar.update(1)
        loss = float(loss.detach())
        bar.set_postfix(loss=f"{loss:.3f}", kl=f"{parts['kl']:.4f}")
        if step % recipe.eval_every == 0 or step == recipe.max_steps:
            metrics = last_eval = evaluate_joint(model, accelerator.unwrap_model(heads), eval_seqs or train_seqs[:8], index, recipe, device, eos)
            with log_path.open("a") as f:
                f.write(json.dumps({"kind": "train", "step": step, "loss": loss, **parts, "seconds": time.time() - t0}) + "\n")
                f.write(json.dumps({"kind": "eval", "step": step, **metrics}) + "\n")
            plot_log(log_path, out / "train_plot.png")
            accelerator.print(f"step {step}: " + " ".join(f"head{i + 1} top1 {metrics[f'top1_{i + 1}']:.3f}" for i in range(recipe.num_heads)))
        if step % recipe.save_every == 0 or step == recipe.max_steps:
            save_checkpoint(ckpt, accelerator.unwrap_model(heads), optimizer, scheduler, step, recipe,
                            adapter=get_peft_model_state_dict(accelerator.unwrap_model(model)))
    bar.close()
    final = accelerator.unwrap_model(heads)
    final.config.extra = {"recipe": recipe.to_dict(), "adapter": ADAPTER_DIR,
                          "final_eval": last_eval or evaluate_joint(model, final, eval_seqs or train_seqs[:8], index, recipe, device, eos)}
    save_heads(out, final, final.config)
    accelerator.unwrap_model(model).save_pretrained(out / ADAPTER_DIR, safe_serialization=True)
    return out


@torch.no_grad()
def evaluate_joint(model, heads: MedusaHeads, seqs: list[Seq], index: torch.Tensor, recipe: TrainRecipe, device, eos: int | None) -> dict:
    """Held-out heads accuracy on the adapted model's hidden states, and its KL to the frozen target."""
    segments, kl_sum, n = [], 0.0, 0
    seqs = sorted(seqs, key=lambda s: s.ids.shape[0])  # batches of like length pad little
    for i in range(0, len(seqs), recipe.batch_size):
        batch = seqs[i : i + recipe.batch_size]
        adapted, frozen, hidden, rows, _ = _forward(model, batch, device)
        kl_sum += float(_kl(adapted, frozen, "sum"))
        n += rows.shape[0]
        segments += [Segment(g.id, g.hidden.cpu(), g.tokens) for b, s in enumerate(batch) for g in _segments(s, hidden[b], eos)]
    split = build_split(segments, recipe.num_heads, index, heads.config.context_size)
    metrics = evaluate(heads, split, recipe.decay)
    metrics["kl_to_frozen"] = kl_sum / max(n, 1)
    metrics["loss"] = sum(recipe.decay**k * metrics[f"ce_{k + 1}"] for k in range(recipe.num_heads))  # heads' loss
    return metrics
