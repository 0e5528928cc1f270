import sys, time, torch, collections
from medusa_heads import MedusaModel
from medusa_heads.loading import load_tokenizer
from medusa_heads.training.data import read_prompts
from medusa_heads.prompting import prompt_text
torch.set_num_threads(2)
m = MedusaModel.from_pretrained("smollm2-135m-instruct")
tok = load_tokenizer("smollm2-135m-instruct"); tok.padding_side = "left"
B = int(sys.argv[1])
rows = read_prompts("data/bench_prompts.jsonl")[:16]
encs = [tok([prompt_text(tok, [{"role": "user", "content": r.turns[0]}]) for r in rows[i:i+B]], return_tensors="pt", padding=True, add_special_tokens=False) for i in range(0, 16, B)]
m.generate(**encs[0], max_new_tokens=8, do_sample=False)
rec = []
orig = m.target.verify_batch
def timed(tokens, positions, valid, cache, mask, depth):
    t = time.perf_counter(); out = orig(tokens, positions, valid, cache, mask, depth)
    rec.append((tokens.shape[1], valid.shape[1], int(positions.max()), (time.perf_counter() - t) * 1e3)); return out
m.target.verify_batch = timed
cost = m.cost_model()
for enc in encs:
    m.generate(**enc, max_new_tokens=128, do_sample=False)
by = collections.defaultdict(list)
for T, P, pos, ms in rec:
    by[T].append((ms, float(cost.verify_ms(P, rows=B)[T - 1]), float(cost.verify_ms(pos, rows=B)[T - 1]), P, pos))
for T in sorted(by):
    v = by[T]; n = len(v)
    print(f"T {T:2d} steps {n:4d} actual {sum(x[0] for x in v)/n:6.1f} pred(cache len) {sum(x[1] for x in v)/n:6.1f} pred(real len) {sum(x[2] for x in v)/n:6.1f} cache {sum(x[3] for x in v)/n:5.0f} real {sum(x[4] for x in v)/n:5.0f}")
