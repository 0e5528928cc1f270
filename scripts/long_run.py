"""2,000 greedy tokens on the default model: Medusa equals base.generate; time and peak RSS of each, in its own process.

    python -m scripts.long_run hf OUT.safetensors ; python -m scripts.long_run medusa OUT.safetensors
    (then compare the two files)
"""
from __future__ import annotations

import resource
import time

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer

from medusa_heads import MedusaModel, default_model_path
from medusa_heads.prompting import prompt_ids
from scripts.common import parser

PROMPT = "Write a very long story about a lighthouse keeper and the sea, with many chapters."

if __name__ == "__main__":
    p = parser(__doc__)
    p.add_argument("method", help="hf: transformers' generate; anything else: the heads")
    p.add_argument("out", help="safetensors file for the output ids")
    args = p.parse_args()
    method, out = args.method, args.out
    torch.set_num_threads(2)
    model = MedusaModel.from_pretrained("smollm2-135m-instruct")  # shipped heads; prepacked kernels for both methods
    ids = prompt_ids(AutoTokenizer.from_pretrained(default_model_path()), PROMPT)
    mask = torch.ones_like(ids)  # the chat prompt holds the pad token: with eos_token_id=None it must not be inferred
    t = time.perf_counter()
    if method == "hf":
        seq, tau = model.base_model.generate(ids, attention_mask=mask, max_new_tokens=2000, do_sample=False,
                                             eos_token_id=None), 1.0
    else:
        res = model.generate(ids, attention_mask=mask, max_new_tokens=2000, eos_token_id=None, return_dict_in_generate=True)
        seq, tau = res.sequences, res.stats.mean_accepted
    dt = time.perf_counter() - t
    save_file({"sequences": seq.contiguous()}, out)
    print(f"{method}: {seq.shape[1] - ids.shape[1]} new tokens in {dt:.0f} s ({(seq.shape[1] - ids.shape[1]) / dt:.1f} "
          f"tokens/s, tau {tau:.2f}), peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
