import sys, time, torch
from medusa_heads import MedusaModel
from medusa_heads.loading import load_tokenizer
from medusa_heads.training.data import read_prompts
from medusa_heads.prompting import prompt_text
from medusa_heads.inference import adaptive
torch.set_num_threads(2)
m = MedusaModel.from_pretrained("smollm2-135m-instruct")
tok = load_tokenizer("smollm2-135m-instruct"); tok.padding_side = "left"
B = int(sys.argv[1])
rows = read_prompts("data/bench_prompts.jsonl")[:16]
encs = [tok([prompt_text(tok, [{"role": "user", "content": r.turns[0]}]) for r in rows[i:i+B]], return_tensors="pt", padding=True, add_special_tokens=False) for i in range(0, 16, B)]
m.generate(**encs[0], max_new_tokens=8, do_sample=False)
orig = adaptive.AdaptiveDrafter._draft_batch
def plain(self, hidden, sequences):
    from medusa_heads.inference.propose import Draft
    from medusa_heads.tree.buffers import from_parents
    self._drafted = [([-1], [1.0], [0]) for _ in sequences]
    self._chosen = None
    return [Draft(torch.zeros(0, dtype=torch.long), from_parents((-1,))) for _ in sequences]
T = {"hf": 0, "medusa": 0, "plain": 0}; S = {}
for rep in range(1):
    for enc in encs:
        order = ["hf", "medusa", "plain"] if rep % 2 == 0 else ["plain", "medusa", "hf"]
        for k in order:
            adaptive.AdaptiveDrafter._draft_batch = plain if k == "plain" else orig
            t = time.perf_counter()
            if k == "hf":
                out = m.base_model.generate(**enc, max_new_tokens=128, do_sample=False)
            else:
                res = m.generate(**enc, max_new_tokens=128, do_sample=False, return_dict_in_generate=True)
                out = res.sequences
                for kk, v in res.stats.seconds.items(): S[(k, kk)] = S.get((k, kk), 0) + v
                S[(k, 'steps')] = S.get((k, 'steps'), 0) + res.stats.steps; S[(k,'tokens')] = S.get((k,'tokens'),0) + res.stats.new_tokens
            T[k] += time.perf_counter() - t
print(B, {k: round(T["hf"] / v, 3) for k, v in T.items()})
print({k: round(v, 2) for k, v in S.items()})
