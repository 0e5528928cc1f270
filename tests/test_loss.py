from __future__ import annotations

import math

import torch

from medusa_heads.training.loss import IGNORE, SoftTargets, medusa_loss, teacher_topk, topk_hits
from medusa_heads.training.trainer import soft_batch


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


def test_soft_targets_mix_the_targets_distribution_into_each_heads_loss():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 6)  # 2 heads, 3 positions, draft vocabulary 6
    labels = torch.tensor([[1, 2], [3, IGNORE], [0, 4]])
    index = torch.tensor([[0, 1], [2, 3], [4, 5]])[:, None, :].expand(3, 2, 2)  # (N, K, m=2)
    prob = torch.tensor([[0.75, 0.25]]).expand(3, 2, 2)
    soft = SoftTargets(index, prob, labels != IGNORE)
    logp = logits.log_softmax(-1)
    want = 0.0
    for k, w in enumerate([1.0, 0.5]):
        rows = [r for r in range(3) if labels[r, k] != IGNORE]
        hard = -sum(float(logp[k, r, labels[r, k]]) for r in rows) / len(rows)
        soft_ce = -sum(0.75 * float(logp[k, r, index[r, k, 0]]) + 0.25 * float(logp[k, r, index[r, k, 1]]) for r in rows) / len(rows)
        want += w * (0.7 * hard + 0.3 * soft_ce)
    loss, metrics = medusa_loss(logits, labels, decay=0.5, soft=soft, soft_weight=0.3)
    assert math.isclose(float(loss), want, rel_tol=1e-5)
    assert math.isclose(metrics["ce_1"], float(medusa_loss(logits, labels, decay=0.5)[1]["ce_1"]), rel_tol=1e-6)  # reported CE stays hard
    # a one-hot soft target on the label is the hard loss again
    one_hot = SoftTargets(labels.clamp(min=0)[:, :, None], torch.ones(3, 2, 1), labels != IGNORE)
    assert math.isclose(float(medusa_loss(logits, labels, 0.5, one_hot, 1.0)[0]), float(medusa_loss(logits, labels, 0.5)[0]), rel_tol=1e-6)


def test_the_soft_target_of_head_k_is_the_teachers_distribution_k_rows_later():
    hidden = torch.randn(7, 4)
    weight = torch.randn(6, 4)
    index, prob = teacher_topk(hidden, weight, m=3, chunk=2)
    full = (hidden @ weight.T).softmax(-1)
    top = full.topk(3, dim=-1)
    assert torch.equal(index.long(), top.indices)
    assert torch.allclose(prob.float(), top.values / top.values.sum(-1, keepdim=True), atol=1e-3)  # renormalised over m
    targets = torch.tensor([[1, 1], [1, IGNORE]])  # rows 2 and 6 of the split, 2 heads
    soft = soft_batch((index, prob), torch.tensor([2, 6]), targets)
    assert torch.equal(soft.index[0, 0], index[3].long()) and torch.equal(soft.index[0, 1], index[4].long())
    assert torch.equal(soft.index[1, 0], index[6].long())  # row 6 + 1 is past the split: clamped, and...
    assert soft.valid.tolist() == [[True, True], [True, False]]  # ...only valid where the head has a target
