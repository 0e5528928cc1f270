"""The heads' calibrated acceptance (tree/adaptive.py: Acceptance): each head's top-k candidates at held-out answer
positions where its parent would be accepted, fitted per depth as isotonic bins of the head's probability or as a
temperature, the two scored on the other half of the conversations."""
from __future__ import annotations

import zlib
from dataclasses import dataclass, fields

import torch

from medusa_heads.corpus import prompt_id
from medusa_heads.shards import segment_context
from medusa_heads.tree.adaptive import Acceptance, isotonic

ACCEPT_EDGES = (0.0, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
TEMPERATURES = tuple(float(t) for t in torch.logspace(-0.4, 0.6, 33, base=10.0))  # 0.40 .. 3.98, 7.5% apart


@dataclass
class CandidateSamples:
    """Head d's top-k candidates at the held-out positions where its parent could be accepted, for one depth."""

    probs: torch.Tensor  # (M, k) softmax over the draft vocabulary
    hits: torch.Tensor  # (M, k) bool: the candidate is the true token at that depth
    logits: torch.Tensor  # (M, k) the candidates' logits
    lse: torch.Tensor  # (M, G) logsumexp(logits / T) over the draft vocabulary, for each T in TEMPERATURES
    half: torch.Tensor  # (M,) bool: the position's conversation falls in the second half (the test half)

    def select(self, rows: torch.Tensor) -> "CandidateSamples":
        return CandidateSamples(*(getattr(self, f.name)[rows] for f in fields(self)))

    def temperature_probs(self, t: int) -> torch.Tensor:
        """(M, k) the candidates' probabilities at TEMPERATURES[t]."""
        return (self.logits / TEMPERATURES[t] - self.lse[:, t : t + 1]).exp()


def second_half(conv_id: str) -> bool:
    """Splits held-out conversations in two by prompt (every answer to a prompt falls on the same side)."""
    return zlib.crc32(f"{prompt_id(conv_id)}#half".encode()) % 2 == 1


@torch.no_grad()
def candidate_samples(heads, segments, topk: int = 8, chunk: int = 1024) -> list[CandidateSamples]:
    """For each depth d = 1..K: head d's top-k at every answer position, path-conditioned heads given the true path
    above (what they are given on the path that is right), labelled by the true token at depth d. A position counts
    at depth d only where the true tokens at depths 1..d-1 are each in their head's top-k: there the parent is in
    the tree and accepted, so the labels are acceptance given an accepted parent."""
    k_heads = heads.config.num_heads
    param = next(heads.parameters())
    temps = torch.tensor(TEMPERATURES)
    out: list[dict[str, list[torch.Tensor]]] = [{f.name: [] for f in fields(CandidateSamples)} for _ in range(k_heads)]
    for s in segments:
        n = s.tokens.shape[0] - k_heads
        for a in range(0, max(n, 0), chunk):
            h = s.hidden[a : min(a + chunk, n)].to(param.device, param.dtype)
            m = h.shape[0]
            context = segment_context(s.tokens, heads.config.context_size)[a : a + m].to(param.device)
            idx = torch.arange(a, a + m)
            parent_in_tree = torch.ones(m, dtype=torch.bool)
            for k in range(k_heads):
                logits = heads.head_logits(k, h, context).float().cpu()  # (m, V')
                top = logits.topk(topk, dim=-1)
                ids = top.indices if heads.draft_vocab is None else heads.draft_vocab.cpu()[top.indices]
                hits = ids == s.tokens[idx + k + 1][:, None]  # (m, topk)
                lse = torch.stack([torch.logsumexp(logits / t, dim=-1) for t in temps], dim=-1)  # (m, G)
                rows = parent_in_tree.nonzero()[:, 0]
                d = out[k]
                d["probs"].append((top.values - torch.logsumexp(logits, -1, keepdim=True)).exp()[rows])
                d["hits"].append(hits[rows])
                d["logits"].append(top.values[rows])
                d["lse"].append(lse[rows])
                d["half"].append(torch.full((len(rows),), second_half(s.conv_id)))
                parent_in_tree &= hits.any(-1)
    if not out[0]["hits"]:
        raise ValueError(f"no held-out answer has more than {k_heads} tokens: nothing to calibrate acceptance on")
    return [CandidateSamples(**{key: torch.cat(v) for key, v in d.items()}) for d in out]


def bin_rates(probs: torch.Tensor, hits: torch.Tensor,
              edges: tuple[float, ...] = ACCEPT_EDGES) -> tuple[list[float], list[int]]:
    """Observed acceptance and count in each bin of the probability (bins as Acceptance reads them)."""
    b = torch.bucketize(probs.flatten().double(), torch.tensor(edges[1:-1], dtype=torch.float64), right=True)
    count = torch.bincount(b, minlength=len(edges) - 1)
    hit = torch.bincount(b, weights=hits.flatten().double(), minlength=len(edges) - 1)
    return [float(h / c) if c else 0.0 for h, c in zip(hit, count)], count.tolist()


def fit_isotonic(probs: torch.Tensor, hits: torch.Tensor, edges: tuple[float, ...] = ACCEPT_EDGES) -> list[float]:
    """Per-bin acceptance, non-decreasing in the head's probability: pool adjacent violators over the bins'
    observed rates weighted by their counts; an empty bin takes the rate of the bin below it (leading ones, above)."""
    rates, counts = bin_rates(probs, hits, edges)
    full = [i for i, c in enumerate(counts) if c]
    if not full:
        raise ValueError("no candidates to fit acceptance on")
    fit = dict(zip(full, isotonic([rates[i] for i in full], [float(counts[i]) for i in full])))
    out, last = [], fit[full[0]]
    for i in range(len(counts)):
        last = fit.get(i, last)
        out.append(round(min(max(last, 0.0), 1.0), 4))
    return out


def log_loss(pred: torch.Tensor, hits: torch.Tensor, eps: float = 1e-4) -> float:
    p = pred.double().clamp(eps, 1 - eps)
    return float(-(hits * p.log() + (~hits) * (1 - p).log()).mean())


def brier(pred: torch.Tensor, hits: torch.Tensor) -> float:
    return float(((pred.double() - hits.double()) ** 2).mean())


def fit_temperature(s: CandidateSamples) -> int:
    """Index into TEMPERATURES of the temperature whose candidate probabilities have the least log-loss."""
    return min(range(len(TEMPERATURES)), key=lambda t: log_loss(s.temperature_probs(t), s.hits))


def calibrate_acceptance(samples: list[CandidateSamples], edges: tuple[float, ...] = ACCEPT_EDGES,
                         tolerance: float = 0.01) -> tuple[Acceptance, dict]:
    """Isotonic bins and a temperature per depth, each fitted on the first half of the conversations and scored on
    the second (log-loss, Brier, mean predicted vs observed); the winner is refitted on both halves. Isotonic is
    kept unless the temperature's log-loss is lower by more than `tolerance` (relative); the stored format holds
    bins only, so a winning temperature is stored as bins of its own predictions (a check, not expected)."""
    rows, totals = [], {m: [0.0, 0.0] for m in ("raw", "isotonic", "temperature")}
    for d, s in enumerate(samples, start=1):
        fit, test = s.select(~s.half), s.select(s.half)
        if not len(fit.hits) or not len(test.hits):
            raise ValueError(f"depth {d}: no held-out candidates in one half of the conversations "
                             f"({len(fit.hits)} and {len(test.hits)} positions); more held-out features are needed")
        rates = torch.tensor(fit_isotonic(fit.probs, fit.hits, edges))
        t = fit_temperature(fit)
        preds = {"raw": test.probs, "isotonic": Acceptance(edges, (tuple(rates.tolist()),))(1, test.probs),
                 "temperature": test.temperature_probs(t)}
        row = {"depth": d, "fit_positions": len(fit.hits), "test_positions": len(test.hits), "topk": s.hits.shape[1],
               "observed": float(test.hits.double().mean()), "observed_top1": float(test.hits[:, 0].double().mean()),
               "T": TEMPERATURES[t], "isotonic_fit": rates.tolist()}
        for name, p in preds.items():
            row[name] = {"mean": float(p.double().mean()), "mean_top1": float(p[:, 0].double().mean()),
                         "log_loss": log_loss(p, test.hits), "brier": brier(p, test.hits),
                         "reliability": _reliability(p, test.hits, edges)}
            totals[name][0] += row[name]["log_loss"] * test.hits.numel()
            totals[name][1] += row[name]["brier"] * test.hits.numel()
        rows.append(row)
    n = sum(r["test_positions"] * r["topk"] for r in rows)
    summary = {m: {"log_loss": v[0] / n, "brier": v[1] / n} for m, v in totals.items()}
    iso, temp = summary["isotonic"]["log_loss"], summary["temperature"]["log_loss"]
    method = "temperature" if temp < iso * (1 - tolerance) else "isotonic"
    final = []
    for s, row in zip(samples, rows):
        if method == "isotonic":
            final.append(tuple(fit_isotonic(s.probs, s.hits, edges)))
        else:  # bins of the raw probability whose rates are the temperature's mean prediction in the bin
            pred = s.temperature_probs(fit_temperature(s))
            b = torch.bucketize(s.probs.flatten().double(), torch.tensor(edges[1:-1], dtype=torch.float64), right=True)
            mean = torch.bincount(b, weights=pred.flatten().double(), minlength=len(edges) - 1)
            count = torch.bincount(b, minlength=len(edges) - 1).clamp_min(1)
            final.append(tuple(round(x, 4) for x in torch.cummax(mean / count, 0).values.clamp(0, 1).tolist()))
    report = {"method": method, "edges": list(edges), "depths": rows, "summary": summary,
              "held_out_positions": [len(s.hits) for s in samples]}
    return Acceptance(tuple(edges), tuple(final)), report


def _reliability(pred: torch.Tensor, hits: torch.Tensor, edges: tuple[float, ...]) -> list[list[float]]:
    """[mean prediction, observed rate, count] for each non-empty bin of the prediction."""
    b = torch.bucketize(pred.flatten().double(), torch.tensor(edges[1:-1], dtype=torch.float64), right=True)
    count = torch.bincount(b, minlength=len(edges) - 1)
    mean = torch.bincount(b, weights=pred.flatten().double(), minlength=len(edges) - 1)
    hit = torch.bincount(b, weights=hits.flatten().double(), minlength=len(edges) - 1)
    return [[float(m / c), float(h / c), int(c)] for m, h, c in zip(mean, hit, count) if c]
