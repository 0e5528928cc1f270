#!/usr/bin/env python
# Usage: python -m experiments.gqa_ab PROMPTS.jsonl [...]   (results/ab/gqa_ab.txt)
"""A/B in one process: transformers' SDPA with and without enable_gqa under a mask (TRANSFORMERS_SDPA_FORCE_GQA),
for plain generate and for medusa; contenders alternate per prompt."""

import json
import os
import torch
from transformers import AutoTokenizer
from medusa_heads import MedusaModel, default_model_path, prompt_ids
from medusa_heads.calibration.timing import run_round
from scripts.common import parser

p = parser(__doc__)
p.add_argument("files", nargs="*", metavar="PROMPTS.jsonl", help="JSONL prompt files")
files = p.parse_args().files
torch.set_num_threads(2)
path = default_model_path()
tok = AutoTokenizer.from_pretrained(path)
model = MedusaModel.from_pretrained(path)
base = model.base_model
rows = []
for f in files:
    rows += [json.loads(line) for line in open(f)]
N = 96


def run(kind, ids):
    if kind == "hf":
        return base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, do_sample=False), None
    r = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, return_dict_in_generate=True)
    return r.sequences, r.stats


ids = prompt_ids(tok, "Hi")
run("hf", ids)
run("medusa", ids)
tot = {}
same = 0
arms = {(k, g): (lambda ids, k=k: run(k, ids)[0]) for g in ("0", "1") for k in ("hf", "medusa")}


def force_gqa(arm):
    os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = arm[1]


for i, r in enumerate(rows):
    ids = prompt_ids(tok, r["prompt"])
    cat = r.get("category", "?")
    results = run_round(arms, ids, i, before=force_gqa, rotate=True)  # each combination first in turn
    for (k, g), (seq, dt) in results.items():
        n = seq.shape[1] - ids.shape[1]
        for key in ((k, g, "all"), (k, g, "long" if cat.startswith("long") else "short")):
            a = tot.setdefault(key, [0, 0.0])
            a[0] += n
            a[1] += dt
    same += all(torch.equal(results[("hf", "0")].output, v.output) for v in results.values())
    print(i, cat, ids.shape[1], {f"{k}{g}": round(tot[(k, g, "all")][1], 1) for k, g in results}, flush=True)
print(f"identical outputs across all four: {same}/{len(rows)}")
for part in ("short", "long", "all"):
    if ("hf", "0", part) not in tot:
        continue
    tps = {f"{k} gqa={g}": tot[(k, g, part)][0] / tot[(k, g, part)][1] for k in ("hf", "medusa") for g in ("0", "1")}
    print(
        part,
        {k: round(v, 1) for k, v in tps.items()},
        f"medusa/hf gqa0 {tps['medusa gqa=0'] / tps['hf gqa=0']:.2f}, gqa1 {tps['medusa gqa=1'] / tps['hf gqa=1']:.2f}, "
        f"medusa gqa1/gqa0 {tps['medusa gqa=1'] / tps['medusa gqa=0']:.2f}, hf gqa1/gqa0 {tps['hf gqa=1'] / tps['hf gqa=0']:.2f}",
    )
