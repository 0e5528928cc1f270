import sys, time, torch, collections
from medusa_heads import MedusaModel
from medusa_heads.loading import load_tokenizer
from medusa_heads.training.data import read_prompts
from medusa_heads.prompting import prompt_ids
from medusa_heads.inference.prepack import stock_kernels
torch.set_num_threads(2)
m = MedusaModel.from_pretrained("smollm2-135m-instruct")
tok = load_tokenizer("smollm2-135m-instruct")
rows = read_prompts("data/bench_prompts.jsonl")[: int(sys.argv[2])]
ids = [prompt_ids(tok, r.turns[0]) for r in rows]
rec = []
orig = m.target.verify
def timed(tokens, past, cache, buffers):
    t = time.perf_counter(); out = orig(tokens, past, cache, buffers); rec.append((tokens.shape[0], past, (time.perf_counter() - t) * 1e3)); return out
m.target.verify = timed
ctx = stock_kernels(m.base_model) if sys.argv[1] == "stock" else None
if ctx: ctx.__enter__()
cost = m.cost_model()
m.generate(ids[0], max_new_tokens=16, do_sample=False); rec.clear()
for x in ids:
    m.generate(x, max_new_tokens=128, do_sample=False)
by = collections.defaultdict(list)
for n, past, ms in rec:
    by[n].append((ms, float(cost.verify_ms(past)[n - 1])))
print(sys.argv[1], "steps", len(rec), "mean past", sum(p for _, p, _ in rec) / len(rec))
tot_a = tot_p = 0
for n in sorted(by):
    a = sum(x for x, _ in by[n]) / len(by[n]); p = sum(y for _, y in by[n]) / len(by[n])
    tot_a += sum(x for x, _ in by[n]); tot_p += sum(y for _, y in by[n])
    print(f"size {n:2d} steps {len(by[n]):4d} actual {a:6.1f} predicted {p:6.1f} ratio {a / p:.3f}")
print("total actual/predicted", tot_a / tot_p)
