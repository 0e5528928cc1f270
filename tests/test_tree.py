"""Tree specs validate themselves; buffers are right for hand-checked trees."""
from __future__ import annotations

import pytest
import torch

from medusa_heads.tree import TreeSpec, build_buffers, list_presets, load_tree
from medusa_heads.tree.calibrate import best_tree, rank_paths, tree_value


def test_buffers_of_a_small_tree():
    #        root
    #       /    \
    #   [0]       [1]
    #   /  \        \
    # [0,0] [0,1]   [1,0]
    b = build_buffers(TreeSpec.from_paths([[1, 0], [0], [0, 1], [1], [0, 0]]))  # any order in, sorted out
    assert b.size == 6 and b.topk == 2 and b.num_heads == 2
    assert b.depth.tolist() == [0, 1, 1, 2, 2, 2]
    assert b.parent.tolist() == [-1, 0, 0, 1, 1, 2]
    assert b.children == ((1, 2), (3, 4), (5,), (), (), ())
    assert b.draft_index.tolist() == [0, 1, 2, 3, 2]  # (depth-1)*topk + rank
    want = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(b.mask, want)
    assert b.paths.tolist() == [[0, 1, 3], [0, 1, 4], [0, 2, 5]]
    assert b.path_len.tolist() == [3, 3, 3]


def test_paths_of_unequal_length_are_padded_with_the_leaf():
    b = build_buffers(TreeSpec.from_paths([[0], [1], [0, 0], [0, 0, 0]]))
    assert b.paths.tolist() == [[0, 2, 2, 2], [0, 1, 3, 4]]
    assert b.path_len.tolist() == [2, 4]


def test_chain_mask_is_causal():
    b = build_buffers(load_tree("chain-4"))
    assert torch.equal(b.mask, torch.ones(5, 5, dtype=torch.bool).tril())


@pytest.mark.parametrize(
    "paths, message",
    [
        ([], "empty"),
        ([[0], [0, 2, 1]], r"\[0, 2, 1\] has no parent: its prefix \[0, 2\] is missing"),
        ([[0], [1, 0]], r"\[1, 0\] has no parent"),
        ([[0], [0, 0, 0]], r"\[0, 0, 0\] has no parent"),
        ([[0], [0]], r"\[0\] appears twice"),
        ([[0], [-1]], r"\[-1\] has a rank"),
        ([[0], []], r"\[\] is empty"),
        ([[0], [1.5]], r"\[1.5\] has a rank"),
        ("cpu-16x", "unknown tree preset"),
        ([[0], "01"], "not a list of ranks"),
    ],
)
def test_invalid_specs_name_the_bad_path(paths, message):
    with pytest.raises(ValueError, match=message):
        load_tree(paths)


def test_tree_deeper_than_the_heads_is_refused():
    with pytest.raises(ValueError, match=r"\[0, 0, 0\] has depth 3 but there are only 2 heads"):
        TreeSpec.from_paths([[0], [0, 0], [0, 0, 0]]).check_heads(2)


def test_presets_load_and_are_valid():
    names = list_presets()
    assert {"chain-4", "cpu-8", "cpu-16", "cpu-32", "gpu-64"} <= set(names)
    for name in names:
        spec = load_tree(name)
        spec.check_heads(4)
        assert build_buffers(spec).size == spec.num_nodes + 1
    assert load_tree("cpu-16").num_nodes == 16 and load_tree("gpu-64").num_nodes == 64


def test_best_tree_is_optimal_against_brute_force():
    """On measured (joint, not independent) path probabilities, best_tree beats every prefix-closed tree of its size."""
    import itertools
    import random

    rng = random.Random(0)
    ranks = [tuple(rng.choice([0, 0, 0, 1, 2, -1]) for _ in range(3)) for _ in range(400)]
    path_prob = rank_paths(ranks)
    all_paths = [(a,) for a in range(3)] + [(a, b) for a in range(3) for b in range(3)] + [(a, b, c) for a in range(2) for b in range(2) for c in range(2)]
    for n in (1, 3, 5, 7):
        best = 0.0
        for subset in itertools.combinations(all_paths, n):
            try:
                best = max(best, tree_value(TreeSpec(tuple(subset)), path_prob))
            except ValueError:
                continue  # not prefix-closed
        assert tree_value(best_tree(path_prob, n), path_prob) == pytest.approx(best)