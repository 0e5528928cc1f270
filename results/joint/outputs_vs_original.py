"""How far Medusa-2's adapter moves the target's greedy output, and tau of each pair (heads, target) on the bench prompts."""
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from medusa_heads import MedusaModel
from medusa_heads.default_model import resolve_model
from medusa_heads.prompting import prompt_ids
from medusa_heads.training.data import read_prompts
torch.set_num_threads(2)
joint_dir = sys.argv[1]
path = resolve_model("smollm2-135m-instruct")
tok = AutoTokenizer.from_pretrained(path)
rows = read_prompts("data/bench_prompts.jsonl")
out = {}
for name, heads in (("original", "runs/heads-v5"), ("adapted", joint_dir)):
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    m = MedusaModel.from_pretrained(base, heads=heads, prepack=True)
    seqs, acc, steps = [], 0, 0
    for r in rows:
        ids = prompt_ids(tok, r.turns[0])
        res = m.generate(ids, max_new_tokens=128, do_sample=False, return_dict_in_generate=True, prompt_lookup_num_tokens=0)
        seqs.append(res.sequences[0, ids.shape[1]:].tolist())
        acc += res.stats.new_tokens
        steps += res.stats.steps
        print(name, r.id, f"tau {res.stats.mean_accepted:.2f}", flush=True)
    out[name] = seqs
    print(f"{name}: tau (heads only, calibrated tree) {acc / steps:.3f}", flush=True)
same = sum(a == b for a, b in zip(out["original"], out["adapted"]))
def prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y: break
        n += 1
    return n
pre = [prefix(a, b) for a, b in zip(out["original"], out["adapted"])]
print(f"identical greedy answers: {same}/{len(rows)}; mean common prefix {sum(pre)/len(pre):.1f} of 128 tokens; per prompt {pre}")
json.dump(out, open(joint_dir + "/greedy_outputs.json", "w"))
