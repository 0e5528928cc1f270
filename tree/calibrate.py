"""Choose a tree from the heads' rank accuracies."""
from __future__ import annotations

from medusa_heads.tree.spec import TreeSpec


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
