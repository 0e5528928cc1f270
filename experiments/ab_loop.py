"""The loop the one-process A/B experiments share: each arm on every prompt, the arms' order reversed every other
prompt, tokens per second per arm and how many outputs differ from a reference arm's; and its common use, builds of
the model compared by their heads and their own `generate` (builds_ab), and one model under settings switched
between calls (settings_ab). The loop itself is the library's (medusa_heads/calibration/timing.py)."""
from __future__ import annotations

import json
from typing import Callable, Hashable

import torch
from tqdm import tqdm

from medusa_heads.calibration import timing
from medusa_heads.prompting import prompt_ids


def alternate(tok, rows, arms: dict[Hashable, Callable[[torch.Tensor], torch.Tensor]],
              reference: Callable[[Hashable], Hashable] = lambda arm: "hf") -> tuple[dict, dict]:
    """arms: name -> run(prompt ids) -> output ids (prompt included); rows: prompts (their first turn is used);
    reference(arm): the arm whose output each arm's is compared with. Returns (tokens/s, outputs differing) by arm.
    The loop is the library's (medusa_heads/calibration/timing.py: alternate)."""
    speed, differ, _ = alternate_by(tok, rows, arms, reference)["overall"]
    return speed, differ


def alternate_by(tok, rows, arms: dict[Hashable, Callable[[torch.Tensor], torch.Tensor]],
                 reference: Callable[[Hashable], Hashable] = lambda arm: "hf",
                 group: Callable[[object], str] | None = None) -> dict[str, tuple[dict, dict, int]]:
    """alternate() over all the rows ("overall") and, with `group`, over each group(row) apart as well, from the
    same rounds: {name: (tokens/s by arm, outputs differing by arm, prompts)}."""
    names = list(arms)
    totals: dict[str, tuple[dict, dict, dict, list]] = {}  # name -> (seconds, tokens, differ, [prompts])
    prompts = (prompt_ids(tok, row.turns[0]) for row in tqdm(rows, desc="A/B", unit="prompt"))
    for row, (ids, results) in zip(rows, timing.alternate(arms, prompts)):
        for name in ("overall",) if group is None else ("overall", group(row)):
            secs, tokens, differ, count = totals.setdefault(
                name, ({a: 0.0 for a in names}, {a: 0 for a in names}, {a: 0 for a in names}, [0]))
            count[0] += 1
            for arm, (out, seconds) in results.items():
                secs[arm] += seconds
                tokens[arm] += out.shape[1] - ids.shape[1]
            for arm in names:
                differ[arm] += not torch.equal(results[arm].output, results[reference(arm)].output)
    return {name: ({a: tokens[a] / secs[a] for a in names}, differ, count[0])
            for name, (secs, tokens, differ, count) in totals.items()}


def on_llamacpp(gguf: str, threads: int):
    """(tokenizer, the embedded model with its shipped heads on llama.cpp's `gguf` weights, llama.cpp's own plain
    decoding of the same file): what the llama.cpp A/Bs run, on `threads` threads."""
    from transformers import AutoTokenizer

    from medusa_heads import MedusaModel, default_model_path, llamacpp

    torch.set_num_threads(threads)
    path = default_model_path()
    model = MedusaModel.from_pretrained(path, gguf=gguf, threads=threads)
    return AutoTokenizer.from_pretrained(path), model, llamacpp.Plain(llamacpp.gguf(path, gguf), threads=threads)


def against_plain(tok, rows, plain, max_new_tokens: int, heads: dict, title: list[str],
                  out: str | None) -> dict:
    """llama.cpp's plain decoding (`plain`: llamacpp.Plain) against arms of the heads on it (name -> run(prompt ids)
    -> output ids), each warmed up once, then alternate_by() by category with plain as every arm's reference: a
    markdown table of each arm's tokens/s over plain and its outputs differing, under `title` (lines), printed and
    written to `out` with the numbers as JSON. Returns the numbers by category."""
    arms = {"plain": lambda ids: torch.tensor([ids[0].tolist() + plain.generate(ids[0].tolist(), max_new_tokens)[0]]),
            **heads}
    for arm in arms.values():
        arm(prompt_ids(tok, "Hello"))
    table = {}
    for name, (speed, differ, prompts) in alternate_by(tok, rows, arms, reference=lambda arm: "plain",
                                                       group=lambda row: row.category or "none").items():
        table[name] = {"prompts": prompts, "tokens_per_s": speed,
                       "x_plain": {a: speed[a] / speed["plain"] for a in arms}, "differ": differ}
    others = [a for a in arms if a != "plain"]
    lines = [*title, "", "| category | prompts | plain tokens/s | " + " | ".join(f"{a}, x plain" for a in others)
             + f" | differ ({', '.join(others)}) |", "|---|---|---|" + "---|" * (len(others) + 1)]
    for category, r in table.items():
        x, d = r["x_plain"], r["differ"]
        lines.append(f"| {category} | {r['prompts']} | {r['tokens_per_s']['plain']:.1f} | "
                     + " | ".join(f"{x[a]:.3f}" for a in others) + f" | {', '.join(str(d[a]) for a in others)} |")
    print("\n".join(lines))
    if out:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n\n```json\n" + json.dumps(table, indent=1) + "\n```\n")
    return table


def builds_ab(tok, rows, models: dict, max_new_tokens: int) -> tuple[dict, dict]:
    """Two or more builds of the model (name -> MedusaModel), each one's `generate` and heads as arms, on `rows`,
    greedy: alternate() with each build's own `generate` as the reference of its arms, after one warm-up call each.
    Returns (tokens/s, outputs differing) by (build, "generate" | "heads")."""
    arms = {}
    for build, model in models.items():
        arms[(build, "generate")] = lambda ids, m=model: m.base_model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
        arms[(build, "heads")] = lambda ids, m=model: m.generate(ids, max_new_tokens=max_new_tokens)
    print(f"{len(rows)} prompts x {len(arms)} arms, {max_new_tokens} tokens each: about "
          f"{len(rows) * len(arms) * 4 // 60 + 1} minutes")
    for model in models.values():
        model.generate(prompt_ids(tok, "Hello"), max_new_tokens=8)
    with torch.no_grad():
        return alternate(tok, rows, arms, reference=lambda arm: (arm[0], "generate"))


def settings_ab(model, tok, rows, names: list[str], switch: Callable[[str], None], warm: str,
                max_new_tokens: int) -> dict[str, list[tuple[float, object]]]:
    """One model under two or more settings: switch(name) applies one (off the clock), then the heads' generate
    (return_dict_in_generate) on the first turn of each (prompt file, row) of `rows`, the settings alternating per
    prompt, after one warm-up call under `warm`. Returns {name: [(seconds, generate's output)]} in prompt order."""
    def generate(ids: torch.Tensor):
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                              return_dict_in_generate=True)

    switch(warm)
    generate(prompt_ids(tok, rows[0][1].turns[0]))
    runs = {name: [] for name in names}
    prompts = (prompt_ids(tok, row.turns[0]) for _, row in rows)
    for _, results in timing.alternate(dict.fromkeys(names, generate), prompts, before=switch):
        for name, (res, seconds) in results.items():
            runs[name].append((seconds, res))
    return runs
