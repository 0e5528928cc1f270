"""2x2 on the joint run's held-out split: {shipped heads, joint heads} x {frozen target, adapted target}."""
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from peft import PeftModel
from medusa_heads.default_model import resolve_model
from medusa_heads.checkpoint import load_config, load_heads
from medusa_heads.training.recipe import TrainRecipe
from medusa_heads.prompting import conversation_ids
from medusa_heads.training.data import read_conversations
from medusa_heads.training.joint import Seq, evaluate_joint
from medusa_heads.training.data import is_eval
from medusa_heads.training.trainer import draft_index
torch.set_num_threads(2)
joint_dir, init_dir = sys.argv[1], sys.argv[2]
recipe = TrainRecipe(**{k: v for k, v in load_config(joint_dir).extra["recipe"].items()})
path = resolve_model(recipe.model)
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(path)
eos = tok.eos_token_id
seqs = []
for conv in read_conversations(recipe.data):
    if not is_eval(conv["id"], recipe.eval_fraction):
        continue
    ids, mask = conversation_ids(tok, conv["messages"], recipe.max_length)
    if mask[1:].any():
        seqs.append(Seq(conv["id"], ids, mask, [m.get("finished", True) for m in conv["messages"] if m["role"] == "assistant"]))
lm, emb = base.get_output_embeddings().weight.detach(), base.get_input_embeddings().weight.detach()
heads = {}
for name, d in (("shipped", init_dir), ("joint", joint_dir)):
    cfg = load_config(d)
    heads[name] = load_heads(d, lm, cfg, emb).eval()
    index = draft_index(cfg.draft_vocab or list(range(lm.shape[0])), lm.shape[0])
model = PeftModel.from_pretrained(base, f"{joint_dir}/adapter").eval()
rows = {}
for target in ("frozen", "adapted"):
    for name in ("shipped", "joint"):
        if (name, target) == ("shipped", "frozen") and len(sys.argv) > 3:
            continue
        if target == "frozen":
            with model.disable_adapter():
                m = evaluate_joint(model, heads[name], seqs, index, recipe, "cpu", eos)
        else:
            m = evaluate_joint(model, heads[name], seqs, index, recipe, "cpu", eos)
        rows[f"{name} heads / {target} target"] = m
        print(f"{name:8s} heads / {target:7s} target: " + " ".join(f"h{k} {m[f'top1_{k}']:.4f}/{m[f'top5_{k}']:.4f}" for k in range(1, 5)) + f"  KL {m['kl_to_frozen']:.5f}", flush=True)
json.dump(rows, open(f"{joint_dir}/cmp.json", "w"), indent=1)
