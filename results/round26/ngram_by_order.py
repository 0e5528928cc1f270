#!/usr/bin/env python
"""Would the phrasebook's rates gain from the matched n-gram's length as a second input? Fits isotonic rates over the
confidence bins per depth (as shipped), and per depth and matched length, on one half of the heads' held-out
prompts; compares log loss on the other half. Run from the repo root (~2 minutes):
    python results/round26/ngram_by_order.py"""
from __future__ import annotations

import math

import torch

from medusa_heads.calibration import held_out_conversations
from medusa_heads.calibration.measure import ACCEPT_EDGES, fit_isotonic, second_half, tokenized_answers
from medusa_heads.checkpoint import load_ngrams
from medusa_heads.loading import load_tokenizer
from medusa_heads.training.data import read_conversations

HEADS = "medusa_heads/default_heads"
FILES = ["data/distilled.jsonl.gz", "data/distilled_t07.jsonl.gz", "data/distilled_fu.jsonl.gz", "data/distilled_self.jsonl.gz"]
DEPTH = 8


def trials(store, answers):
    """(depth, matched n, confidence, accepted) of every chain token tried, as ngram_trials walks them."""
    out = []
    for ids, spans in answers:
        seq = ids.tolist()
        for start, end in spans:
            for p in range(start, end - 1):
                ctx = seq[max(p + 1 - store.max_n, 0): p + 1]
                for j in range(DEPTH):
                    row, n = -1, 0
                    for n in range(min(store.max_n, len(ctx)), store.min_n - 1, -1):
                        if (row := store.find(ctx[-n:])) >= 0:
                            break
                    if row < 0 or p + 1 + j >= end:
                        break
                    token, conf = int(store.tokens[row]), float(store.confidence[row])
                    ok = token == seq[p + 1 + j]
                    out.append((j, n, conf, ok))
                    if not ok:
                        break
                    ctx = (ctx + [token])[-store.max_n:]
    return out


def rate_of(rates, conf):
    b = max(min(sum(conf >= e for e in ACCEPT_EDGES[1:-1]), len(ACCEPT_EDGES) - 2), 0)
    return rates[b]


def main() -> None:
    tok = load_tokenizer("smollm2-135m-instruct")
    store = load_ngrams(HEADS)
    held = held_out_conversations([c for f in FILES for c in read_conversations(f)], HEADS)
    fit = trials(store, tokenized_answers(tok, [c for c in held if not second_half(c["id"])]))
    test = trials(store, tokenized_answers(tok, [c for c in held if second_half(c["id"])]))
    models = {}
    for key in ("depth", "depth x n"):
        groups = {}
        for j, n, c, ok in fit:
            groups.setdefault((j,) if key == "depth" else (j, n), []).append((c, ok))
        models[key] = {g: fit_isotonic(torch.tensor([c for c, _ in v]), torch.tensor([ok for _, ok in v]))
                       for g, v in groups.items()}
    print(f"{len(fit)} fit and {len(test)} test trials")
    for key, table in models.items():
        loss = 0.0
        for j, n, c, ok in test:
            r = table.get((j,) if key == "depth" else (j, n)) or models["depth"][(j,)]
            p = min(max(rate_of(r, c), 1e-4), 1 - 1e-4)
            loss -= math.log(p if ok else 1 - p)
        print(f"{key:>10}: test log loss {loss / len(test):.4f}")
    for n in range(store.min_n, store.max_n + 1):
        sel = [ok for j, m, c, ok in test if j == 0 and m == n]
        print(f"depth 1, matched n {n}: {len(sel)} trials, accepted {sum(sel) / max(len(sel), 1):.3f}")


if __name__ == "__main__":
    main()
