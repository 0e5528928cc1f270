"""Train Medusa heads on cached features with HF accelerate (DDP/FSDP come from `accelerate launch`)."""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from medusa_heads.checkpoint import base_fingerprint, save_heads
from medusa_heads.heads import MedusaHeads
from medusa_heads.training.data import is_eval, read_conversations
from medusa_heads.training.features import Segment, load_segments, segment_context
from medusa_heads.training.loss import IGNORE, SoftTargets, medusa_loss, teacher_topk, topk_hits
from medusa_heads.training.recipe import TrainRecipe

OOV = -1  # a real target token outside the draft vocabulary: never predictable, counted as a miss


@dataclass
class Split:
    hidden: torch.Tensor  # (N, H) bf16
    targets: torch.Tensor  # (N, K) draft indices; OOV or IGNORE
    context: torch.Tensor  # (N, S) token ids the conditioned heads read: tokens[i], tokens[i + 1], ... (S may be 0)


def choose_draft_vocab(segments: list[Segment], size: int, vocab_size: int) -> list[int]:
    """The `size` most frequent answer tokens (ties by id); size 0 = the whole vocabulary."""
    if size <= 0 or size >= vocab_size:
        return list(range(vocab_size))
    counts = Counter()
    for s in segments:
        counts.update(s.tokens.tolist())
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    if len(ranked) < size:  # fill with the lowest unused ids so the size is as asked
        used = set(ranked)
        ranked += [t for t in range(vocab_size) if t not in used][: size - len(ranked)]
    return sorted(ranked)


def draft_index(vocab: list[int], vocab_size: int) -> torch.Tensor:
    """(vocab_size,) map from a token id to its row in the draft vocabulary `vocab`, OOV outside it."""
    index = torch.full((vocab_size,), OOV, dtype=torch.long)
    index[torch.tensor(vocab)] = torch.arange(len(vocab))
    return index


def build_split(segments: list[Segment], num_heads: int, index: torch.Tensor, context_size: int = 0) -> Split:
    """Head k (1..K) at answer position i learns tokens[i + k], seeing tokens[i .. i + k - 1] if conditioned
    (teacher forcing: a drafted path only matters when it is right)."""
    hidden, targets, context = [], [], []
    for s in segments:
        n = s.tokens.shape[0]
        mapped = index[s.tokens]  # draft index or OOV
        t = torch.full((n, num_heads), IGNORE, dtype=torch.long)
        for k in range(1, num_heads + 1):
            if n > k:
                t[: n - k, k - 1] = mapped[k:]
        hidden.append(s.hidden)
        targets.append(t)
        context.append(segment_context(s.tokens, context_size))
    return Split(torch.cat(hidden), torch.cat(targets), torch.cat(context))


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


@torch.no_grad()
def evaluate(heads: MedusaHeads, split: Split, decay: float, chunk: int = 4096) -> dict:
    k = heads.config.num_heads
    hits, counted, ce_sum = torch.zeros(k, 2), torch.zeros(k), torch.zeros(k)
    for a in range(0, split.hidden.shape[0], chunk):
        h = split.hidden[a : a + chunk].to(heads.shared_weight.dtype if heads.shared_weight is not None else torch.float32)
        t = split.targets[a : a + chunk]
        logits = heads(h, split.context[a : a + chunk])
        hh, cc = topk_hits(logits, t)
        hits += hh
        counted += cc
        _, m = medusa_loss(logits, t.masked_fill(t == OOV, IGNORE), decay)
        ce_sum += torch.tensor([m[f"ce_{i + 1}"] if math.isfinite(m[f"ce_{i + 1}"]) else 0.0 for i in range(k)]) * cc
    out = {}
    for i in range(k):
        out[f"top1_{i + 1}"] = float(hits[i, 0] / counted[i].clamp_min(1))
        out[f"top5_{i + 1}"] = float(hits[i, 1] / counted[i].clamp_min(1))
        out[f"ce_{i + 1}"] = float(ce_sum[i] / counted[i].clamp_min(1))
    return out


# ---- checkpoints: safetensors + JSON only, written to a temporary folder and renamed -------------------------------

def save_checkpoint(folder: Path, heads: MedusaHeads, optimizer, scheduler, step: int, recipe: TrainRecipe,
                    adapter: dict[str, torch.Tensor] | None = None) -> None:
    """Heads, optimizer and scheduler state (and a LoRA adapter's tensors in joint training), all or nothing."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_heads(tmp, heads)
    if adapter is not None:
        save_file({k: v.detach().cpu().contiguous() for k, v in adapter.items()}, tmp / "adapter.safetensors")
    state = optimizer.state_dict()
    tensors = {f"state.{i}.{name}": v.detach().cpu() for i, s in state["state"].items() for name, v in s.items()}
    save_file(tensors or {"empty": torch.zeros(0)}, tmp / "optimizer.safetensors")
    meta = {"step": step, "param_groups": state["param_groups"], "scheduler": scheduler.state_dict(), "recipe": recipe.to_dict()}
    (tmp / "trainer_state.json").write_text(json.dumps(meta, indent=1))
    old = folder.with_name(folder.name + ".old")
    if folder.exists():
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(folder: Path, heads: MedusaHeads, optimizer, scheduler) -> int:
    from safetensors.torch import load_file as load_st

    heads.load_state_dict(load_st(folder / "heads.safetensors"))
    meta = json.loads((folder / "trainer_state.json").read_text())
    tensors = load_file(folder / "optimizer.safetensors")
    state: dict = {}
    for key, v in tensors.items():
        if key == "empty":
            continue
        _, i, name = key.split(".", 2)
        state.setdefault(int(i), {})[name] = v
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    scheduler.load_state_dict(meta["scheduler"])
    return int(meta["step"])


def plot_log(log_path: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    evals = [r for r in rows if r.get("kind") == "eval"]
    trains = [r for r in rows if r.get("kind") == "train"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot([r["step"] for r in trains], [r["loss"] for r in trains], label="train loss")
    a.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="eval loss")
    a.set_xlabel("step")
    a.legend()
    for k in range(1, 1 + max((int(key.split("_")[1]) for key in (evals[0] if evals else {}) if key.startswith("top1_")), default=0)):
        b.plot([r["step"] for r in evals], [r[f"top1_{k}"] for r in evals], "o-", label=f"head {k} top-1")
    b.set_xlabel("step")
    b.set_ylabel("held-out accuracy")
    b.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def prepare_output(recipe: TrainRecipe, resume: bool) -> tuple[Path, Path]:
    """The output and checkpoint folders, refused before any work if unwritable or already used without --resume."""
    out = Path(recipe.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"output directory {out} is not writable: {e}") from None
    ckpt = out / "checkpoint"
    if ckpt.exists() and not resume:
        raise ValueError(f"{ckpt} exists: pass --resume to continue that run, or choose another --out")
    return out, ckpt


def train(recipe: TrainRecipe, resume: bool = False) -> Path:
    """Train heads per the recipe; returns the heads directory. Rerun with resume=True after an interruption."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup

    from medusa_heads.default_model import resolve_model

    if recipe.lora_rank > 0:
        from medusa_heads.training.joint import train_joint

        return train_joint(recipe, resume)
    out, ckpt = prepare_output(recipe, resume)

    accelerator = Accelerator(mixed_precision=recipe.mixed_precision, gradient_accumulation_steps=recipe.grad_accum)
    base = AutoModelForCausalLM.from_pretrained(resolve_model(recipe.model), dtype=torch.float32)
    lm_weight = base.get_output_embeddings().weight.detach()
    embed_weight = base.get_input_embeddings().weight.detach()

    convs = read_conversations(recipe.data)
    known = {c["id"] for c in convs}
    segments = load_segments(recipe.features, keep_ids=known)
    if not segments:
        raise ValueError(f"no features in {recipe.features} for the conversations in {recipe.data}")
    train_segs = [s for s in segments if not is_eval(s.conv_id, recipe.eval_fraction)]
    eval_segs = [s for s in segments if is_eval(s.conv_id, recipe.eval_fraction)]
    vocab = choose_draft_vocab(train_segs, recipe.draft_vocab_size, lm_weight.shape[0])
    index = draft_index(vocab, lm_weight.shape[0])
    config = recipe.heads_config(*lm_weight.shape, vocab, base_fingerprint(base))
    train_split = build_split(train_segs, recipe.num_heads, index, config.context_size)
    eval_split = build_split(eval_segs, recipe.num_heads, index, config.context_size)
    teacher = None
    if recipe.soft_weight > 0:  # the target's distribution at every train position, once (features are fixed)
        rows = lm_weight[torch.tensor(vocab)].to(torch.bfloat16)
        teacher = teacher_topk(train_split.hidden, rows, recipe.soft_topk)
    torch.manual_seed(recipe.seed)
    heads = MedusaHeads(config, lm_weight, embed_weight)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, recipe.warmup_steps, recipe.max_steps)
    step = load_checkpoint(ckpt, heads, optimizer, scheduler) if resume and ckpt.exists() else 0
    model, optimizer, scheduler = accelerator.prepare(heads, optimizer, scheduler)

    data_info = {
        "conversations": len(known), "train_tokens": int(train_split.hidden.shape[0]),
        "eval_tokens": int(eval_split.hidden.shape[0]), "draft_vocab": len(vocab),
        "coverage_train": coverage(train_split), "coverage_eval": coverage(eval_split),
    }
    log_path = out / "train_log.jsonl"
    if accelerator.is_main_process:
        accelerator.print(f"data: {data_info}")
        if step == 0:
            log_path.write_text(json.dumps({"kind": "data", **data_info}) + "\n")

    world, rank, n = accelerator.num_processes, accelerator.process_index, train_split.hidden.shape[0]
    per_step = recipe.batch_size * world
    steps_per_epoch = max(n // per_step, 1)
    bar = tqdm(total=recipe.max_steps, initial=step, desc="train", disable=not accelerator.is_main_process)
    t0, last_loss = time.time(), float("nan")
    while step < recipe.max_steps:
        epoch, pos = divmod(step * recipe.grad_accum, steps_per_epoch)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(recipe.seed * 100_003 + epoch))
        for micro in range(recipe.grad_accum):
            p = (pos + micro) % steps_per_epoch
            idx = perm[p * per_step + rank * recipe.batch_size : p * per_step + (rank + 1) * recipe.batch_size]
            h = train_split.hidden[idx].float()
            t = train_split.targets[idx]
            with accelerator.accumulate(model):
                logits = model(h, train_split.context[idx])
                soft = soft_batch(teacher, idx, t) if teacher is not None else None
                loss, _ = medusa_loss(logits, t.masked_fill(t == OOV, IGNORE), recipe.decay, soft, recipe.soft_weight)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"loss is {float(loss.detach())} at step {step}; the last good checkpoint is {ckpt}")
                accelerator.backward(loss)
                optimizer.step()  # accelerate's wrappers step only when the accumulated gradients are synced
                scheduler.step()
                optimizer.zero_grad()
        step += 1
        last_loss = float(loss.detach())
        bar.update(1)
        bar.set_postfix(loss=f"{last_loss:.3f}")
        if accelerator.is_main_process and (step % recipe.eval_every == 0 or step == recipe.max_steps):
            metrics = evaluate(accelerator.unwrap_model(model), eval_split, recipe.decay)
            eval_loss = sum(recipe.decay**i * metrics[f"ce_{i + 1}"] for i in range(recipe.num_heads))
            with log_path.open("a") as f:
                f.write(json.dumps({"kind": "train", "step": step, "loss": last_loss, "lr": scheduler.get_last_lr()[0], "seconds": time.time() - t0}) + "\n")
                f.write(json.dumps({"kind": "eval", "step": step, "loss": eval_loss, **metrics}) + "\n")
            plot_log(log_path, out / "train_plot.png")
            accelerator.print(f"step {step}: " + " ".join(f"head{i + 1} top1 {metrics[f'top1_{i + 1}']:.3f}" for i in range(recipe.num_heads)))
        if accelerator.is_main_process and (step % recipe.save_every == 0 or step == recipe.max_steps):
            save_checkpoint(ckpt, accelerator.unwrap_model(model), optimizer, scheduler, step, recipe)
        accelerator.wait_for_everyone()
    bar.close()
    if accelerator.is_main_process:
        final = accelerator.unwrap_model(model)
        final.config.extra = {"recipe": recipe.to_dict(), "data": data_info, "final_eval": evaluate(final, eval_split, recipe.decay)}
        save_heads(out, final, final.config)
    accelerator.wait_for_everyone()
    return out
