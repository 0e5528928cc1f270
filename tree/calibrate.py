"""Choose a tree from the heads' rank accuracies."""
from __future__ import annotations

import heapq

from .spec import TreeSpec


def expected_accepted(spec: TreeSpec, rank_acc: list[list[float]]) -> float:
    """Expected drafted tokens accepted per step when rank r of head k is right with probability rank_acc[k][r],
    independently per level: the sum over nodes of the probability that the whole path to the node is right."""
    total = 0.0
    for path in spec.paths:
        p = 1.0
        for k, r in enumerate(path):
            p *= rank_acc[k][r] if r < len(rank_acc[k]) else 0.0
        total += p
    return total


def greedy_tree(rank_acc: list[list[float]], num_nodes: int) -> TreeSpec:
    """The tree of num_nodes nodes that maximises expected_accepted.

    A node's value is its path probability, which never exceeds its parent's, so adding nodes in order of
    value (a best-first frontier) keeps the tree prefix-closed, and the sum of the num_nodes largest
    path probabilities over all prefix-closed sets is reached: the greedy expansion is optimal here."""
    frontier: list[tuple[float, tuple[int, ...]]] = [(-rank_acc[0][0], (0,))]
    chosen: list[tuple[int, ...]] = []
    while frontier and len(chosen) < num_nodes:
        neg_p, path = heapq.heappop(frontier)
        chosen.append(path)
        p = -neg_p
        k, r = len(path) - 1, path[-1]
        if r + 1 < len(rank_acc[k]):  # next sibling
            q = p / rank_acc[k][r] * rank_acc[k][r + 1] if rank_acc[k][r] > 0 else 0.0
            heapq.heappush(frontier, (-q, path[:-1] + (r + 1,)))
        if k + 1 < len(rank_acc):  # first child
            heapq.heappush(frontier, (-p * rank_acc[k + 1][0], path + (0,)))
    return TreeSpec.from_paths(chosen)


def rank_paths(correct_ranks: list[tuple[int, ...]]) -> dict[tuple[int, ...], float]:
    """Empirical probability that each rank path is entirely right, from per-position rank vectors.

    correct_ranks[i][k] is the rank of the true token among head k+1's guesses at position i (-1: not in its
    top-k). A path (r1..rd) is right at position i iff correct_ranks[i][:d] == (r1..rd): each position makes
    exactly one path right at each depth up to its first miss. Measured jointly, with no independence assumed."""
    counts: dict[tuple[int, ...], int] = {}
    for ranks in correct_ranks:
        for d in range(len(ranks)):
            if ranks[d] < 0:
                break
            key = tuple(ranks[: d + 1])
            counts[key] = counts.get(key, 0) + 1
    n = max(len(correct_ranks), 1)
    return {path: c / n for path, c in counts.items()}


def best_tree(path_prob: dict[tuple[int, ...], float], num_nodes: int) -> TreeSpec:
    """The num_nodes paths of highest probability. A path is right only if its parent is, so P(child) <= P(parent):
    taking paths in order of probability (parents first on ties) keeps the set prefix-closed, and no other set
    of that size has a larger sum, i.e. a larger expected number of accepted tokens. Optimal, not a heuristic."""
    ranked = sorted(path_prob, key=lambda p: (-path_prob[p], len(p), p))[:num_nodes]
    return TreeSpec.from_paths(ranked)


def tree_value(spec: TreeSpec, path_prob: dict[tuple[int, ...], float]) -> float:
    """Expected accepted drafted tokens per step (greedy), from measured path probabilities."""
    return sum(path_prob.get(p, 0.0) for p in spec.paths)
