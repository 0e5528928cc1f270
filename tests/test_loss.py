from __future__ import annotations

import math

import torch

from medusa_heads.training.loss import IGNORE, medusa_loss, topk_hits


def test_accuracy_on_hand_made_logits():
    # 2 heads, 3 positions, vocabulary 6
    logits = torch.tensor([
        [[9, 8, 7, 6, 5, 0], [0, 9, 1, 2, 3, 4], [5, 4, 3, 2, 1, 9]],
        [[0, 1, 2, 3, 4, 9], [9, 0, 0, 0, 0, 0], [1, 2, 9, 3, 0, 0]],
    ], dtype=torch.float)
    targets = torch.tensor([[0, 5], [4, 3], [IGNORE, -1]])  # (N, K)
    hits, counted = topk_hits(logits, targets, ks=(1, 5))
    # head 1: pos0 top1 hit; pos1 target 4 is rank 2 (top5 hit); pos2 ignored
    # head 2: pos0 top1 hit; pos1 target 3: ties with 1,2,4,5 -> inside top5; pos2 target outside vocab: miss
    assert counted.tolist() == [2, 3]
    assert hits[0].tolist() == [1, 2]
    assert hits[1].tolist() == [1, 2]


def test_loss_weights_heads_by_decay():
    logits = torch.zeros(3, 4, 10)
    labels = torch.zeros(4, 3, dtype=torch.long)
    loss, metrics = medusa_loss(logits, labels, decay=0.5)
    assert math.isclose(float(loss), math.log(10) * (1 + 0.5 + 0.25), rel_tol=1e-6)
    assert math.isclose(metrics["ce_2"], math.log(10), rel_tol=1e-6)
    labels[:, 2] = IGNORE  # a head with no targets adds nothing
    loss, _ = medusa_loss(logits, labels, decay=0.5)
    assert math.isclose(float(loss), math.log(10) * 1.5, rel_tol=1e-6)
