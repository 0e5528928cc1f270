"""The shipped heads with a larger draft vocabulary at inference (no retraining: they score through the base LM
head's rows): the old 4,096 tokens, then the most frequent others in the training answers, into runs/heads_v<size>.
Run from the repository's root: python results/round28/draft_vocab.py 8192 16384"""
import json, gzip, sys, collections, shutil
from medusa_heads.loading import load_tokenizer
from medusa_heads.default_model import default_heads_path
from medusa_heads.calibration import held_out_conversations
tok = load_tokenizer("smollm2-135m-instruct")
files = ["data/distilled.jsonl.gz", "data/distilled_t07.jsonl.gz", "data/distilled_fu.jsonl.gz", "data/distilled_self.jsonl.gz"]
rows = [json.loads(l) for f in files for l in gzip.open(f, "rt")]
held = {c["id"] for c in held_out_conversations(rows, default_heads_path())}
cnt = collections.Counter()
for r in rows:
    if r["id"] in held: continue
    for m in r["messages"]:
        if m["role"] == "assistant":
            cnt.update(tok(m["content"], add_special_tokens=False).input_ids)
cfg = json.load(open(default_heads_path() / "config.json"))
old = cfg["draft_vocab"]
print("old", len(old), "distinct tokens seen", len(cnt))
for size in map(int, sys.argv[1:]):
    extra = [t for t, _ in cnt.most_common() if t not in set(old)]
    new = old + extra[: size - len(old)]
    d = f"runs/heads_v{size}"
    shutil.rmtree(d, ignore_errors=True); shutil.copytree(default_heads_path(), d)
    c = dict(cfg); c["draft_vocab"] = new
    json.dump(c, open(f"{d}/config.json", "w"))
    print(size, len(new))
