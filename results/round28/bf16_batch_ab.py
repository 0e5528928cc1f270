"""One process, batches alternating: bf16 batches with the per-step trees of the bf16 batch table against the fixed
tree (the table hidden), and transformers' batched generate. python results/round28/bf16_batch_ab.py 4,8"""
import dataclasses, sys, time, torch
from medusa_heads import MedusaModel
from medusa_heads.loading import load_tokenizer
from medusa_heads.training.data import read_prompts
from medusa_heads.prompting import prompt_text
torch.set_num_threads(2)
m = MedusaModel.from_pretrained("smollm2-135m-instruct", dtype=torch.bfloat16)
tok = load_tokenizer("smollm2-135m-instruct"); tok.padding_side = "left"
rows = read_prompts("data/bench_prompts.jsonl")[:16]
table = m.cost_model()
assert table.batched, m.cost_model_key()
fixed = dataclasses.replace(table, batches=())
for B in map(int, sys.argv[1].split(",")):
    encs = [tok([prompt_text(tok, [{"role": "user", "content": r.turns[0]}]) for r in rows[i:i+B]], return_tensors="pt", padding=True, add_special_tokens=False) for i in range(0, 16, B)]
    T = {"fixed": 0.0, "per-step": 0.0, "hf": 0.0}
    for i, enc in enumerate(encs):
        for k in (list(T) if i % 2 == 0 else list(T)[::-1]):
            m.cost_model = (lambda: table) if k == "per-step" else (lambda: fixed)
            t = time.perf_counter()
            if k == "hf":
                m.base_model.generate(**enc, max_new_tokens=128, do_sample=False)
            else:
                m.generate(**enc, max_new_tokens=128, do_sample=False)
            T[k] += time.perf_counter() - t
    print(B, {k: round(v, 2) for k, v in T.items()}, {k: round(T["hf"] / v, 3) for k, v in T.items()}, flush=True)
