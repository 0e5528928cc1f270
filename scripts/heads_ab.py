#!/usr/bin/env python
"""Two or more sets of heads on one target in one process: each against transformers' generate, all alternating
per prompt (the order rotates), greedy (or sampled: --sample), with the configured tree of each (the per-step tree for calibrated heads).

    python -m scripts.heads_ab --heads medusa_heads/default_heads runs/smollm2-135m-heads-more \
        --prompts data/bench_prompts.jsonl data/bench_prompts_new.jsonl --out results/heads/ab.md

With --batch-hints (one per heads directory) each set of heads runs on its own copy of the target, prepacked for
that many rows, against generate on that same copy; "B / A" then compares the two kernels' tokens/s too:

    python -m scripts.heads_ab --heads medusa_heads/default_heads runs/heads-h16 --batch-hints 8 16 \
        --prompts data/bench_prompts.jsonl --out results/kernels/ab.md

Prints, per category, per prompt file ("<file>: all") and overall, tokens/s of each as a ratio to generate and to the first heads (A), tau, and how
many outputs equal generate's; writes the same table as Markdown to --out."""
from __future__ import annotations

import json
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from medusa_heads import MedusaModel, prompt_ids
from medusa_heads.calibration.timing import run_round
from medusa_heads.cli.commands import DTYPES
from medusa_heads.kernels.prepack import prepack_linears
from medusa_heads.loading import load_base, load_tokenizer
from medusa_heads.corpus import read_prompts
from scripts.common import REQUIRED, Option, emit, parser


def main() -> None:
    p = parser(__doc__, "model", "max_new_tokens", "threads", prompts=REQUIRED,
               out=Option(None, "Markdown file for the table"))
    p.add_argument("--heads", nargs="+", required=True, help="two or more heads directories (the first is A)")
    p.add_argument("--sample", action="store_true",
                   help="sample at T 0.7, top-p 0.9 (each contender seeded alike per prompt) instead of greedy")
    p.add_argument("--no-prepack", action="store_true",
                   help="the stock kernels (a model the user loaded): the heads draft with their stock cost model")
    p.add_argument("--dtype", choices=(*DTYPES, "int8"), default="fp32",
                   help="the target's dtype (bf16: greedy outputs may leave generate's at near-ties, as any bf16 verify "
                        "with SDPA; int8: loaded as from_pretrained(..., quantize='int8') does, exact)")
    p.add_argument("--batch-hints", nargs="+", type=int, default=None,
                   help="one per heads directory: each runs on a copy of the target prepacked for that many rows, "
                        "against generate on that copy (the heads' cost model should be measured there)")
    p.add_argument("--json", default=None, help="JSON file for the overall row: each heads' speed-up, tau, identical")
    args = p.parse_args()
    if len(args.heads) < 2 or len(set(args.heads)) < len(args.heads):
        p.error(f"--heads takes two or more different directories, got {args.heads}")
    if args.batch_hints and (args.no_prepack or len(args.batch_hints) != len(args.heads)):
        p.error("--batch-hints takes one hint per heads directory, and prepacked kernels")
    torch.set_num_threads(args.threads)

    tok = load_tokenizer(args.model)
    hints = args.batch_hints or [None] * len(args.heads)
    bases = {}  # hint -> the target prepacked for it (None: one target, as load_base packs it), shared by its heads
    if args.dtype == "int8":  # one int8 target (bf16 with the row-exact attention around its int8 linears), shared
        if args.batch_hints or args.no_prepack:
            p.error("--dtype int8 takes neither --batch-hints nor --no-prepack")
        first = MedusaModel.from_pretrained(args.model, heads=args.heads[0], quantize="int8")
        bases[None] = first.base_model
        models = {args.heads[0]: first, **{name: MedusaModel.from_pretrained(first.base_model, heads=name, quantize="int8")
                                           for name in args.heads[1:]}}
    else:
        for hint in dict.fromkeys(hints):
            bases[hint] = load_base(args.model, dtype=getattr(torch, DTYPES[args.dtype]), prepack=not args.no_prepack and hint is None)
            if hint is not None:
                prepack_linears(bases[hint], batch_hint=hint)
        models = {name: MedusaModel.from_pretrained(bases[hint], heads=name) for name, hint in zip(args.heads, hints)}
    generates = {hint: f"generate ({hint}-row packing)" if hint else "generate" for hint in bases}  # hint -> label
    targets = {generates[hint]: base for hint, base in bases.items()}  # label -> the target it generates on
    rows = [(Path(f).stem, r) for f in args.prompts for r in read_prompts(f)]

    gen = dict(do_sample=True, temperature=0.7, top_p=0.9) if args.sample else dict(do_sample=False)

    def run(who: str, ids: torch.Tensor, seed: int = 0):
        torch.manual_seed(seed)
        if who in targets:
            return targets[who].generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, **gen), None
        out = models[who].generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                   return_dict_in_generate=True, **gen)
        return out.sequences, out.stats.mean_accepted

    baseline = dict(zip(args.heads, (generates[h] for h in hints)))  # each heads' own generate
    contenders = [*generates.values(), *args.heads]
    warm = prompt_ids(tok, "Hello")
    for who in contenders:
        run(who, warm)
    acc = defaultdict(lambda: {"seconds": 0.0, "tokens": 0, "taus": [], "same": 0, "prompts": 0})
    for i, (stem, row) in enumerate(tqdm(rows, desc="heads A/B", unit="prompt")):
        ids = prompt_ids(tok, row.turns[0])
        keys = ("overall", f"{stem}: all", f"{stem}: {row.category or 'uncategorised'}")
        results = run_round({who: partial(run, who, seed=i) for who in contenders}, ids, i, rotate=True)  # each first in turn
        for who, ((seq, tau), dt) in results.items():
            for key in keys:
                a = acc[(key, who)]
                a["seconds"] += dt
                a["tokens"] += seq.shape[1] - ids.shape[1]
                if tau is not None:
                    a["taus"].append(tau)
        for who in args.heads:
            for key in keys:
                acc[(key, who)]["same"] += int(torch.equal(results[who].output[0], results[baseline[who]].output[0]))
                acc[(key, who)]["prompts"] += 1

    names = [chr(ord("A") + i) for i in range(len(args.heads))]
    lines = [f"Heads {'; '.join(f'{n} = `{h}`' for n, h in zip(names, args.heads))}; {len(rows)} prompts "
             f"({', '.join(args.prompts)}), {'sampled at T 0.7, top-p 0.9' if args.sample else 'greedy'}, {args.max_new_tokens} new tokens, {'stock' if args.no_prepack else 'prepacked'} {args.dtype} kernels, {args.threads} threads, one process, "
             f"{' / '.join(generates.values())} / {' / '.join(names)} alternating per prompt"
             + (f"; {', '.join(f'{n} on the {h}-row packing' for n, h in zip(names, hints))}, each against its own generate." if args.batch_hints else "."), ""]
    head = ["prompts"] + [f"{n} {c}" for n in names for c in ("speed-up", "tau")]
    head += [f"{n} / A" for n in names[1:]] + ([] if args.sample else ["identical " + ", ".join(names)])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keys = sorted({k for k, _ in acc if k != "overall"}) + ["overall"]
    for key in keys:
        tps = {who: acc[(key, who)]["tokens"] / acc[(key, who)]["seconds"] for who in contenders}
        tau = {who: sum(acc[(key, who)]["taus"]) / len(acc[(key, who)]["taus"]) for who in args.heads}
        cells = [key] + [x for w in args.heads for x in (f"{tps[w] / tps[baseline[w]]:.2f}x", f"{tau[w]:.2f}")]
        cells += [f"{tps[w] / tps[args.heads[0]]:.3f}" for w in args.heads[1:]]
        if not args.sample:  # sampled outputs differ from generate's draws (same distribution, other random numbers)
            cells.append(", ".join(f"{acc[(key, w)]['same']}/{acc[(key, w)]['prompts']}" for w in args.heads))
        lines.append("| " + " | ".join(cells) + " |")
    emit(lines, args.out)
    if args.json:  # the overall row of the table (the loop's last key)
        Path(args.json).write_text(json.dumps({"prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "heads": {
            w: {"speedup": tps[w] / tps[baseline[w]], "tau": tau[w], "identical": acc[("overall", w)]["same"],
                "prompts": acc[("overall", w)]["prompts"]} for w in args.heads}}, indent=1) + "\n")


if __name__ == "__main__":
    main()
