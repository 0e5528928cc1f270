#!/usr/bin/env python
"""Replays the per-step tree over distilled answers without the target's verify: at each step the drafter chooses its
tree from the answer so far (the target's hidden state from one forward over the whole conversation), the answer's
next tokens say how far the target would accept (the distilled answers are the target's greedy ones), and the
replay moves on by that many tokens plus the target's own, as decoding does, the online correction included.

    python scripts/tree_replay.py --data data/distilled.jsonl.gz --exclude data/bench_prompts*.jsonl \
        --half test --max-answer 128 --out results/x/replay.md
    python scripts/tree_replay.py ... --half fit --record candidates.safetensors

Only the conversations the heads did not train on are replayed (their recipe's held-out split, as `calibrate`
reads it), less the prompts of the --exclude files (the bench's, which judge what the replay tunes), in two
halves by prompt (calibrate's split: fit on one, judge on the other).

Prints τ and the cost model's expected speed-up over plain decoding (tokens per millisecond of the stored cost model:
the verify at the tree's size and context, the drafting levels run, the fixed overhead). With --record, every head
candidate whose parent lies on the answer's path is written with its features and whether it is the answer's next
token there (acceptance given an accepted parent): what a score of the candidates is fitted on. With --score, the
candidates' rates come from a fitted score (scripts/fit_score.py) instead of the stored calibration."""
from __future__ import annotations

import argparse
import json

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from medusa_heads import MedusaModel
from medusa_heads.calibration import held_out_conversations
from medusa_heads.calibration.measure import second_half
from medusa_heads.default_model import default_heads_path
from medusa_heads.inference import adaptive
from medusa_heads.inference.adaptive import AdaptiveDrafter
from medusa_heads.inference.prepack import stock_kernels
from medusa_heads.inference.propose import MAX_NGRAM, lookup_match
from medusa_heads.loading import load_tokenizer
from medusa_heads.prompting import conversation_ids, mask_runs
from medusa_heads.training.data import prompt_id, read_conversations, read_prompts
from common import emit

FEATURES = ("logit p", "logit top p", "rank 1", "rank 2", "rank 3", "entropy", "logit parent rate", "logit calibrated",
            "last accepted", "lookup ngram")


def logit(x: torch.Tensor) -> torch.Tensor:
    return torch.logit(x.float(), 1e-4)


class Replay(AdaptiveDrafter):
    """The adaptive drafter, keeping each level's candidate features (and, with a score, rating by it)."""

    score: dict | None = None

    def _rates(self, d, logits, probs, frontier, val, par):
        calibrated = super()._rates(d, logits, probs, frontier, val, par)
        parent_rates = [val[i] / max(val[par[i]], 1e-12) if par[i] >= 0 else 1.0 for i in frontier]
        logp = logits.float().log_softmax(-1)
        entropy = -(logp.exp() * logp).sum(-1, keepdim=True).expand_as(probs)
        k = probs.shape[1]
        rank = torch.arange(k)[None].expand_as(probs)
        x = torch.stack([logit(probs), logit(probs[:, :1]).expand_as(probs), (rank == 1).float(), (rank == 2).float(),
                         (rank == 3).float(), entropy, logit(torch.tensor(parent_rates))[:, None].expand_as(probs),
                         logit(calibrated), torch.full_like(probs, float(min(self._last, 8))),
                         torch.full_like(probs, float(self._ngram))], dim=-1)  # (F, k, n)
        self._features.append(torch.cat([torch.full((*probs.shape, 1), float(d)), x], -1).reshape(-1, 1 + len(FEATURES)))
        if self.score is None:
            return calibrated
        w = torch.tensor(self.score["weights"][min(d, len(self.score["weights"])) - 1])
        mean, std = torch.tensor(self.score["mean"]), torch.tensor(self.score["std"])
        return torch.sigmoid(((x - mean) / std) @ w[1:] + w[0])

    _last = 0

    def _draft_row(self, h, sequence):
        self._features = []
        self._ngram = lookup_match(sequence, self.lookup_tokens, self.max_ngram, self.min_ngram)[1] if self.lookup_tokens else 0
        return super()._draft_row(h, sequence)

    def update(self, accepted):
        self._last = len(accepted[0]) - 1
        super().update(accepted)

    def _merge_lookup(self, sequence, tok, par, val, slot, paths):
        self._paths = [tuple(p[1:]) for p in paths]  # the head candidates, in the order their features were kept
        super()._merge_lookup(sequence, tok, par, val, slot, paths)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="distilled conversations (JSONL), greedy answers of the target")
    p.add_argument("--exclude", nargs="*", default=[], help="prompt files (JSONL with ids) whose prompts are left out")
    p.add_argument("--half", choices=("fit", "test", "all"), default="all", help="which half of the prompts (calibrate's split)")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--heads", default=None)
    p.add_argument("--score", default=None, help="a fitted score (JSON) to rate the candidates by")
    p.add_argument("--record", default=None, help="write the candidates' features and labels here (.safetensors)")
    p.add_argument("--max-answer", type=int, default=256, help="replay at most this many tokens of each answer")
    p.add_argument("--topk", type=int, default=None, help="candidates per parent (default: the drafter's)")
    p.add_argument("--beam", type=int, default=None, help="parents expanded per level (default: the drafter's)")
    p.add_argument("--lookup", type=int, default=None, help="prompt-lookup tokens (default: the heads' config)")
    p.add_argument("--lookup-branches", type=int, default=None, help="prompt-lookup continuations (default: the heads' config)")
    p.add_argument("--prior", type=float, default=None, help="the online correction's prior, in observations (default: the drafter's)")
    p.add_argument("--no-phrasebook", action="store_true", help="draft without the heads' phrasebook")
    p.add_argument("--stock", action="store_true", help="size the trees by the stock kernels' cost model")
    p.add_argument("--unseen", action="store_true", help="--data holds answers to prompts no heads trained on: replay all")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.record and args.lookup == 0:
        p.error("--record reads the candidates' paths where the lookup merges them: leave the lookup on")
    torch.set_num_threads(args.threads)
    if args.prior is not None:
        adaptive.PRIOR = args.prior  # Correction.fit reads it at every fit
    model = MedusaModel.from_pretrained(args.model, **({"heads": args.heads} if args.heads else {}))
    if args.stock:  # the stock kernels' cost model sizes the trees (the hidden states are the same either way)
        stock_kernels(model.base_model).__enter__()
    tok = load_tokenizer(args.model)
    excluded = {r.id for f in args.exclude for r in read_prompts(f)}
    read = read_conversations(args.data)
    conversations = [c for c in (read if args.unseen else held_out_conversations(read, args.heads or default_heads_path()))
                     if prompt_id(c["id"]) not in excluded
                     and (args.half == "all" or second_half(c["id"]) == (args.half == "test"))][: args.limit]
    cost = model.cost_model()
    score = json.loads(open(args.score).read()) if args.score else None
    levels = [0]
    head_logits = model.heads.head_logits

    def counted(*a, **k):
        levels[0] += 1
        return head_logits(*a, **k)

    model.heads.head_logits = counted
    steps = tokens = ms = plain_ms = 0.0
    features, labels = [], []
    for conv in tqdm(conversations, desc="replay", unit="conv"):
        ids, mask = conversation_ids(tok, conv["messages"], 2048)
        with torch.no_grad():
            hidden = model.base_model.base_model(ids[None]).last_hidden_state[0].float()  # the LM head's input
        lookup = model.config.lookup_tokens if args.lookup is None else args.lookup
        drafter = model._adaptive_drafter(lookup, MAX_NGRAM)  # as generate makes it, then with the recording added
        drafter.__class__, drafter.score = Replay, score
        if args.no_phrasebook:
            drafter.phrases = drafter.phrase_acceptance = None
        drafter.branches = args.lookup_branches or drafter.branches
        drafter.topk, drafter.beam = args.topk or drafter.topk, args.beam or drafter.beam
        for start, end in mask_runs(mask):
            end = min(end, start + args.max_answer)
            pos = max(start, 1)
            while pos < end - 1:  # ids[pos] is the root: the target's token from hidden[pos - 1]
                levels[0] = 0
                draft = drafter.draft(hidden[pos - 1][None], [ids[: pos + 1]], None)[0]
                parents, drafted = draft.buffers.parent.tolist(), draft.tokens.tolist()
                cont = ids[pos + 1 : end].tolist()
                nodes, node = [0], 0
                while len(nodes) - 1 < len(cont):
                    nxt = next((c for c in range(1, len(parents)) if parents[c] == node
                                and drafted[c - 1] == cont[len(nodes) - 1]), None)
                    if nxt is None:
                        break
                    nodes.append(nxt)
                    node = nxt
                drafter.update([torch.tensor(nodes)])
                if args.record and drafter._features:
                    x = torch.cat(drafter._features)
                    paths = drafter._paths[1 : 1 + x.shape[0]]
                    on = [path[:-1] == tuple(cont[: len(path) - 1]) for path in paths]
                    keep = torch.tensor(on)
                    features.append(x[keep])
                    labels.append(torch.tensor([path == tuple(cont[: len(path)]) for path, o in zip(paths, on) if o]))
                verify = cost.verify_ms(pos)
                ms += float(verify[len(parents) - 1]) + levels[0] * cost.draft_ms + cost.overhead_ms
                plain_ms += (len(nodes)) * (float(verify[0]) + cost.overhead_ms)
                steps += 1
                tokens += len(nodes)
                pos += len(nodes)
    if args.record:
        save_file({"features": torch.cat(features), "labels": torch.cat(labels)}, args.record,
                  metadata={"names": json.dumps(["depth", *FEATURES])})
    emit([f"Replay of {len(conversations)} conversations ({args.half}), score: {args.score or 'stored calibration'}", "",
          "| steps | τ | expected speed-up (cost model) |", "|---|---|---|",
          f"| {int(steps)} | {tokens / steps:.3f} | {plain_ms / ms:.3f} |"], args.out)


if __name__ == "__main__":
    main()
