#!/usr/bin/env python
"""Write user prompts that the target itself asks (Magpie's method): given only its chat template up to the opening of
a user turn, an instruct model samples what a user would write there. The heads' training prompts come from a few
public sets (GSM8K is 30% of the distilled answers), while people ask the target everyday assistant questions; on one
such question ("Why is the sky blue?") head 1's held-out top-1 falls from 0.54 to 0.24. These prompts are that kind,
in the target's own idea of a user, and `distill` then answers them greedily like any other prompt:

    python scripts/make_self_prompts.py --count 3000 --out data/self_prompts.jsonl.gz
    medusa-heads distill --prompts data/self_prompts.jsonl.gz --out data/distilled_self.jsonl --features data/features_self

Resumable: rows already in --out are kept and counted, and batch i is always sampled with seed + i. A sample is kept
only if the model closed its turn (end of turn within --max-new-tokens), it has 4 words or more and no role
markers, it is new (case- and space-normalised), and it shares no 13-word n-gram with the --exclude prompt files
(the bench's, so that the bench keeps judging prompts the heads never trained on)."""
from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import json
import re
from pathlib import Path

import torch
from tqdm import tqdm

from medusa_heads.default_model import DEFAULT_MODEL
from medusa_heads.loading import load_base, load_tokenizer
from medusa_heads.prompting import eos_ids, has_chat_template
from medusa_heads.corpus import read_prompts

MARKER = "\x00USER\x00"  # stands for the user's text while the template is cut at its opening
SOURCE = "self-magpie"


def user_turn_opening(tokenizer) -> str:
    """The chat template rendered up to where a user's first message begins (with the template's default system
    turn, if it has one). Raises for a tokenizer without a chat template: there is no user turn to open."""
    if not has_chat_template(tokenizer):
        raise ValueError("the model's tokenizer has no chat template: a prompt written by the model needs the "
                         "template's opening of a user turn")
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARKER}], tokenize=False, add_generation_prompt=False)
    return text.split(MARKER, 1)[0]


def normalised(text: str) -> str:
    return " ".join(text.lower().split())


def ngrams(text: str, n: int = 13) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def keep(text: str, seen: set[str], banned: set[tuple[str, ...]]) -> bool:
    return (len(text.split()) >= 4 and "<|" not in text and not re.search(r"(?im)^\s*(user|assistant|system)\s*:", text)
            and normalised(text) not in seen and not (ngrams(text) & banned))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--out", default="data/self_prompts.jsonl.gz")
    p.add_argument("--count", type=int, required=True, help="prompts wanted in --out in all")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=96, help="longest prompt sampled (a longer one is dropped)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exclude", nargs="*", default=sorted(glob.glob("data/bench_prompts*.jsonl")),
                   help="prompt files to share no 13-word n-gram with (default: every bench prompt file)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    out = Path(args.out)
    rows = read_prompts(out) if out.exists() else []
    seen = {normalised(r.turns[0]) for r in rows}
    banned = set().union(*(ngrams(t) for f in args.exclude for r in read_prompts(f) for t in r.turns))
    tokenizer = load_tokenizer(args.model)
    model = load_base(args.model)
    opening = tokenizer(user_turn_opening(tokenizer), return_tensors="pt", add_special_tokens=False).input_ids
    stop = set(eos_ids(model.generation_config, tokenizer))
    state = out.with_suffix(".state")  # batches sampled so far: batch i is sampled with seed + i
    tried = json.loads(state.read_text())["batches"] if state.exists() else 0
    bar = tqdm(total=args.count, initial=min(len(rows), args.count), desc="prompts", unit="prompt")
    while len(rows) < args.count:
        torch.manual_seed(args.seed + tried)
        ids = opening.expand(args.batch_size, -1)
        with torch.no_grad():
            seqs = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=args.temperature,
                                  top_p=args.top_p, top_k=0, max_new_tokens=args.max_new_tokens, eos_token_id=sorted(stop),
                                  pad_token_id=tokenizer.pad_token_id or min(stop))
        new = []
        for seq in seqs[:, ids.shape[1] :].tolist():
            closed = next((i for i, t in enumerate(seq) if t in stop), None)
            if closed is None:
                continue  # the turn did not end within the budget
            text = tokenizer.decode(seq[:closed], skip_special_tokens=True).strip()
            if keep(text, seen, banned):
                seen.add(normalised(text))
                rid = f"self:{hashlib.sha1(text.encode()).hexdigest()[:12]}"
                new.append({"id": rid, "prompt": text, "source": SOURCE})
        tried += 1
        with gzip.open(out, "at", encoding="utf-8") as f:  # each batch lands whole: a gzip member per append
            for row in new[: args.count - len(rows)]:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        rows += new[: args.count - len(rows)]
        state.write_text(json.dumps({"batches": tried}))
        bar.update(min(len(new), args.count - bar.n))
    bar.close()
    print(f"{len(rows)} prompts in {out} ({tried} batches of {args.batch_size} sampled)")


if __name__ == "__main__":
    main()
