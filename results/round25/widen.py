"""Function-preserving widening of the heads' MLP blocks: new hidden units with default-initialised up rows and zero
down columns, so the widened heads draft exactly as the narrow ones until trained."""
import copy, sys, torch
from medusa_heads.checkpoint import load_config, load_heads, save_heads
from medusa_heads.heads import MedusaHeads
from medusa_heads.loading import load_base
src, dst, width = sys.argv[1], sys.argv[2], int(sys.argv[3])  # python results/round25/widen.py SRC DST WIDTH
torch.manual_seed(11)
base = load_base("smollm2-135m-instruct", prepack=False)
lm, emb = base.get_output_embeddings().weight.detach(), base.get_input_embeddings().weight.detach()
old = load_heads(src, lm, load_config(src), emb)
config = copy.deepcopy(old.config)
config.mlp_size = width
config.adaptive = {k: v for k, v in (config.adaptive or {}).items() if k != "acceptance"}
new = MedusaHeads(config, lm, emb)
sd, osd = new.state_dict(), old.state_dict()
with torch.no_grad():
    for k, v in osd.items():
        t = sd[k]
        if t.shape == v.shape:
            t.copy_(v)
        elif k.endswith("up.weight") or k.endswith("up.bias"):
            t[: v.shape[0]] = v  # new rows keep nn.Linear's default init
        elif k.endswith("down.weight"):
            t.zero_(); t[:, : v.shape[1]] = v
        else:
            raise ValueError(k)
new.load_state_dict(sd)
h = torch.randn(5, 576) * 3
ctx = torch.randint(0, 49152, (5, config.context_size))
print("max |diff|", float((new(h, ctx) - old(h, ctx)).abs().max()))
save_heads(dst, new, config)
