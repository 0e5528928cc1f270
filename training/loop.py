"""The one training loop on HF accelerate, and what both trainers share: the data file, the draft vocabulary,
head targets and their evaluation, checkpoints, the log and its plot.

Medusa-1 (trainer.py: heads on cached features) and Medusa-2 (joint.py: heads with LoRA on the target) differ only
in what they hand the loop as a `Job`: micro-batches, a loss, a held-out evaluation and what a checkpoint holds."""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from medusa_heads.checkpoint import (WEIGHTS_NAME, base_fingerprint, check_fingerprint, follow_umask, load_config,
                                     load_heads, save_heads)
from medusa_heads.faults import crash_point
from medusa_heads.heads import MedusaHeads
from medusa_heads.corpus import check_eval_split, read_conversations
from medusa_heads.shards import Segment, segment_context
from medusa_heads.training.loss import IGNORE, medusa_loss, topk_hits
from medusa_heads.training.recipe import TrainRecipe

OOV = -1  # a real target token outside the draft vocabulary: never predictable, counted as a miss


def read_data(paths: str | os.PathLike) -> list[dict]:
    """The conversations to train on, from one JSONL file or several (comma-separated: e.g. the greedy answers and
    a sampled variant). A missing or empty file, or a conversation id in two files, is said at once."""
    convs, origin = [], {}
    for path in [p.strip() for p in str(paths).split(",") if p.strip()]:
        if not Path(path).is_file():
            beside = f"; {path}.gz is beside it: name that" if Path(f"{path}.gz").is_file() else ""
            raise FileNotFoundError(f"training data {path} does not exist "
                                    f"(write it with `medusa-heads distill`){beside}")
        rows = read_conversations(path)
        if not rows:
            raise ValueError(f"training data {path} holds no conversations")
        for row in rows:
            if row["id"] in origin:
                raise ValueError(f"conversation {row['id']!r} is in both {origin[row['id']]} and {path}: give each "
                                 "answer set once (a further answer per prompt is distilled with --variant)")
            origin[row["id"]] = path
        convs += rows
    if not convs:
        raise ValueError(f"no training data named in {str(paths)!r}")
    return convs


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


def new_heads(recipe: TrainRecipe, base, segments: list[Segment]) -> MedusaHeads:
    """Untrained heads for this base, over the draft vocabulary of these (training) answers."""
    lm_weight, embed_weight = base.get_output_embeddings().weight.detach(), base.get_input_embeddings().weight.detach()
    vocab = choose_draft_vocab(segments, recipe.draft_vocab_size, lm_weight.shape[0])
    return MedusaHeads(recipe.heads_config(*lm_weight.shape, vocab, base_fingerprint(base)), lm_weight, embed_weight)


def start_heads(recipe: TrainRecipe, base, segments: list[Segment]) -> MedusaHeads:
    """The heads training starts from: new ones over the draft vocabulary of these (training) answers, or, with
    recipe.init_heads, trained heads to continue (their own draft vocabulary; their shape must be the recipe's)."""
    if not recipe.init_heads:
        return new_heads(recipe, base, segments)
    config = load_config(recipe.init_heads)
    check_fingerprint(config, base)
    have = {k: getattr(config, k) for k in ("num_heads", "num_layers", "mlp_size", "condition")}
    want = {k: getattr(recipe, k) for k in have}
    if have != want:
        diff = ", ".join(f"{k}={have[k]!r} (recipe: {want[k]!r})" for k in have if have[k] != want[k])
        raise ValueError(f"init_heads {recipe.init_heads} are not the heads this recipe trains: {diff}")
    if config.adaptive and "acceptance" in config.adaptive:  # fitted to the init heads' confidence, not these:
        # `calibrate --parts acceptance` measures theirs (the cost model and lookup rates do not depend on the weights)
        config.adaptive = {k: v for k, v in config.adaptive.items() if k != "acceptance"}
    return load_heads(recipe.init_heads, base.get_output_embeddings().weight.detach(), config,
                      base.get_input_embeddings().weight.detach())  # weights stored in bf16 load into fp32 parameters


@dataclass
class Split:
    hidden: torch.Tensor  # (N, H) bf16
    targets: torch.Tensor  # (N, K) draft indices; OOV or IGNORE
    context: torch.Tensor  # (N, S) token ids the conditioned heads read: tokens[i], tokens[i + 1], ... (S may be 0)


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


@torch.no_grad()
def evaluate(heads: MedusaHeads, split: Split, decay: float, chunk: int = 4096) -> dict:
    """Per head: top-1 and top-5 accuracy and CE on the split; "loss" is the heads' Medusa loss."""
    k = heads.config.num_heads
    hits, counted, ce_sum = torch.zeros(k, 2), torch.zeros(k), torch.zeros(k)
    for a in range(0, split.hidden.shape[0], chunk):
        h = split.hidden[a : a + chunk].to(
            heads.shared_weight.dtype if heads.shared_weight is not None else torch.float32)
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
    out["loss"] = sum(decay**i * out[f"ce_{i + 1}"] for i in range(k))
    return out


# ---- checkpoints: safetensors + JSON only, written to a temporary folder and renamed -------------------------------

def save_checkpoint(folder: Path, write: Callable[[Path], None], optimizer, scheduler, step: int,
                    recipe: TrainRecipe) -> None:
    """All or nothing: what `write(folder)` puts there (the heads, an adapter), the optimizer and scheduler state."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    state = optimizer.state_dict()
    tensors = {f"state.{i}.{name}": v.detach().cpu() for i, s in state["state"].items() for name, v in s.items()}
    save_file(tensors or {"empty": torch.zeros(0)}, tmp / "optimizer.safetensors")
    meta = {"step": step, "param_groups": state["param_groups"], "scheduler": scheduler.state_dict(),
            "recipe": recipe.to_dict()}
    (tmp / "trainer_state.json").write_text(json.dumps(meta, indent=1))
    follow_umask(tmp)  # save_file (the optimizer's, an adapter's) writes 0600
    old = folder.with_name(folder.name + ".old")
    if folder.exists():
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(folder: Path, heads: MedusaHeads, optimizer, scheduler) -> int:
    """The heads, optimizer and scheduler state (an adapter is the caller's); returns the step."""
    heads.load_state_dict(load_file(folder / WEIGHTS_NAME))
    meta = json.loads((folder / "trainer_state.json").read_text())
    state: dict = {}
    for key, v in load_file(folder / "optimizer.safetensors").items():
        if key != "empty":
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
    for k in range(1, 1 + max((int(key.split("_")[1]) for key in (evals[0] if evals else {})
                               if key.startswith("top1_")), default=0)):
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


# ---- the loop ------------------------------------------------------------------------------------------------------

@dataclass
class Job:
    """What one kind of training brings to the loop; its callables work on the accelerate-prepared modules."""
    step: int  # where it starts: 0, or the step of the checkpoint it resumed from
    modules: tuple  # the trained modules as accelerate prepared them, the heads first
    optimizer: Any
    scheduler: Any
    steps_per_epoch: int
    batch: Callable[[int, int], Any]  # (epoch, micro-batch index within it) -> micro-batch
    loss: Callable[[Any], tuple[torch.Tensor, dict]]  # micro-batch -> (loss, parts logged beside it)
    evaluate: Callable[[], dict]  # held-out metrics: "loss" and top1_k among them
    save: Callable[[int], None]  # write the checkpoint at this step
    info: dict  # the log's first line (what the data is)
    extra: dict = field(default_factory=dict)  # into the final heads' config, beside the recipe and the final eval
    eval_first: bool = False  # also evaluate before the first step (heads that were trained before)
    finish: Callable[[Path], None] = lambda out: None  # write what else the output holds (an adapter)


def run(recipe: TrainRecipe, resume: bool, setup: Callable[[list[dict], Any, Path, bool], Job],
        deadline: float | None = None, now: Callable[[], float] = time.time) -> Path:
    """Train per the recipe; setup(conversations, accelerator, checkpoint folder, resume from it) builds the job.
    Returns the heads directory. Past `deadline` (read on `now`; one process only) the step it is on is the last."""
    convs = read_data(recipe.data)
    check_eval_split([c["id"] for c in convs], recipe.eval_fraction, recipe.data)
    out, ckpt = prepare_output(recipe, resume)
    accelerator = _accelerator(recipe, deadline)
    job = setup(convs, accelerator, ckpt, resume and ckpt.exists())
    main, log_path = accelerator.is_main_process, out / "train_log.jsonl"
    if main:
        who = f" ({accelerator.num_processes} processes, {accelerator.distributed_type.value})" \
            if accelerator.num_processes > 1 else ""
        accelerator.print(f"data{who}: {job.info}")
        if job.step == 0:
            _log(log_path, {"kind": "data", **job.info})
        if job.step == 0 and job.eval_first:
            _log(log_path, {"kind": "eval", "step": 0, **job.evaluate()})
    last_eval = _steps(recipe, accelerator, job, out, ckpt, deadline, now)
    if main:
        heads = accelerator.unwrap_model(job.modules[0])
        heads.config.extra = {"recipe": recipe.to_dict(), **job.extra, "final_eval": last_eval or job.evaluate()}
        save_heads(out, heads, heads.config)
        job.finish(out)
        for extra in (out / "adapter",):  # joint training's adapter, saved by peft through save_file (0600)
            if extra.exists():
                follow_umask(extra)
    accelerator.wait_for_everyone()
    return out


def _accelerator(recipe: TrainRecipe, deadline: float | None):
    """accelerate's Accelerator for this run (imported here: accelerate is only needed once training runs)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    # accelerate keeps one state per process and refuses a second run's other mixed_precision (a notebook, a sweep):
    # each run sets its own (the process group, PartialState, stays as launched)
    AcceleratorState._reset_state()
    # the schedule counts optimizer steps, whatever the number of processes: accelerate's default steps a prepared
    # scheduler once per process at each optimizer step (for a per-process schedule), so N processes would decay
    # the learning rate N times as fast as one process on the same global batch
    accelerator = Accelerator(mixed_precision=recipe.mixed_precision, gradient_accumulation_steps=recipe.grad_accum,
                              step_scheduler_with_optimizer=False)
    if deadline is not None and accelerator.num_processes > 1:
        raise ValueError("a training deadline needs one process (the processes would stop at different steps)")
    return accelerator


def _log(log_path: Path, *rows: dict) -> None:
    """Rows appended to the training log (a "data" row starts it anew)."""
    with log_path.open("a" if rows[0]["kind"] != "data" else "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def _steps(recipe: TrainRecipe, accelerator, job: Job, out: Path, ckpt: Path, deadline: float | None,
           now: Callable[[], float]) -> dict | None:
    """The optimizer steps from the job's to max_steps (or the deadline's), evaluated, logged and checkpointed on
    the way; returns the last evaluation (None if none was made here)."""
    main, step, log_path = accelerator.is_main_process, job.step, out / "train_log.jsonl"
    bar = tqdm(total=recipe.max_steps, initial=step, desc="train", disable=not main)
    t0, last_eval = time.time(), None  # the evaluation at max_steps is the final one too
    last = recipe.max_steps
    while step < last:
        loss, parts = _optimizer_step(recipe, accelerator, job, step, ckpt)
        step += 1
        if deadline is not None and now() > deadline and step < last:
            accelerator.print(f"train: the deadline has passed: step {step} of {recipe.max_steps} is the last")
            last = step
        last_loss = float(loss.detach())
        bar.update(1)
        bar.set_postfix(loss=f"{last_loss:.3f}", **{k: f"{v:.4f}" for k, v in parts.items()})
        if main and (step % recipe.eval_every == 0 or step == last):
            last_eval = job.evaluate()
            _log(log_path, {"kind": "train", "step": step, "loss": last_loss, "lr": job.scheduler.get_last_lr()[0],
                            **parts, "seconds": time.time() - t0}, {"kind": "eval", "step": step, **last_eval})
            plot_log(log_path, out / "train_plot.png")
            accelerator.print(f"step {step}: " + " ".join(f"head{i + 1} top1 {last_eval[f'top1_{i + 1}']:.3f}"
                                                          for i in range(recipe.num_heads)))
        if main and (step % recipe.save_every == 0 or step == last):
            job.save(step)
            crash_point("train")
        accelerator.wait_for_everyone()
    bar.close()
    return last_eval


def _optimizer_step(recipe: TrainRecipe, accelerator, job: Job, step: int, ckpt: Path) -> tuple[torch.Tensor, dict]:
    """One optimizer step over grad_accum micro-batches: the last micro-batch's loss and logged parts."""
    epoch, pos = divmod(step * recipe.grad_accum, job.steps_per_epoch)
    for micro in range(recipe.grad_accum):
        batch = job.batch(epoch, (pos + micro) % job.steps_per_epoch)
        with accelerator.accumulate(*job.modules):
            loss, parts = job.loss(batch)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"loss is {float(loss.detach())} at step {step}; "
                                         f"the last good checkpoint is {ckpt}")
            accelerator.backward(loss)
            job.optimizer.step()  # accelerate's wrapper steps only when the accumulated gradients are synced
            if accelerator.sync_gradients:
                job.scheduler.step()
            job.optimizer.zero_grad()
    return loss, parts
