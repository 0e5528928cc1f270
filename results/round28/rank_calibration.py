"""Per (slot, rank among its siblings): the drafter's predicted rate of each child of an accepted node (its online
correction included) against how often it was the next token. python results/round28/rank_calibration.py sample|greedy FILES"""
import sys, torch, collections
from medusa_heads import MedusaModel
from medusa_heads.loading import load_tokenizer
from medusa_heads.training.data import read_prompts
from medusa_heads.prompting import prompt_text
from medusa_heads.inference import adaptive as A
torch.set_num_threads(2)
sample = sys.argv[1] == "sample"
files = sys.argv[2].split(",")
m = MedusaModel.from_pretrained("smollm2-135m-instruct")
tok = load_tokenizer("smollm2-135m-instruct")
stats = collections.defaultdict(lambda: [0, 0.0, 0.0])  # (slot, rank) -> n, sum pred, hits
orig = A.AdaptiveDrafter.update
def update(self, accepted):
    for (parents, worth, slot), nodes in zip(self._drafted, accepted):
        nodes = nodes.tolist()
        for depth, node in enumerate(nodes):
            nxt = nodes[depth + 1] if depth + 1 < len(nodes) else -1
            kids = [c for c in range(1, len(parents)) if parents[c] == node]
            bys = collections.defaultdict(list)
            for c in kids: bys[slot[c]].append(c)
            for s, cs in bys.items():
                cs.sort(key=lambda c: -worth[c])
                for r, c in enumerate(cs):
                    rate = worth[c] / max(worth[node], 1e-12)
                    st = stats[(s, min(r, 2))]; st[0] += 1; st[1] += rate; st[2] += float(c == nxt)
    return orig(self, accepted)
A.AdaptiveDrafter.update = update
rows = [r for f in files for r in read_prompts(f)]
g = torch.Generator().manual_seed(0)
for r in rows:
    ids = tok(prompt_text(tok, [{"role": "user", "content": r.turns[0]}]), return_tensors="pt", add_special_tokens=False).input_ids
    m.generate(ids, max_new_tokens=128, **(dict(do_sample=True, temperature=0.7, top_p=0.9, generator=g) if sample else {}))
for k in sorted(stats):
    n, p, h = stats[k]
    print(k, n, "pred %.3f obs %.3f" % (p / n, h / n))
