"""Round 26's first probe of an n-gram store of the target's own answers, before the library had one (commit
84e20ec): builds the store in Python dicts from 90% of the distilled answers, fits rates per depth and confidence
bin on the other 10%, then runs the shipped heads with and without the store merged as a third source on the new
and fresh prompts (tau only). Output: exp1.log in the round's README.
    python results/round26/probe.py data/bench_prompts_new.jsonl data/bench_prompts_fresh.jsonl"""
import gzip, json, hashlib, sys, time, os
from collections import Counter, defaultdict
import torch
from transformers import AutoTokenizer
from medusa_heads.default_model import default_model_path
tok = AutoTokenizer.from_pretrained(default_model_path())
eos = tok.convert_tokens_to_ids("<|im_end|>")
files = ["data/distilled.jsonl.gz", "data/distilled_t07.jsonl.gz", "data/distilled_fu.jsonl.gz", "data/distilled_self.jsonl.gz"]
cache = "runs/probe_tokens.json"  # the tokenized answers, kept between runs (runs/ is ignored)
if os.path.exists(cache):
    train, held = json.load(open(cache))
else:
    train, held = [], []
    for f in files:
        for line in gzip.open(f, "rt"):
            r = json.loads(line)
            h = int(hashlib.sha1(r["messages"][0]["content"].encode()).hexdigest(), 16) % 10
            for m in r["messages"]:
                if m["role"] == "assistant":
                    (held if h == 0 else train).append(tok.encode(m["content"], add_special_tokens=False) + [eos])
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    json.dump([train, held], open(cache, "w"))
N, NMIN, CMIN, L, BINS = 4, int(os.environ.get("NMIN", 2)), 2, 8, 10

def build(seqs):
    stores = [defaultdict(Counter) for _ in range(N + 1)]
    for ids in seqs:
        for i in range(1, len(ids)):
            for n in range(1, min(N, i) + 1):
                stores[n][tuple(ids[i - n:i])][ids[i]] += 1
    table = {}
    for n in range(NMIN, N + 1):
        for k, c in stores[n].items():
            tot = sum(c.values())
            if tot >= CMIN:
                t, m = c.most_common(1)[0]
                table[k] = (t, m / tot)
    return table

def chain(table, ctx, depth=L):
    ctx = list(ctx[-N:]); out, confs = [], []
    for d in range(depth):
        got = None
        for n in range(min(N, len(ctx)), NMIN - 1, -1):
            got = table.get(tuple(ctx[-n:]))
            if got: break
        if not got: break
        out.append(got[0]); confs.append(got[1]); ctx = ctx[1:] + [got[0]] if len(ctx) >= N else ctx + [got[0]]
    return out, confs

t0 = time.time()
tab90 = build(train)
counts = [[[0, 0] for _ in range(BINS)] for _ in range(L)]
for ids in held:
    for t in range(0, len(ids) - 1):
        out, confs = chain(tab90, ids[:t + 1][-N:])
        for d, (p, c) in enumerate(zip(out, confs)):
            if t + 1 + d >= len(ids): break
            b = min(int(c * BINS), BINS - 1)
            ok = p == ids[t + 1 + d]
            counts[d][b][0] += 1; counts[d][b][1] += ok
            if not ok: break
rates = [[(h + 1) / (n + 2) for n, h in row] for row in counts]
for d, row in enumerate(rates): print(d + 1, " ".join(f"{r:.2f}" for r in row), flush=True)
del tab90
table = build(train + held)
print("table", len(table), time.time() - t0, flush=True)

from medusa_heads import MedusaModel, prompt_ids
from medusa_heads.inference.adaptive import AdaptiveDrafter, Correction
from medusa_heads.loading import load_base
import medusa_heads.model as mm

class DSDrafter(AdaptiveDrafter):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.correction = Correction(self.depth + 3)
        self.ds_slot = self.depth + 2
    def _merge_lookup(self, sequence, tok, par, val, slot, paths):
        super()._merge_lookup(sequence, tok, par, val, slot, paths)
        out, confs = chain(table, sequence[-N:].tolist())
        if not out: return
        children = {}
        for i in range(1, len(tok)):
            children.setdefault(par[i], {})[tok[i]] = i
        r = [rates[d][min(int(c * BINS), BINS - 1)] for d, c in enumerate(confs)]
        self._merge_chain(out, r, tok, par, val, slot, paths, children, source=self.ds_slot)

torch.set_num_threads(2)
model = MedusaModel.from_pretrained(load_base("smollm2-135m-instruct"))
orig = mm.MedusaModel._adaptive_drafter
def ds_drafter(self, lookup, ngram):
    d = orig(self, lookup, ngram)
    n = DSDrafter.__new__(DSDrafter); n.__dict__.update(d.__dict__)
    n.correction = Correction(n.depth + 3); n.ds_slot = n.depth + 2
    return n
files = sys.argv[1:]
res = defaultdict(lambda: [0, 0])
same = 0; total = 0
for f in files:
    for line in open(f):
        r = json.loads(line)
        ids = prompt_ids(tok, r.get("prompt") or r["turns"][0])
        outs = {}
        for name in ("base", "ds"):
            mm.MedusaModel._adaptive_drafter = orig if name == "base" else ds_drafter
            o = model.generate(ids, max_new_tokens=128, do_sample=False, return_dict_in_generate=True)
            res[name][0] += o.stats.new_tokens; res[name][1] += o.stats.steps
            res[(name, r.get("category"))][0] += o.stats.new_tokens; res[(name, r.get("category"))][1] += o.stats.steps
            outs[name] = o.sequences
        same += torch.equal(outs["base"], outs["ds"]); total += 1
        print(r["id"], {k: round(v[0] / v[1], 2) for k, v in res.items() if k in ("base", "ds")}, flush=True)
print("same", same, total)
for k, v in sorted(res.items(), key=str): print(k, v, round(v[0] / v[1], 3))
