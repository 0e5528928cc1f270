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
