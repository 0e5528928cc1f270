"""Calibration's measurements (calibrate runs them): the heads' rank accuracies and the choice of a fixed tree from
them, prompt lookup's and the phrasebook's acceptance on held-out answers, and the merge of what the per-step tree runs
on (tree/adaptive.py) into config.adaptive. The heads' acceptance is acceptance.py, what this machine's forwards
take latency.py (both alternate their arms as timing.py does); their names are here too."""
from __future__ import annotations

import torch

from medusa_heads.calibration.acceptance import (ACCEPT_EDGES, TEMPERATURES, CandidateSamples, bin_rates, brier,
                                                 calibrate_acceptance, candidate_samples, fit_isotonic, fit_temperature,
                                                 log_loss, second_half)
from medusa_heads.calibration.latency import (BATCH_CONTEXTS, BATCH_ROWS, BATCH_SIZES, COST_CONTEXTS, COST_SIZES,
                                              LOOP_PROMPTS, LOOP_TOKENS,
                                              answer_text, batch_verify_latency, draft_latency, engine_latency,
                                              greedy_savings, level_draft_ms, measure_batch_cost, measure_cost,
                                              measure_engine_cost, measure_greedy_cost, measure_loop,
                                              verify_latency)
from medusa_heads.inference.propose import MAX_NGRAM, lookup_match
from medusa_heads.prompting import conversation_ids, mask_runs
from medusa_heads.shards import segment_context
from medusa_heads.tree.adaptive import Acceptance, CostModel, LookupAcceptance, PhraseAcceptance, best_size
from medusa_heads.tree.calibrate import best_tree, tree_value
from medusa_heads.tree.ngrams import NgramStore

__all__ = [
    "ACCEPT_EDGES", "BATCH_CONTEXTS", "BATCH_ROWS", "BATCH_SIZES", "COST_CONTEXTS", "COST_SIZES", "LOOP_PROMPTS",
    "LOOP_TOKENS", "MIN_TRIALS",
    "NGRAM_TOKENS", "PARTS", "TEMPERATURES", "CandidateSamples", "answer_spans", "answer_text",
    "batch_verify_latency", "bin_rates", "brier", "calibrate_acceptance", "candidate_samples", "choose_tree",
    "correct_ranks", "draft_latency", "engine_latency", "fit_isotonic", "fit_temperature", "greedy_savings",
    "level_draft_ms", "log_loss", "lookup_acceptance", "measure_batch_cost", "measure_cost", "measure_engine_cost",
    "measure_greedy_cost", "measure_loop", "merge_adaptive", "ngram_acceptance", "ngram_trials", "second_half",
    "tokenized_answers", "verify_latency",
]

# what `medusa-heads calibrate --parts` measures
PARTS = ("tree", "acceptance", "lookup", "cost", "batch", "greedy", "ngrams", "loop")
NGRAM_TOKENS = 8  # phrasebook continuation length measured (and drafted: its acceptance's depth)
MIN_TRIALS = 100  # the fewest trials a matched length's rates are fitted on at a depth (else all lengths' rates)


@torch.no_grad()
def correct_ranks(heads, segments, topk: int = 10, chunk: int = 2048) -> list[tuple[int, ...]]:
    """For every answer position i, the rank of tokens[i + k] among head k's top-k at hidden[i] (-1 if absent).
    Conditioned heads see the true tokens[i .. i + k - 1]: on the path that is right, these are the very tokens
    they are given when drafting, so the ranks are exact for every path that matters.
    Positions whose continuation is shorter than the heads are left out."""
    k_heads = heads.config.num_heads
    out: list[tuple[int, ...]] = []
    dtype = heads.shared_weight.dtype if heads.lm_heads is None else heads.lm_heads[0].weight.dtype
    for s in segments:
        n = s.tokens.shape[0] - k_heads
        if n <= 0:
            continue
        for a in range(0, n, chunk):
            h = s.hidden[a : min(a + chunk, n)].to(dtype)
            context = segment_context(s.tokens, heads.config.context_size)[a : a + h.shape[0]]
            top = heads.topk(h, topk, context)  # (K, m, topk)
            idx = torch.arange(a, a + h.shape[0])
            truth = torch.stack([s.tokens[idx + k + 1] for k in range(k_heads)])  # (K, m)
            hit = top == truth[..., None]
            rank = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(truth, -1))  # (K, m)
            out += [tuple(r) for r in rank.T.tolist()]
    return out


def choose_tree(path_prob, latency: dict[int, float], t_heads, t_overhead: float, max_nodes: int) -> dict:
    """For each size N, the optimal tree (best_tree) and its predicted tokens/s; returns the best and the table.
    t_heads: the heads' drafting seconds, a number or a function of the tree."""
    table = []
    for n in range(1, max_nodes + 1):
        if n + 1 not in latency:
            continue
        spec = best_tree(path_prob, n) if path_prob else None
        if spec is None or spec.num_nodes < n:
            break
        tau = 1.0 + tree_value(spec, path_prob)
        draft = t_heads(spec) if callable(t_heads) else t_heads
        step = latency[n + 1] + draft + t_overhead
        table.append({"nodes": n, "tau": tau, "step_s": step, "draft_s": draft, "tokens_per_s": tau / step,
                      "paths": spec.to_list()})
    tau = torch.tensor([r["tau"] for r in table])
    best = table[best_size(tau, torch.tensor([1000.0 * r["step_s"] for r in table]))]  # a fixed tree drafts >= 1 node
    plain = 1.0 / latency[1]
    for row in table:
        row["speedup"] = row["tokens_per_s"] / plain
    return {"best": best, "table": table, "plain_tokens_per_s": plain}



def answer_spans(ids: torch.Tensor, mask: torch.Tensor, eos: int | None) -> list[tuple[int, int]]:
    """[start, end) of each assistant answer in a tokenized conversation, cut after its first `eos`."""
    spans = []
    for start, end in mask_runs(mask):
        stop = (ids[start:end] == eos).nonzero() if eos is not None else []
        spans.append((start, start + int(stop[0]) + 1 if len(stop) else end))
    return spans


def tokenized_answers(tokenizer, conversations: list[dict],
                      max_length: int = 1 << 16) -> list[tuple[torch.Tensor, list[tuple[int, int]]]]:
    """Chat-template token ids of each conversation and its answers' spans; an answer that was cut off (not
    "finished") loses the end-of-turn token the template adds, which the model never wrote."""
    out = []
    for conv in conversations:
        ids, mask = conversation_ids(tokenizer, conv["messages"], max_length)
        finished = [m.get("finished", True) for m in conv["messages"] if m["role"] == "assistant"]
        spans = answer_spans(ids, mask, tokenizer.eos_token_id)
        cut = [int(not done and int(ids[b - 1]) == tokenizer.eos_token_id) for (_, b), done in zip(spans, finished)]
        out.append((ids, [(a, b - c) for (a, b), c in zip(spans, cut)]))
    return out


def lookup_acceptance(conversations: list[tuple[torch.Tensor, list[tuple[int, int]]]], lookup_tokens: int = 10,
                      max_ngram: int = MAX_NGRAM, min_ngram: int = 1,
                      every_position: bool = False) -> tuple[LookupAcceptance, dict]:
    """conversations: (token ids (L,), answer spans). Walks each answer as decoding with prompt lookup alone would:
    at a root, lookup over the tokens up to it (inference.propose.lookup_match); the j-th continuation token is
    accepted if it and the ones before it equal the answer's next tokens; the next root follows the accepted ones
    (so roots fall where decoding steps start, often just after a miss). every_position: every answer token is a
    root (deep inside copied runs too, which decoding crosses in few steps). Rates per matched n-gram length and
    j, given j - 1 accepted."""
    ngrams = list(range(min_ngram, max_ngram + 1))
    tried = torch.zeros(len(ngrams), lookup_tokens, dtype=torch.long)
    hit = torch.zeros_like(tried)
    roots = 0
    for ids, spans in conversations:
        for start, end in spans:
            p = start
            while p < end - 1:
                roots += 1
                cont, n = lookup_match(ids[: p + 1], lookup_tokens, max_ngram, min_ngram)
                truth, accepted = ids[p + 1 : end], 0
                for j in range(min(len(cont), len(truth)) if n else 0):
                    tried[n - min_ngram, j] += 1
                    if cont[j] != truth[j]:
                        break
                    hit[n - min_ngram, j] += 1
                    accepted += 1
                p += 1 if every_position else accepted + 1
    if not roots:
        raise ValueError("no answer tokens to measure prompt lookup on")
    rates = []
    for i in range(len(ngrams)):
        row, last = [], 0.0
        for j in range(lookup_tokens):
            last = round(int(hit[i, j]) / int(tried[i, j]), 4) if tried[i, j] else last  # unseen: the rate above
            row.append(last)
        rates.append(tuple(row))
    report = {"roots": roots, "matched": tried[:, 0].tolist(), "tried": tried.tolist(), "accepted": hit.tolist(),
              "max_tokens": lookup_tokens, "max_ngram": max_ngram, "min_ngram": min_ngram,
              "walk": "every position" if every_position else "decoding steps"}
    return LookupAcceptance(tuple(ngrams), tuple(rates)), report


def ngram_trials(store: NgramStore, answers: list[tuple[torch.Tensor, list[tuple[int, int]]]],
                 tokens: int = NGRAM_TOKENS) -> tuple[list[list[tuple[int, float, bool]]], int]:
    """answers: (token ids (L,), answer spans) the store did not learn. Every answer token is a root: the store's
    chain from the tokens up to it (NgramStore.chain); its j-th token is accepted if it and the ones before it equal
    the answer's next tokens. Returns, per depth j, (matched n-gram length, confidence, accepted) of each token
    tried there (j - 1 accepted), and the number of roots."""
    out: list[list[tuple[int, float, bool]]] = [[] for _ in range(tokens)]
    roots = 0
    for ids, spans in answers:
        seq = ids.tolist()
        for start, end in spans:
            for p in range(start, end - 1):  # each answer token is a root, as in decoding (prefill writes the first)
                roots += 1
                found, conf, orders = store.chain(seq[max(p + 1 - store.max_n, 0) : p + 1], tokens)
                for j, (token, c, n) in enumerate(zip(found, conf, orders)):
                    if p + 1 + j >= end:
                        break
                    out[j].append((n, c, token == seq[p + 1 + j]))
                    if not out[j][-1][2]:
                        break
    return out, roots


def _fit_depths(trials: list[list[tuple[int, float, bool]]], edges: tuple[float, ...],
                fallback: Acceptance | None = None) -> Acceptance:
    """Isotonic rates over the confidence bins per depth; a depth with fewer than MIN_TRIALS trials takes the
    fallback's rates there (else the depth above)."""
    rates = []
    for j, t in enumerate(trials):
        if len(t) >= MIN_TRIALS or (fallback is None and t):
            rates.append(tuple(fit_isotonic(torch.tensor([c for _, c, _ in t]), torch.tensor([a for _, _, a in t]),
                                            edges)))
        else:
            rates.append(fallback.rates[j] if fallback is not None else rates[-1])
    return Acceptance(tuple(edges), tuple(rates))


def ngram_acceptance(store: NgramStore, answers: list[tuple[torch.Tensor, list[tuple[int, int]]]],
                     test: list[tuple[torch.Tensor, list[tuple[int, int]]]] | None = None,
                     tokens: int = NGRAM_TOKENS,
                     edges: tuple[float, ...] = ACCEPT_EDGES) -> tuple[PhraseAcceptance, dict]:
    """The store's acceptance per matched n-gram length and depth j (given j - 1 accepted), isotonic over its
    confidence bins, fitted on the chains of `answers` (ngram_trials); a length with too few trials at a depth reads
    all lengths' rates there. The report gives, per depth, what was tried and accepted, and predicted against
    observed acceptance on `test` (other held-out answers) where given, else on `answers` themselves."""
    trials, roots = ngram_trials(store, answers, tokens)
    if not trials[0]:
        raise ValueError("the n-gram store continues none of the held-out answers: nothing to measure")
    pooled = _fit_depths(trials, edges)
    orders = tuple(range(store.min_n, store.max_n + 1))
    tables = tuple(_fit_depths([[x for x in t if x[0] == n] for t in trials], edges, pooled) for n in orders)
    acceptance = PhraseAcceptance(orders, tables)
    t_trials, t_roots = ngram_trials(store, test, tokens) if test else (trials, roots)
    predicted = [sum(acceptance.rate(j + 1, n, c) for n, c, _ in t) / len(t) if t else 0.0
                 for j, t in enumerate(t_trials)]
    report = {"roots": roots, "entries": len(store), "min_n": store.min_n, "max_n": store.max_n,
              "tried": [len(t) for t in trials], "accepted": [sum(a for _, _, a in t) for t in trials],
              "first_by_order": {n: [sum(1 for m, _, _ in trials[0] if m == n),
                                     sum(a for m, _, a in trials[0] if m == n)]
                                 for n in orders},
              "test": {"answers": "other held-out answers" if test else "the same answers", "roots": t_roots,
                       "tried": [len(t) for t in t_trials],
                       "observed": [round(sum(a for _, _, a in t) / len(t), 4) if t else 0.0 for t in t_trials],
                       "predicted": [round(x, 4) for x in predicted]}}
    return acceptance, report


def merge_adaptive(adaptive: dict | None, acceptance: Acceptance | None = None, lookup: LookupAcceptance | None = None,
                   cost: tuple[str, CostModel] | None = None, ngrams: PhraseAcceptance | None = None,
                   machine: dict | None = None) -> dict:
    """config.adaptive with the parts given replaced; cost models are kept per kernels key, others left as they are.
    machine: the machine a new cost table was timed on (calibration/machine.py), kept beside it; without one, a
    replaced table keeps the record it had (its batch or greedy part measured again on that machine)."""
    out = dict(adaptive or {})
    if ngrams is not None:
        out["ngrams"] = ngrams.to_dict()
    if acceptance is not None:
        out["acceptance"] = acceptance.to_dict()
    if lookup is not None:
        out["lookup"] = lookup.to_dict()
    if cost is not None:
        record = machine if machine is not None else out.get("cost", {}).get(cost[0], {}).get("machine")
        out["cost"] = {**out.get("cost", {}), cost[0]: {**cost[1].to_dict(), **({"machine": record} if record else {})}}
    return out
