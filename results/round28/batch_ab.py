"""One process, batches alternating: decode_batch before the rows were packed at their own ends (db84de6, its cache
surgery with it) against now, and transformers' batched generate. Run from the repository's root:
python results/round28/batch_ab.py 2,4,8"""
import subprocess, sys, tempfile, time, torch
from medusa_heads import MedusaModel, model as M
from medusa_heads.inference.batch import decode_batch as new

folder = tempfile.mkdtemp()  # the old batch.py and cache.py as committed, importable side by side
for name in ("cache", "batch"):
    source = subprocess.run(["git", "show", f"db84de6:inference/{name}.py"], capture_output=True, text=True, check=True).stdout
    source = source.replace("from medusa_heads.inference.cache import", "from old_cache import")
    open(f"{folder}/old_{name}.py", "w").write(source)
sys.path.insert(0, folder)
from old_batch import decode_batch as old
from medusa_heads.loading import load_tokenizer
from medusa_heads.training.data import read_prompts
from medusa_heads.prompting import prompt_text
torch.set_num_threads(2)
m = MedusaModel.from_pretrained("smollm2-135m-instruct")
tok = load_tokenizer("smollm2-135m-instruct"); tok.padding_side = "left"
rows = read_prompts("data/bench_prompts.jsonl")[:16]
for B in map(int, sys.argv[1].split(",")):
    encs = [tok([prompt_text(tok, [{"role": "user", "content": r.turns[0]}]) for r in rows[i:i+B]], return_tensors="pt", padding=True, add_special_tokens=False) for i in range(0, 16, B)]
    T = {"old": 0.0, "new": 0.0, "hf": 0.0}; outs = {}
    for i, enc in enumerate(encs):
        for k in (["old", "new", "hf"] if i % 2 == 0 else ["hf", "new", "old"]):
            t = time.perf_counter()
            if k == "hf":
                o = m.base_model.generate(**enc, max_new_tokens=128, do_sample=False)
            else:
                M.decode_batch = old if k == "old" else new
                o = m.generate(**enc, max_new_tokens=128, do_sample=False)
            T[k] += time.perf_counter() - t
            outs[k] = o
        assert torch.equal(outs["old"], outs["new"])
    print(B, {k: round(v, 2) for k, v in T.items()}, "new/old speed", round(T["old"] / T["new"], 3), "hf/new", round(T["hf"] / T["new"], 3), "hf/old", round(T["hf"] / T["old"], 3), flush=True)
