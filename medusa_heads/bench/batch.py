"""The batched bench: transformers' batched generate against MedusaModel on the same left-padded batches, one
process, the two alternating per batch (calibration/timing.py); greedy tokens/s, tau per row, rows that differ."""
from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from medusa_heads.bench.report import _setup_text, open_results, pyplot
from medusa_heads.bench.run import ForwardCounter, runtime_settings
from medusa_heads.calibration.timing import alternate, device_sync
from medusa_heads.corpus import PromptRow
from medusa_heads.prompting import eos_ids, prompt_text, user_turn


def run_batch_bench(model, tokenizer, rows: list[PromptRow], batch_sizes: list[int], max_new_tokens: int = 128) -> dict:
    """Greedy throughput of transformers' batched generate against MedusaModel on the same left-padded batches,
    for each batch size; the same prompts (the first turns of as many rows as the largest size divides) for all
    sizes, alternating which method goes first. Returns {"by_batch": {B: {...}}, "settings": {...}}."""
    base = model.base_model
    counter = ForwardCounter(base)
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    n = len(rows) // max(batch_sizes) * max(batch_sizes)
    if n == 0:
        raise ValueError(f"need at least {max(batch_sizes)} prompts for batch size {max(batch_sizes)}, got {len(rows)}")
    texts = [prompt_text(tokenizer, user_turn(r.turns[0])) for r in rows[:n]]
    eos = set(eos_ids(model.generation_config_for().eos_token_id))
    warm = tokenizer(texts[:2], return_tensors="pt", padding=True, add_special_tokens=False).to(base.device)
    base.generate(**warm, max_new_tokens=4, do_sample=False, pad_token_id=pad)
    model.generate(warm["input_ids"], attention_mask=warm["attention_mask"], max_new_tokens=4, pad_token_id=pad)
    out = {size: _batch_size(model, tokenizer, counter, texts, size, max_new_tokens, pad, eos) for size in batch_sizes}
    counter.handle.remove()
    cost = model.cost_model() if model.adaptive else None
    tree = ("per-step trees, one size per batch" if cost is not None and cost.batched
            else f"{model.tree.num_nodes}-node tree")
    return {"by_batch": out, "settings": {"model": base.name_or_path, "max_new_tokens": max_new_tokens, "prompts": n,
                                          "tree_nodes": model.tree.num_nodes, "tree": tree,
                                          **runtime_settings(base, base.device),
                                          "cost_model": (model.cost_model_key() if cost is not None and cost.batched
                                                         else None)}}


def _batch_size(model, tokenizer, counter: ForwardCounter, texts: list[str], size: int, max_new_tokens: int,
                pad: int, eos: set[int]) -> dict:
    """Both methods on every batch of `size` texts: tokens/s (new tokens up to each row's EOS), tau per row (new
    tokens over the rows' forwards), rows whose output differs."""
    base, device = model.base_model, model.base_model.device
    acc = {m: {"seconds": 0.0, "tokens": 0, "row_forwards": 0} for m in ("hf", "medusa")}
    calls0 = {}

    def hf(enc) -> tuple[torch.Tensor, int]:
        seq = base.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
        return seq, (counter.calls - calls0["hf"]) * size

    def medusa(enc) -> tuple[torch.Tensor, int]:
        res = model.generate(enc["input_ids"], attention_mask=enc["attention_mask"], max_new_tokens=max_new_tokens,
                             pad_token_id=pad, return_dict_in_generate=True)
        return res.sequences, sum(res.stats.rows_per_step) or res.stats.steps

    batches = (tokenizer(texts[i : i + size], return_tensors="pt", padding=True, add_special_tokens=False).to(device)
               for i in tqdm(range(0, len(texts), size), desc=f"batch {size}", unit="batch"))
    mismatches = 0
    for enc, results in alternate({"hf": hf, "medusa": medusa}, batches, device_sync(device),
                                  before=lambda m: calls0.__setitem__(m, counter.calls)):
        outs = {}
        for m, ((seq, rows_fwd), dt) in results.items():
            acc[m]["seconds"] += dt
            acc[m]["tokens"] += sum(next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
                                    for row in seq[:, enc["input_ids"].shape[1]:].tolist())
            acc[m]["row_forwards"] += rows_fwd
            outs[m] = seq
        mismatches += (sum(not torch.equal(a, b) for a, b in zip(outs["hf"], outs["medusa"]))
                       if outs["hf"].shape == outs["medusa"].shape else size)
    hf_tps = acc["hf"]["tokens"] / acc["hf"]["seconds"]
    md_tps = acc["medusa"]["tokens"] / acc["medusa"]["seconds"]
    return {"hf_tokens_per_s": hf_tps, "medusa_tokens_per_s": md_tps, "speedup_vs_hf": md_tps / hf_tps,
            "mean_accepted": acc["medusa"]["tokens"] / max(acc["medusa"]["row_forwards"], 1),
            "mismatched_rows": mismatches, "rows": len(texts)}


def write_batch_results(result: dict, out: str | Path) -> None:
    out = open_results(result, out)
    st = result["settings"]
    title = (f"{st.get('model') or 'model'}: {st['max_new_tokens']} new tokens, greedy, batched, "
             f"{st.get('tree') or str(st['tree_nodes']) + '-node tree'}")
    lines = [f"# Batched throughput: {title}", "",
             f"{_setup_text(st)}.", "",
             "| batch | hf tokens/s | medusa tokens/s | speed-up | tau per row | mismatched rows |",
             "|---|---|---|---|---|---|"]
    for b, r in result["by_batch"].items():
        lines.append(f"| {b} | {r['hf_tokens_per_s']:.1f} | {r['medusa_tokens_per_s']:.1f} | "
                     f"{r['speedup_vs_hf']:.2f} | {r['mean_accepted']:.2f} | {r['mismatched_rows']}/{r['rows']} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")

    plt = pyplot()
    sizes = list(result["by_batch"])
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([int(s) for s in sizes], [result["by_batch"][s]["speedup_vs_hf"] for s in sizes], "o-")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("batch size")
    ax.set_title(title, fontsize=8)
    ax.set_ylabel("speed-up vs transformers generate")
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=100)
    plt.close(fig)
