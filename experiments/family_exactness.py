#!/usr/bin/env python
"""bf16 and int8 by family: each family's tiny random model (tests/families.py, and a few more) saved and loaded by
path as a user loads a checkpoint, in bf16 and with int8 linears on this CPU; whether MedusaModel says its greedy
output is the model's plain decoding bit for bit (`exact`, checked at load: medusa_heads/kernels/exactness.py) and why not, and
whether greedy output with random heads equals the model's own `generate` on 3 prompts of 40 new tokens.

    python -m experiments.family_exactness --out results/transformers/families/exactness.md
"""
from __future__ import annotations

import sys
import tempfile
import warnings

import torch
from tqdm import tqdm

from medusa_heads import MedusaModel
from medusa_heads.machine import cpu_name
from scripts.common import emit, parser
from tests.conftest import randomize_heads
from tests.families import FAMILIES, tiny_family

# families beyond the layer-type matrix: full attention each, some computing their attention themselves
MORE = {"falcon": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}), "gpt2": ("gpt2", {}),
        "opt": ("opt", {"ffn_dim": 64, "word_embed_proj_dim": 32}), "gptj": ("gptj", {"rotary_dim": 4})}
MODES = {"bf16": {"dtype": torch.bfloat16}, "int8": {"quantize": "int8"}}


def run(folder: str, kwargs: dict) -> tuple[bool, str, int]:
    """(exact as said at load, why not, prompts whose greedy output equals generate's of 3)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = MedusaModel.from_pretrained(folder, heads=None, tree="cpu-16", **kwargs)
    why = next((str(w.message).split("top two tokens: ")[-1] for w in caught if "near-ties" in str(w.message)), "")
    randomize_heads(model)
    same = 0
    for seed in range(3):
        ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(seed))
        ref = model.base_model.generate(ids, max_new_tokens=40, min_new_tokens=40, do_sample=False)
        same += torch.equal(model.generate(ids, max_new_tokens=40, min_new_tokens=40, do_sample=False), ref)
    return model.exact, why, same


def main() -> None:
    ap = parser(__doc__.split("\n\n")[0], out="results/transformers/families/exactness.md")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    names = list(FAMILIES) + list(MORE)
    print(f"{len(names)} families x {len(MODES)} dtypes: about {len(names) * len(MODES) * 3 // 60 + 1} minutes",
          file=sys.stderr)
    lines = ["# bf16 and int8 by family: bit for bit, as checked at load", "",
             f"{cpu_name()}; tiny random models (hidden size 32), saved and loaded by path; random heads; greedy, 3 "
             "prompts of 40 new tokens against the model's own `generate` (`python -m experiments.family_exactness`).",
             "", "| family | bf16: exact | = generate | int8: exact | = generate | why not exact |",
             "|---|---|---|---|---|---|"]
    for name in tqdm(names):
        if name in FAMILIES:
            model = tiny_family(name)
        else:
            from transformers import AutoConfig, AutoModelForCausalLM

            from tests.families import SIZES
            torch.manual_seed(0)
            model_type, extra = MORE[name]
            sizes = {k: v for k, v in SIZES.items() if k != "head_dim"}
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**sizes, **extra})).eval()
        with tempfile.TemporaryDirectory() as folder:
            model.save_pretrained(folder)
            cells, whys = [], []
            for mode, kwargs in MODES.items():
                try:
                    exact, why, same = run(folder, kwargs)
                    cells += ["yes" if exact else "**no**", f"{same}/3"]
                    if why:
                        whys.append(f"{mode}: {why}")
                except Exception as e:  # noqa: BLE001: a family that cannot load says so in its row
                    cells += ["error", "-"]
                    whys.append(f"{mode}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        lines.append(f"| {name} | " + " | ".join(cells) + " | " + "; ".join(whys) + " |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
