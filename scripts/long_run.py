"""2,000 greedy tokens on the default model: Medusa equals base.generate; peak RSS of each, in its own process.

    python scripts/long_run.py hf OUT.pt ; python scripts/long_run.py medusa OUT.pt   (then compare the two files)
"""
from __future__ import annotations

import resource
import sys
import time

import torch
from safetensors.torch import save_file

from medusa_heads import MedusaModel
from medusa_heads.commands import _chat_ids, _load_base

method, out = sys.argv[1], sys.argv[2]
torch.set_num_threads(2)
base, tok = _load_base("smollm2-135m-instruct")
ids = _chat_ids(tok, "Write a very long story about a lighthouse keeper and the sea, with many chapters.")
model = MedusaModel.from_pretrained(base) if method == "medusa" else None
t = time.perf_counter()
if method == "hf":
    seq = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2000, do_sample=False, eos_token_id=None)
else:
    seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2000, eos_token_id=None)
dt = time.perf_counter() - t
save_file({"sequences": seq.contiguous()}, out)
print(f"{method}: {seq.shape[1] - ids.shape[1]} new tokens in {dt:.0f} s, peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
