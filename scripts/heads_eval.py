#!/usr/bin/env python
"""Held-out accuracy of several heads on one and the same split: top-1 / top-5 / CE per head (heads 2-4 given the
right path above them), each answer set apart (the greedy answers, the sampled variants) and together.

    python -m scripts.heads_eval --heads runs/smollm2-135m-heads runs/smollm2-135m-heads-more \
        --data data/distilled_head.jsonl data/distilled_t07.jsonl --features data/features

The split is the heads' recipe's (a hash of the prompt id, eval_fraction of them); answers without features are
counted and left out."""
from __future__ import annotations

import json

import torch

from medusa_heads.checkpoint import load_config, load_heads
from medusa_heads.loading import load_base
from medusa_heads.corpus import is_eval, read_conversations
from medusa_heads.shards import load_segments
from medusa_heads.training.loop import build_split, draft_index, evaluate
from scripts.common import Option, parser


def main() -> None:
    p = parser(__doc__, "model", out=Option(None, "JSON file for the figures"))
    p.add_argument("--heads", nargs="+", required=True)
    p.add_argument("--data", nargs="+", required=True, help="distilled conversation files, each reported apart")
    p.add_argument("--features", default="data/features")
    p.add_argument("--by-turn", action="store_true",
                   help="also report each file's answers by turn (multi-turn conversations: turn 1, turn 2, ...)")
    args = p.parse_args()
    torch.set_num_threads(2)
    base = load_base(args.model, prepack=False)
    configs = [load_config(h) for h in args.heads]
    fraction = configs[0].extra.get("recipe", {}).get("eval_fraction", 0.05)
    if any(c.draft_vocab != configs[0].draft_vocab or c.context_size != configs[0].context_size for c in configs):
        raise SystemExit("the heads compared must share a draft vocabulary and conditioning (one split serves all)")
    held = {path: {c["id"] for c in read_conversations(path) if is_eval(c["id"], fraction)} for path in args.data}
    segments = load_segments(args.features, keep_ids=set().union(*held.values()))  # the shards are read once
    sets = {}
    for path, ids in held.items():
        sets[path] = [s for s in segments if s.conv_id in ids]
        print(f"{path}: {len({s.conv_id for s in sets[path]})} of {len(ids)} held-out conversations have features")
    sets["all"] = [s for path in args.data for s in sets[path]]
    if args.by_turn:
        for path in args.data:
            for s in sets[path]:
                sets.setdefault(f"{path} turn {int(s.id.rsplit('#', 1)[1]) + 1}", []).append(s)
    heads = {h: load_heads(h, base.get_output_embeddings().weight.detach(), c, base.get_input_embeddings().weight.detach())
             for h, c in zip(args.heads, configs)}
    index = draft_index(configs[0].draft_vocab, configs[0].vocab_size)
    k = configs[0].num_heads
    out = {}
    for name, segs in sets.items():
        split = build_split(segs, k, index, configs[0].context_size)
        for heads_dir, model in heads.items():
            with torch.no_grad():
                m = evaluate(model, split, decay=0.8)
            out.setdefault(name, {"tokens": int(split.hidden.shape[0])})[heads_dir] = m
            print(f"{name} ({split.hidden.shape[0]:,} tokens) {heads_dir}: top-1 "
                  + " / ".join(f"{m[f'top1_{i + 1}']:.3f}" for i in range(k)) + ", top-5 "
                  + " / ".join(f"{m[f'top5_{i + 1}']:.3f}" for i in range(k)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
