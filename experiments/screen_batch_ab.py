"""One process, batches of the 16 first bench prompts, greedy, 128 new tokens: the LM head's screen on and off, and
transformers' batched generate, alternating. Run from the repository's root: python -m experiments.screen_batch_ab 2,4,8"""

from functools import partial

import torch
from medusa_heads import MedusaModel
from medusa_heads.calibration.timing import alternate
from medusa_heads.loading import load_tokenizer
from medusa_heads.corpus import read_prompts
from medusa_heads.prompting import prompt_text
from scripts.common import parser


def call(k, enc):  # m: the model, loaded below
    if k == "hf":
        return m.base_model.generate(**enc, max_new_tokens=128, do_sample=False)
    return m.generate(**enc, max_new_tokens=128, do_sample=False)


def switch(k):
    if k != "hf":
        m.target.screen.enabled = k == "screen"


if __name__ == "__main__":
    p = parser(__doc__)
    p.add_argument("batch_sizes", help="comma-separated, e.g. 2,4,8")
    args = p.parse_args()
    torch.set_num_threads(2)
    m = MedusaModel.from_pretrained("smollm2-135m-instruct")
    tok = load_tokenizer("smollm2-135m-instruct")
    tok.padding_side = "left"
    rows = read_prompts("data/bench_prompts.jsonl")[:16]
    for B in map(int, args.batch_sizes.split(",")):
        encs = [
            tok(
                [prompt_text(tok, [{"role": "user", "content": r.turns[0]}]) for r in rows[i : i + B]],
                return_tensors="pt",
                padding=True,
                add_special_tokens=False,
            )
            for i in range(0, 16, B)
        ]
        T = {"full": 0.0, "screen": 0.0, "hf": 0.0}
        for _, results in alternate({k: partial(call, k) for k in T}, encs, before=switch):
            for k, (_, seconds) in results.items():
                T[k] += seconds
            assert torch.equal(results["full"].output, results["screen"].output)
        print(
            f"B={B} seconds {({k: round(v, 2) for k, v in T.items()})}; screen/full speed {T['full'] / T['screen']:.3f}; "
            f"vs generate: full {T['hf'] / T['full']:.3f}, screen {T['hf'] / T['screen']:.3f}",
            flush=True,
        )
