import sys, copy, math
from collections import defaultdict
import torch
sys.path.insert(0, "results/round26")
from ngram_by_order import trials, FILES, HEADS
from medusa_heads import MedusaModel, prompt_ids
from medusa_heads.calibration import held_out_conversations
from medusa_heads.calibration.measure import ACCEPT_EDGES, fit_isotonic, second_half, tokenized_answers
from medusa_heads.loading import load_tokenizer
from medusa_heads.training.data import read_conversations, read_prompts
from medusa_heads.tree.adaptive import Acceptance
import medusa_heads.inference.adaptive as ad

torch.set_num_threads(2)
tok = load_tokenizer("smollm2-135m-instruct")
model = MedusaModel.from_pretrained("smollm2-135m-instruct")
store = model.phrases
held = held_out_conversations([c for f in FILES for c in read_conversations(f)], HEADS)
fit = trials(store, tokenized_answers(tok, [c for c in held if not second_half(c["id"])]))
groups = defaultdict(list)
for j, n, c, ok in fit:
    groups[n, j].append((c, ok))
tables = {}
for n in range(store.min_n, store.max_n + 1):
    rows = []
    for j in range(8):
        v = groups.get((n, j))
        rows.append(tuple(fit_isotonic(torch.tensor([c for c, _ in v]), torch.tensor([o for _, o in v]))) if v and len(v) > 50 else rows[-1])
    tables[n] = Acceptance(ACCEPT_EDGES, tuple(rows))
print("fitted", flush=True)

def chain_n(ctx, length):
    ctx = list(ctx[-store.max_n:]); out, conf, ns = [], [], []
    for _ in range(length):
        row = -1
        for n in range(min(store.max_n, len(ctx)), store.min_n - 1, -1):
            if (row := store.find(ctx[-n:])) >= 0:
                break
        if row < 0: break
        out.append(int(store.tokens[row])); conf.append(float(store.confidence[row])); ns.append(n)
        ctx = (ctx + out[-1:])[-store.max_n:]
    return out, conf, ns

MODE = {"v": "own"}
orig = ad.AdaptiveDrafter._continuations
def cont(self, sequence):
    if MODE["v"] == "own" or self.phrases is None:
        return orig(self, sequence)
    out = [c for c in orig(self, sequence) if c[2] == 0]
    found, conf, ns = chain_n(sequence[-store.max_n:].tolist(), 8)
    if found:
        out.append((found, [tables[n].rate(j, c) for j, (c, n) in enumerate(zip(conf, ns), 1)], self.phrase_slot))
    return out
ad.AdaptiveDrafter._continuations = cont
variants = ["own", "byorder"]
res = defaultdict(lambda: [0, 0])
for f in sys.argv[1:]:
    for row in read_prompts(f):
        ids = prompt_ids(tok, row.turns[0])
        outs = []
        for v in variants:
            MODE["v"] = v
            o = model.generate(ids, max_new_tokens=128, do_sample=False, return_dict_in_generate=True)
            outs.append(o.sequences)
            for key in (v, (v, f)):
                res[key][0] += o.stats.new_tokens; res[key][1] += o.stats.steps
        assert all(torch.equal(outs[0], x) for x in outs)
    print(f, {v: round(res[(v, f)][0] / res[(v, f)][1], 3) for v in variants}, flush=True)
print("overall", {v: round(res[v][0] / res[v][1], 3) for v in variants})
