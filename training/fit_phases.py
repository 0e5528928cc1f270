"""fit's train, calibrate and bench phases, each sized by the time the plan left it."""
from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import torch

from medusa_heads.bench import run_bench
from medusa_heads.calibration import Settings, UntrustedTimings, calibrate, held_out_conversations
from medusa_heads.corpus import read_conversations, read_prompts
from medusa_heads import llamacpp
from medusa_heads.heads import MedusaHeads
from medusa_heads.loading import is_gguf
from medusa_heads.model import MedusaModel
from medusa_heads.training.fit_plan import BENCH_TOKENS, MIN_STEPS, FitRun, Now, per_unit
from medusa_heads.training.loss import medusa_loss
from medusa_heads.training.recipe import TrainRecipe
from medusa_heads.training.trainer import train


def train_heads(run: FitRun, seconds: float, deadline: float) -> dict:
    """Steps as many as the phase's time buys at one timed step (measured on the heads themselves); past the
    deadline (in `now`'s time) training stops at the step it is on, with a final evaluation and the heads saved."""
    state, out = run.state, run.out
    files = [str(p) for p in run.data if p.is_file() and p.stat().st_size]
    rules = state["rules"]["recipe"]
    if "steps" not in state:
        per = time_step(run.base, rules, run.now)
        n = max(MIN_STEPS, int(seconds * 0.95 / per))  # evaluation and checkpoints: the rest; the deadline bounds it
        n = min(n, run.max_steps) if run.max_steps else n
        state["steps"] = {"max_steps": n, "seconds_per_step": per}
        run.save()
        run.log(f"fit: {per:.3f} s a step: {n} steps")
    n = state["steps"]["max_steps"]
    recipe = TrainRecipe(model=state["model"], data=",".join(files), features=str(out / "features"), out=str(out),
                         max_steps=n, warmup_steps=max(1, min(50, n // 10)), eval_every=max(1, n // 4),
                         save_every=max(1, n // 4), seed=state["seed"], **rules)
    train(recipe, resume=True, deadline=deadline, now=run.now)
    log_rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines() if line.strip()]
    data_row = next(r for r in log_rows if r["kind"] == "data")
    final = [r for r in log_rows if r["kind"] == "eval"][-1]
    steps = max(r["step"] for r in log_rows if r["kind"] == "eval")
    return {"steps": steps, "planned_steps": n, "train_tokens": data_row["train_tokens"],
            "eval_tokens": data_row["eval_tokens"], "top1": [final[f"top1_{k + 1}"] for k in range(rules["num_heads"])]}


def time_step(base, rules: dict, now: Now = time.time, repeats: int = 3) -> float:
    """Seconds of one optimizer step of these heads over a batch of random features (the median of `repeats`)."""
    lm, emb = base.get_output_embeddings().weight.detach(), base.get_input_embeddings().weight.detach()
    recipe = TrainRecipe(model="", **rules)
    vocab = list(range(min(rules["draft_vocab_size"] or lm.shape[0], lm.shape[0])))
    heads = MedusaHeads(recipe.heads_config(*lm.shape, vocab, {}), lm, emb)
    opt = torch.optim.AdamW(heads.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    b, k = rules["batch_size"], rules["num_heads"]
    hidden = torch.randn(b, lm.shape[1], generator=g)
    context = torch.randint(0, lm.shape[0], (b, heads.config.context_size), generator=g)
    targets = torch.randint(0, len(vocab), (b, k), generator=g)
    times = []
    for _ in range(repeats + 1):
        s = now()
        loss = medusa_loss(heads(hidden, context), targets, rules["decay"])[0]
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(now() - s)
    return per_unit(sorted(times[1:])[len(times[1:]) // 2], 1)  # the first warms up


def calibrate_heads(run: FitRun) -> dict:
    """Acceptance, lookup, the phrasebook and the kernels' cost; timings refused under load are not stored
    (unless force_cost) and the heads then keep their fixed tree."""
    base, out, force_cost, log = run.base, run.out, run.force_cost, run.log
    convs = [c for p in run.data if p.is_file() for c in read_conversations(p)]
    held = held_out_conversations(convs, out)
    ids = {c["id"] for c in held}
    learn = [c for c in convs if c["id"] not in ids]
    model = MedusaModel.from_pretrained(base, heads=str(out))
    positions = getattr(base.config, "max_position_embeddings", None) or 1 << 20
    settings = Settings(repeats=5, contexts=tuple(c for c in Settings.contexts if c < positions) or (positions // 2,))
    problem, attempts = None, [["acceptance", "lookup", "ngrams", "cost"], ["acceptance", "lookup", "cost"],
                               ["lookup", "cost"], ["cost"]]
    for parts in attempts:  # the first the data allows: acceptance needs held-out answers in both halves, lookup tokens
        try:
            calibrate(model, run.tok, out, parts, held, out / "features", settings,
                      phrase_data=(learn, held) if "ngrams" in parts else None, force_cost=force_cost, log=log)
            break
        except UntrustedTimings as e:
            problem = str(e)
            log(f"fit: {problem}: the heads keep their fixed tree")
            break
        except ValueError as e:
            log(f"fit: calibrating {', '.join(parts)}: {e}; trying with less")
    else:
        parts = []  # nothing calibrated: the heads keep their fixed tree
    info = {"held_out": len(held), "parts": parts, "untrusted_timings": problem, "forced": force_cost}
    gguf = llamacpp_file(run)
    if isinstance(gguf, Path):  # a GGUF model: llama.cpp's verify too, so its trees are sized for its step
        on_llama = MedusaModel.from_pretrained(base, heads=str(out), gguf=gguf)
        try:
            calibrate(on_llama, run.tok, out, ["cost"], [], out / "features", settings, force_cost=force_cost, log=log)
            info["llamacpp_cost"] = on_llama.engine.kernels()
        except UntrustedTimings as e:
            log(f"fit: llama.cpp's {e}: its trees keep the fixed tree")
        finally:
            on_llama.engine.close()
    return info


def llamacpp_file(run: FitRun) -> Path | str | None:
    """A GGUF model's file where llama.cpp can run it here; why not (a line) where it cannot; None for a model that
    is not a GGUF file."""
    model = run.state["model"]
    if not is_gguf(model):
        return None
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama.cpp is not built here (make llamacpp-setup builds it)"
    weights = llamacpp.file_weights(Path(model))
    if weights not in llamacpp.WEIGHTS:
        return f"{weights.upper()} is not among the weights the bench names ({', '.join(llamacpp.WEIGHTS)})"
    return Path(model)


def bench_heads(run: FitRun, seconds: float) -> dict:
    """A short bench against generate on held-out prompts: the plan's number, fewer if less time is left."""
    state, bench_prompts = run.state, run.bench_prompts
    model = MedusaModel.from_pretrained(run.base, heads=str(run.out))
    rows = read_prompts(bench_prompts)
    if "bench_prompts" not in state:  # the plan's, fewer where less time is left (at least 2)
        per_prompt = state["plan"]["bench_s"] / state["plan"]["bench_prompts"]
        state["bench_prompts"] = max(2, min(state["plan"]["bench_prompts"], int(seconds / per_prompt)))
    # transformers' prompt lookup beside the heads: the free baseline a user has without training anything
    result = run_bench(model, run.tok, rows[: state["bench_prompts"]], ["hf", "pld", "medusa"], BENCH_TOKENS)
    m, pld = result["overall"]["medusa"], result["overall"]["pld"]
    info = {"prompts": state["bench_prompts"], "tau": m["mean_accepted"], "speedup": m["speedup_vs_hf"],
            "differ": m["mismatches_vs_hf"], "file": str(bench_prompts),
            "per_step_tree": model.cost_model() is not None, "pld_speedup": pld["speedup_vs_hf"],
            "pld_tau": pld["mean_accepted"]}
    gguf = llamacpp_file(run)
    if gguf is not None:
        info["llamacpp"] = {"skipped": gguf} if isinstance(gguf, str) else \
            _bench_on_llamacpp(model, run.tok, rows[: state["bench_prompts"]], gguf)
    return info


def _bench_on_llamacpp(model: MedusaModel, tok, rows: list, gguf: Path) -> dict:
    """The heads on llama.cpp against llama.cpp's plain decoding of the user's own GGUF file, alternating per prompt."""
    weights = llamacpp.file_weights(gguf)
    heads, plain = f"medusa-llamacpp-{weights}", f"llamacpp-{weights}"
    result = run_bench(model, tok, rows, [heads, plain], BENCH_TOKENS, gguf_files={weights: gguf})["overall"]
    h, p = result[heads], result[plain]
    return {"file": str(gguf), "weights": weights, "prompts": len(rows), "tokens_per_s": h["tokens_per_s"],
            "plain_tokens_per_s": p["tokens_per_s"], "x_plain": h["tokens_per_s"] / p["tokens_per_s"],
            "tau": h["mean_accepted"], "differ": h["mismatches_vs_plain"]}
