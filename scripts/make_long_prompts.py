"""Write data/bench_prompts_long.jsonl: prompts of 1-2K tokens, the long-context case (retrieval-augmented answers
and multi-document summaries), assembled from passages and abstracts of the training prompts. The heads learn from
answers only, never from prompt text, and these composite prompts' answers are new to them.

    python -m scripts.make_long_prompts data/train_prompts.jsonl.gz
"""
from __future__ import annotations

import json
import random

from medusa_heads.corpus import read_prompts
from scripts.common import parser


def main() -> None:
    p = parser()
    p.add_argument("prompts")
    p.add_argument("--per-category", type=int, default=3)
    p.add_argument("--passages", type=int, default=6, help="passages (or abstracts) per prompt")
    p.add_argument("--out", default="data/bench_prompts_long.jsonl")
    args = p.parse_args()
    rows = read_prompts(args.prompts)
    rng = random.Random(0)
    qa = [r.turns[0] for r in rows if r.source == "pubmedqa-context-qa" and "\nQuestion:" in r.turns[0]]
    abstracts = [r.turns[0].split("\n\n", 1)[1] for r in rows if r.source == "scitldr-summarize" and "\n\n" in r.turns[0]]
    rng.shuffle(qa)
    rng.shuffle(abstracts)
    out = []
    for i in range(args.per_category):
        group = qa[i * args.passages : (i + 1) * args.passages]
        passages = [g.split("\nQuestion:", 1)[0].removeprefix("Context:\n").strip() for g in group]
        question = group[-1].split("\nQuestion:", 1)[1].strip().splitlines()[0]
        body = "\n\n".join(f"Passage {j + 1}:\n{t}" for j, t in enumerate(passages))
        out.append({"id": f"long-rag-{i}", "category": "long-rag", "prompt":
                    f"Answer the question from the passages below.\n\n{body}\n\nQuestion: {question}"})
        docs = abstracts[i * args.passages : (i + 1) * args.passages]
        body = "\n\n".join(f"Abstract {j + 1}:\n{t.strip()}" for j, t in enumerate(docs))
        out.append({"id": f"long-summary-{i}", "category": "long-summary", "prompt":
                    f"Summarize each of these paper abstracts in one or two sentences.\n\n{body}"})
    with open(args.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in out)


if __name__ == "__main__":
    main()
