"""A 30-layer Llama of SmolLM2's shape (9 query heads, 3 key-value heads) but tiny width: what a forward costs besides
its kernels. python results/round28/forward_overhead.py"""
import torch, time
from transformers import LlamaConfig, LlamaForCausalLM
from medusa_heads.inference.verify import Target
from medusa_heads.inference.cache import new_cache, crop_to
from medusa_heads.tree.buffers import from_parents
torch.set_num_threads(2)
cfg = LlamaConfig(vocab_size=64, hidden_size=72, intermediate_size=64, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
model = LlamaForCausalLM(cfg).eval()
target = Target(model)
ctx = 300
cache = new_cache(model, ctx + 32)
target.prefill(torch.randint(0, 64, (1, ctx)), cache)
buf = from_parents((-1, 0, 0, 1, 1, 3), torch.device("cpu"))
tokens = torch.randint(0, 64, (6,))
f = lambda: (target.verify(tokens, ctx, cache, buf), crop_to(cache, ctx))
g = lambda: (target.step(tokens[:1], ctx, cache), crop_to(cache, ctx))
for _ in range(5): f(); g()
ts = {"verify6": [], "step1": []}
for _ in range(30):
    for k, fn in zip(ts, (f, g)):
        t = time.perf_counter(); fn(); ts[k].append(time.perf_counter() - t)
print({k: round(sorted(v)[15] * 1e3, 2) for k, v in ts.items()})
