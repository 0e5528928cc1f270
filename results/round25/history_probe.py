"""Round 25's probe: does head 1 gain from earlier final hidden states (h_{t-1}, h_{t-2}, h_{t-3}), added through a
zero-initialised projection? Head-1-only fine-tunes of the stage-4 heads, 400 steps of 2,048 tokens, on the features of
stage 9's data (data/features_self), held out by the trainer's hash split.

    python results/round25/history_probe.py 1     # previous states: 0 (control), 1 or 3; from the repo root"""
import sys, time, torch, torch.nn.functional as F
from torch import nn
from medusa_heads.checkpoint import load_config, load_heads
from medusa_heads.training.features import load_segments, segment_context
from medusa_heads.training.data import is_eval
from medusa_heads.training.loop import draft_index
from medusa_heads.loading import load_base
torch.manual_seed(0); torch.set_num_threads(2)
HEADS = "runs/smollm2-135m-heads-stage4"  # git show ba0cd17:medusa_heads/default_heads/
base = load_base("smollm2-135m-instruct", prepack=False)
lm, emb = base.get_output_embeddings().weight.detach(), base.get_input_embeddings().weight.detach()
segs = load_segments("data/features_self")
print("segments", len(segs), flush=True)
NPREV = 3
def build(segs):
    H, P, T, C = [], [], [], []
    for s in segs:
        n = len(s.tokens)
        if n < 3: continue
        h = s.hidden
        prev = torch.zeros(n, NPREV, h.shape[1], dtype=h.dtype)
        for j in range(1, NPREV + 1):
            prev[j:, j - 1] = h[:-j]
        H.append(h[:-1]); P.append(prev[:-1]); T.append(s.tokens[1:]); C.append(segment_context(s.tokens, 1)[:-1])
    return torch.cat(H), torch.cat(P), torch.cat(T), torch.cat(C)
tr = build([s for s in segs if not is_eval(s.conv_id, 0.05)])
ev = build([s for s in segs if is_eval(s.conv_id, 0.05)])
print("train", tr[0].shape[0], "eval", ev[0].shape[0], flush=True)
def run(nprev, steps=400, lr=1e-4, plr=1e-3):
    config = load_config(HEADS)
    heads = load_heads(HEADS, lm, config, emb)
    index = draft_index(config.draft_vocab, config.vocab_size)
    proj = nn.Linear(576 * max(nprev, 1), 576, bias=False); nn.init.zeros_(proj.weight)
    params = list(heads.blocks[0].parameters()) + list(heads.token_proj[0].parameters())
    opt = torch.optim.AdamW([{"params": params, "lr": lr}, {"params": proj.parameters(), "lr": plr}])
    def logits(h, p, c):
        h = h.float()
        if nprev: h = h + proj(p[:, :nprev].float().flatten(1))
        return heads.head_logits(0, h, c)
    g = torch.Generator().manual_seed(1)
    N = tr[0].shape[0]
    t0 = time.time()
    for step in range(steps):
        idx = torch.randint(0, N, (2048,), generator=g)
        y = index[tr[2][idx]]
        loss = F.cross_entropy(logits(tr[0][idx], tr[1][idx], tr[3][idx]), y.masked_fill(y < 0, -100))
        opt.zero_grad(); loss.backward(); opt.step()
    with torch.no_grad():
        hits = n = 0
        for a in range(0, ev[0].shape[0], 8192):
            y = index[ev[2][a:a+8192]]
            pred = logits(ev[0][a:a+8192], ev[1][a:a+8192], ev[3][a:a+8192]).argmax(-1)
            hits += int((pred == y).sum()); n += len(y)
    print(f"nprev={nprev} plr={plr} steps={steps} top1={hits/n:.4f} ({time.time()-t0:.0f}s)", flush=True)
nprev = int(sys.argv[1])
for plr in ((1e-3,) if nprev == 0 else (1e-3, 1e-4)):  # the projection's learning rate
    run(nprev, plr=plr)
