"""Round 26: the phrasebook's merge variants by tau alone (greedy, 128 new tokens; the tree never depends on timings,
so no generate runs beside them). Ran on commit 386035c: "ship" is that commit's merge (noisy OR, raised children
in the lookup's slot), "own" gives them a slot of their own (shipped in 92f1f98), "max" takes the larger rate
instead of the noisy OR. Output: variants.txt.
    python results/round26/variants.py plain,ship,own,max data/bench_prompts.jsonl data/bench_prompts_new.jsonl \
        data/bench_prompts_fresh.jsonl"""
import json, sys, copy
from collections import defaultdict
import torch
from medusa_heads import MedusaModel, prompt_ids
from medusa_heads.loading import load_base, load_tokenizer
from medusa_heads.training.data import read_prompts
import medusa_heads.inference.adaptive as ad

MODE = {"v": "ship"}
orig_merge = ad.AdaptiveDrafter._merge_chain
orig_init = ad.AdaptiveDrafter.__init__

def init(self, *a, **k):
    orig_init(self, *a, **k)
    self.correction = ad.Correction(self.depth + 4)
    self.store_repeat = self.depth + 3

def merge(self, found, rates, tok, par, val, slot, paths, children, source=0):
    if source == 0 or MODE["v"] == "ship":
        return orig_merge(self, found, rates, tok, par, val, slot, paths, children, source)
    node = 0
    for token, rate in zip(found, rates):
        rate = self.correction(source, rate)
        siblings, base = children.get(node, {}), val[node]
        room = 1.0
        if siblings and base > 0.0:
            room = max(1.0 - sum(val[c] for t, c in siblings.items() if t != token) / base, 0.0)
        rate = min(rate, room)
        child = siblings.get(token)
        if child is None:
            child = len(tok)
            tok.append(token), par.append(node), val.append(base * rate), slot.append(source)
            paths.append(paths[node] + [token])
            children.setdefault(node, {})[token] = child
        elif base > 0.0:
            heads = val[child] / base
            if MODE["v"] == "own":
                both = self.correction(self.store_repeat, 1.0 - (1.0 - heads) * (1.0 - rate))
            else:  # max
                both = self.correction(self.store_repeat, max(heads, rate)) if rate > heads else heads
            both = max(min(both, room), heads)
            if both > heads:
                val[child], slot[child] = base * both, self.store_repeat
                ad._rescale(child, both / heads if heads > 0.0 else 0.0, val, children)
        node = child

ad.AdaptiveDrafter._merge_chain = merge
ad.AdaptiveDrafter.__init__ = init
torch.set_num_threads(2)
tok = load_tokenizer("smollm2-135m-instruct")
model = MedusaModel.from_pretrained("smollm2-135m-instruct")
stored = copy.deepcopy(model.config.adaptive)
plain = {k: v for k, v in stored.items() if k != "ngrams"}
variants = sys.argv[1].split(",")
res = defaultdict(lambda: [0, 0])
for f in sys.argv[2:]:
    for row in read_prompts(f):
        ids = prompt_ids(tok, row.turns[0])
        outs = []
        for v in variants:
            MODE["v"] = v
            model.config.adaptive = plain if v == "plain" else stored
            o = model.generate(ids, max_new_tokens=128, do_sample=False, return_dict_in_generate=True)
            outs.append(o.sequences)
            for key in (v, (v, f)):
                res[key][0] += o.stats.new_tokens; res[key][1] += o.stats.steps
        assert all(torch.equal(outs[0], x) for x in outs)
    print(f, {v: round(res[(v, f)][0] / res[(v, f)][1], 3) for v in variants}, flush=True)
print("overall", {v: round(res[v][0] / res[v][1], 3) for v in variants})
