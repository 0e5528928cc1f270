"""A decoding plan per call: generate(..., tree=...) chooses the tree of one call and leaves the model as it was;
calls with different trees share one model from many threads; the drafter's observer sees what it drafted."""
from __future__ import annotations

import threading
import warnings

import pytest
import torch

from medusa_heads import MedusaModel
from medusa_heads.inference.adaptive import DraftObserver
from medusa_heads.engines.hf import pad_trees
from medusa_heads.inference.propose import Draft, HeadsDrafter
from medusa_heads.tree import TreeSpec
from medusa_heads.tree.buffers import build_buffers, chain, from_parents, with_chain

from conftest import randomize_heads, tiny_model
from test_adaptive import FLAT, calibrated


def _reference(base, ids, n):
    return base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)


@pytest.mark.parametrize("tree", ["plain", "chain-4", "cpu-16", [[0], [1], [0, 0]], "adaptive"])
def test_a_call_drafts_the_tree_it_names_and_leaves_the_models_default(tree):
    base = tiny_model("llama", seed=3)
    model = calibrated(base, FLAT, num_heads=4)
    model.set_tree("cpu-8")
    default = model.default_tree
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(1))
    res = model.generate(ids, max_new_tokens=30, tree=tree, prompt_lookup_num_tokens=0, return_dict_in_generate=True)
    assert torch.equal(res.sequences, _reference(base, ids, 30))
    sizes = set(res.stats.tree_sizes)
    if tree == "plain":
        assert sizes == {0} and res.stats.steps == 30  # one token a forward
    elif tree == "adaptive":
        assert max(sizes) > 8 or len(sizes) > 1  # chosen at each step, not the default's 8 nodes
    else:
        spec = TreeSpec.from_paths(tree) if isinstance(tree, list) else None
        assert sizes == {spec.num_nodes if spec else {"chain-4": 4, "cpu-16": 16}[tree]}
    assert model.default_tree is default and model.tree.num_nodes == 8  # nothing about the call stayed behind
    assert set(model.generate(ids, max_new_tokens=10, return_dict_in_generate=True, prompt_lookup_num_tokens=0)
               .stats.tree_sizes) == {8}


def test_plain_with_prompt_lookup_is_prompt_lookup_alone():
    base = tiny_model("llama", seed=4)
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None))
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])
    res = model.generate(ids, max_new_tokens=20, tree="plain", prompt_lookup_num_tokens=3, return_dict_in_generate=True)
    assert torch.equal(res.sequences, _reference(base, ids, 20))
    assert max(res.stats.tree_sizes) <= 3  # the lookup's chain alone, below the root


def test_a_tree_the_heads_cannot_draft_or_an_uncalibrated_adaptive_tree_is_refused_per_call():
    model = MedusaModel.from_pretrained(tiny_model(), heads=None, num_heads=2)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="adaptive.*calibrate"):
        model.generate(ids, max_new_tokens=4, tree="adaptive")
    with pytest.raises(ValueError):
        model.generate(ids, max_new_tokens=4, tree="chain-4")  # 4 deep, 2 heads
    assert torch.equal(model.generate(ids, max_new_tokens=4, tree="plain"), _reference(model.base_model, ids, 4))
    with pytest.raises(ValueError, match='tree="plain" drafts nothing'):  # the drafter would be dropped unseen
        model.generate(ids, max_new_tokens=4, tree="plain", drafter=HeadsDrafter(model.heads))


def test_threads_with_different_trees_on_one_model_each_get_the_targets_output():
    base = tiny_model("qwen2", seed=6)
    model = calibrated(base, FLAT, num_heads=4)
    prompts = [torch.randint(0, 96, (1, 6 + i % 3), generator=torch.Generator().manual_seed(i)) for i in range(8)]
    want = [_reference(base, p, 24) for p in prompts]
    trees = ["plain", "chain-4", "adaptive", "cpu-16"]
    got, errors = [None] * 8, []

    def work(i):
        try:
            res = model.generate(prompts[i], max_new_tokens=24, tree=trees[i % 4], return_dict_in_generate=True)
            got[i] = (res.sequences, set(res.stats.tree_sizes))
        except Exception as e:  # noqa: BLE001  reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors
    for i, (seq, sizes) in enumerate(got):
        assert torch.equal(seq, want[i])
        if trees[i % 4] == "plain":
            assert sizes == {0}
        if trees[i % 4] == "chain-4":
            assert sizes <= {4, 5, 6, 7, 8}  # chain-4 plus the heads' lookup chain, never another thread's tree


def test_a_batch_takes_its_tree_per_call_too():
    base = tiny_model("llama", seed=8)
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, num_heads=4))
    ids = torch.randint(3, 96, (3, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    ref = base.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    for tree in ("plain", "chain-4"):
        res = model.generate(ids, attention_mask=mask, max_new_tokens=16, pad_token_id=0, tree=tree,
                             return_dict_in_generate=True)
        assert torch.equal(res.sequences, ref)
        assert set(res.stats.tree_sizes) == ({0} if tree == "plain" else {4})


class Seen(DraftObserver):
    def __init__(self):
        self.kept, self.trials, self.accepted = [], [], []

    def drafted(self, sequence, candidates, kept):
        assert kept <= len(candidates.order) and all(candidates.par[i] < i for i in range(1, len(candidates.tok)))
        self.kept.append(kept)

    def verified(self, accepted, trials):
        self.accepted.append(accepted)
        self.trials += trials


def test_the_drafters_observer_sees_every_step_kept_tree_and_trial():
    base = tiny_model("llama", seed=3)
    model = calibrated(base, FLAT, num_heads=4)
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(1))
    seen = Seen()
    drafter = model.adaptive_drafter(0, observer=seen)
    res = model.generate(ids, max_new_tokens=30, drafter=drafter, prompt_lookup_num_tokens=0,
                         return_dict_in_generate=True)
    assert torch.equal(res.sequences, _reference(base, ids, 30))
    assert seen.kept == res.stats.tree_sizes  # one event per step, the tree the verify saw
    assert sum(len(a) - 1 for a in seen.accepted) >= sum(res.stats.tokens_per_step[1:]) - len(seen.accepted)
    hits = sum(hit for *_, hit in seen.trials)
    assert hits == sum(len(a) - 1 for a in seen.accepted)  # every accepted drafted node is one hit


def test_every_tree_buffer_comes_from_the_one_builder():
    spec = TreeSpec.from_paths([[0], [1], [0, 0], [0, 1]])
    built = build_buffers(spec)
    same = from_parents(tuple(built.parent.tolist()))
    assert torch.equal(built.mask, same.mask) and torch.equal(built.depth, same.depth)
    grown = with_chain(built, 3, 2)
    assert grown.parent.tolist() == [-1, 0, 0, 1, 1, 3, 5] and torch.equal(grown.draft_index, built.draft_index)
    assert torch.equal(chain(4).mask, torch.ones(4, 4, dtype=torch.bool).tril())
    # a batch pads each row's tree with children of its root that see only the root and themselves
    drafts = [Draft(torch.tensor([7, 8]), chain(3)), Draft(torch.tensor([9]), chain(2))]
    tokens, masks, depths = pad_trees(drafts, [torch.tensor(1), torch.tensor(2)])
    assert tokens.tolist() == [[1, 7, 8], [2, 9, 2]] and depths.tolist() == [[0, 1, 2], [0, 1, 1]]
    assert masks[1].tolist() == [[True, False, False], [True, True, False], [True, False, True]]


def test_no_length_set_generates_what_transformers_generates_with_its_warning():
    base = tiny_model("llama", seed=2)
    model = MedusaModel.from_pretrained(base, heads=None)
    ids = torch.randint(3, 96, (1, 31), generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="max_length"):
        want = base.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False)
    with pytest.warns(UserWarning, match="max_length"):
        got = model.generate(ids)
    assert torch.equal(got, want) and got.shape[1] == 51
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(ids, max_new_tokens=0)
    with pytest.raises(ValueError, match="max_length is 20.*max_new_tokens"):
        model.generate(ids, max_length=20)


def test_from_pretrained_says_when_no_trained_heads_fit_the_model():
    base = tiny_model("llama", seed=2)
    with pytest.warns(UserWarning, match="untrained heads"):
        MedusaModel.from_pretrained(base)  # heads="auto": the shipped heads are for another model
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MedusaModel.from_pretrained(base, heads=None)  # new heads asked for: no warning
