"""Write data/followup_prompts.jsonl.gz: each distilled prompt again, with a generic follow-up as its second turn.

The training prompts are all single-turn, so the heads have never seen how the target answers inside a
conversation. Distilled greedily as a variant, each row gives the target's own answer to its prompt (as in
data/distilled.jsonl) and then its answer to the follow-up:

    python -m scripts.make_followups data/train_prompts.jsonl.gz
    medusa-heads distill --prompts data/followup_prompts.jsonl.gz --out data/distilled_fu.jsonl --variant fu \\
        --batch-size 32 --max-new-tokens 256 --features data/features

The rows are the prompts the distillation kept (GSM8K capped as it was, same seed), under their own ids, so the
variant's answers fall on their prompt's side of the held-out split; the bench prompts stay out of training. The
follow-up of a row is picked by a hash of its id; distill shuffles the rows, so a partial run covers every source.
"""
from __future__ import annotations

import gzip
import json
import zlib

from medusa_heads.corpus import read_prompts, subsample
from scripts.common import parser

FOLLOW_UPS = (
    "Can you explain that in more detail?",
    "Can you summarize your answer in two sentences?",
    "Can you give me a concrete example?",
    "Why is that?",
    "Can you put the main points in a short list?",
    "Thanks! Can you make it simpler, for a beginner?",
    "Are there any exceptions or caveats I should know about?",
    "What would you suggest I do next?",
    "Can you say that again more briefly?",
    "Is there another way to do this?",
    "What is the most important part of your answer, and why?",
    "Could you check your answer and correct anything that is wrong?",
)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("prompts")
    p.add_argument("--gsm8k-cap", type=int, default=2000, help="the cap the distillation used")
    p.add_argument("--seed", type=int, default=0, help="the seed the distillation used")
    p.add_argument("--out", default="data/followup_prompts.jsonl.gz")
    args = p.parse_args()
    rows = subsample(read_prompts(args.prompts), {"gsm8k-train": args.gsm8k_cap}, seed=args.seed)
    with gzip.open(args.out, "wt", encoding="utf-8") as f:
        for r in rows:
            follow = FOLLOW_UPS[zlib.crc32(r.id.encode()) % len(FOLLOW_UPS)]
            f.write(json.dumps({"id": r.id, "turns": [*r.turns, follow], "source": r.source}) + "\n")
    print(f"{len(rows)} rows -> {args.out}")


if __name__ == "__main__":
    main()
