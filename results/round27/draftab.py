import sys, time, torch, importlib.util
from medusa_heads import MedusaModel
from medusa_heads.loading import load_tokenizer
from medusa_heads.training.data import read_prompts
from medusa_heads.prompting import prompt_ids
from medusa_heads.inference import adaptive as new
import subprocess, tempfile
# round 26's drafter, as committed (run from the repository's root)
source = subprocess.run(["git", "show", "bfd1c45:inference/adaptive.py"], capture_output=True, text=True, check=True).stdout
with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
    f.write(source)
spec = importlib.util.spec_from_file_location("adaptive_old", f.name); old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
torch.set_num_threads(2)
m = MedusaModel.from_pretrained("smollm2-135m-instruct")
tok = load_tokenizer("smollm2-135m-instruct")
rows = read_prompts("data/bench_prompts.jsonl")[:6]
cases = []
orig = new.AdaptiveDrafter.draft
def rec(self, hidden, seqs, buffers):
    cases.append((hidden.clone(), [s.clone() for s in seqs])); return orig(self, hidden, seqs, buffers)
new.AdaptiveDrafter.draft = rec
for r in rows:
    m.generate(prompt_ids(tok, r.turns[0]), max_new_tokens=64, do_sample=False)
new.AdaptiveDrafter.draft = orig
d_new = m._adaptive_drafter(10, 3)
acc, tab, cost = m._adaptive_config()
d_old = old.AdaptiveDrafter(m.heads, acc, cost, tab, 10, max_ngram=3, min_ngram=min(3, tab.ngrams[0]), lookup_branches=1,
                            phrases=d_new.phrases, phrase_acceptance=d_new.phrase_acceptance)
T = {"old": 0.0, "new": 0.0}
with torch.no_grad():
    for rep in range(3):
        for i, (h, s) in enumerate(cases):
            for name, d in (("old", d_old), ("new", d_new)) if (i + rep) % 2 == 0 else (("new", d_new), ("old", d_old)):
                t = time.perf_counter(); out = d.draft(h, s, None); T[name] += time.perf_counter() - t
n = 3 * len(cases)
print("cases", len(cases), {k: round(v / n * 1e3, 3) for k, v in T.items()}, "ms per draft")
a = d_old.draft(*cases[5][:2], None)[0]; b = d_new.draft(*cases[5][:2], None)[0]
print("same tree", torch.equal(a.tokens, b.tokens), torch.equal(a.buffers.parent, b.buffers.parent))
