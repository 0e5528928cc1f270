#!/usr/bin/env python
"""Fits a score of the drafter's candidates (acceptance given an accepted parent) on candidates recorded by
scripts/tree_replay.py --record, a logistic regression per depth over the recorded features, and scores it on
another recording against the stored calibration (log loss, and how often the accepted child ranks first).

    python experiments/fit_score.py --fit fit.safetensors --test test.safetensors --score score.json --out results/x/score.md"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
import json

import torch
from safetensors import safe_open

from medusa_heads.calibration.measure import log_loss
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from common import emit  # noqa: E402  scripts/common.py


def fit_logistic(x: torch.Tensor, y: torch.Tensor, l2: float) -> torch.Tensor:
    """(N, F), (N,) -> (F + 1,) weights (bias first) minimising mean log loss + l2 |w|^2 / 2."""
    w = torch.zeros(x.shape[1] + 1, dtype=torch.float64, requires_grad=True)
    x, y = x.double(), y.double()
    opt = torch.optim.LBFGS([w], max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        z = x @ w[1:] + w[0]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(z, y) + l2 * (w[1:] ** 2).sum() / 2
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach()


def read(path: str) -> dict:
    """A recording of scripts/tree_replay.py --record: features (N, 1 + F), depth first; labels (N,); names."""
    with safe_open(path, "pt") as f:
        return {"features": f.get_tensor("features"), "labels": f.get_tensor("labels"),
                "names": json.loads(f.metadata()["names"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fit", required=True)
    p.add_argument("--test", required=True)
    p.add_argument("--score", required=True, help="JSON to write the fitted score to")
    p.add_argument("--drop", default="", help="comma-separated feature names to leave out")
    p.add_argument("--l2", type=float, default=1e-3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    fit, test = read(args.fit), read(args.test)
    names = fit["names"][1:]
    use = torch.tensor([n not in args.drop.split(",") for n in names])
    x = fit["features"][:, 1:]
    mean, std = x.mean(0), x.std(0).clamp_min(1e-6)
    mean[~use], std[~use] = 0.0, 1.0
    depth = fit["features"][:, 0].long()
    weights = []
    lines = [f"Candidates' acceptance given an accepted parent: stored calibration against a logistic score over "
             f"{', '.join(n for n, u in zip(names, use) if u)}; fitted on {len(x)} candidates, scored on "
             f"{len(test['labels'])} others.", "",
             "| depth | candidates | observed | log loss, stored | log loss, score | mean rate, stored | mean rate, score |",
             "|---|---|---|---|---|---|---|"]
    tx, td, ty = test["features"][:, 1:], test["features"][:, 0].long(), test["labels"].bool()
    for d in range(1, int(depth.max()) + 1):
        rows = depth == d
        z = ((x[rows] - mean) / std)[:, use]
        w = fit_logistic(z, fit["labels"][rows].double(), args.l2)
        full = torch.zeros(len(names) + 1, dtype=torch.float64)
        full[0], full[1:][use] = w[0], w[1:]
        weights.append(full.tolist())
        t = td == d
        if not t.any():
            continue
        zt = (tx[t] - mean) / std
        pred = torch.sigmoid(zt.double() @ full[1:] + full[0])
        stored = torch.sigmoid(tx[t][:, names.index("logit calibrated")].double())
        lines.append(f"| {d} | {int(t.sum())} | {float(ty[t].double().mean()):.3f} | {log_loss(stored, ty[t]):.4f} | "
                     f"{log_loss(pred, ty[t]):.4f} | {float(stored.mean()):.3f} | {float(pred.mean()):.3f} |")
    json.dump({"names": names, "mean": mean.tolist(), "std": std.tolist(), "weights": weights}, open(args.score, "w"))
    emit(lines, args.out)


if __name__ == "__main__":
    main()
