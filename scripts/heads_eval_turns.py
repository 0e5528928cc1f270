"""Held-out accuracy of heads on the follow-up answers (data/distilled_fu.jsonl), by turn: turn 1 is the target's answer
to the prompt alone, turn 2 its answer to the follow-up. Heads 2-4 given the right path above them.

    python scripts/heads_eval_turns.py [HEADS_DIR] [OUT.json]
"""
import json, sys, torch
from medusa_heads import default_heads_path
from medusa_heads.checkpoint import load_config, load_heads
from medusa_heads.loading import load_base
from medusa_heads.training.data import read_conversations, is_eval
from medusa_heads.training.features import load_segments
from medusa_heads.training.loop import build_split, draft_index, evaluate
torch.set_num_threads(2)
heads_dir = sys.argv[1] if len(sys.argv) > 1 else str(default_heads_path())
base = load_base("smollm2-135m-instruct", prepack=False)
c = load_config(heads_dir)
ids = {r["id"] for r in read_conversations("data/distilled_fu.jsonl")}
segs = load_segments("data/features", keep_ids=ids)
heads = load_heads(heads_dir, base.get_output_embeddings().weight.detach(), c, base.get_input_embeddings().weight.detach())
index = draft_index(c.draft_vocab, c.vocab_size)
out = {}
for name, keep in {"turn 1 (train-split prompts: seen)": lambda s: s.id.endswith("#0") and not is_eval(s.conv_id, 0.05),
                   "turn 1 (held-out prompts)": lambda s: s.id.endswith("#0") and is_eval(s.conv_id, 0.05),
                   "turn 2 (all: unseen)": lambda s: s.id.endswith("#1"),
                   "turn 2 (held-out prompts)": lambda s: s.id.endswith("#1") and is_eval(s.conv_id, 0.05)}.items():
    sel = [s for s in segs if keep(s)]
    if not sel:
        continue
    split = build_split(sel, c.num_heads, index, c.context_size)
    with torch.no_grad():
        m = evaluate(heads, split, decay=0.8)
    out[name] = {"conversations": len({s.conv_id for s in sel}), "tokens": int(split.hidden.shape[0]), **m}
    print(f"{name}: {len({s.conv_id for s in sel})} conversations, {split.hidden.shape[0]:,} tokens: top-1 "
          + " / ".join(f"{m[f'top1_{i + 1}']:.3f}" for i in range(c.num_heads)))
json.dump(out, open(sys.argv[2] if len(sys.argv) > 2 else "/tmp/fu_eval.json", "w"), indent=1)
