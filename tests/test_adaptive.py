"""Trees chosen at each step: the selection, and output that stays exactly the target's."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from transformers import AutoTokenizer

from medusa_heads import MedusaModel, default_model_path, prompt_ids
from medusa_heads.inference.adaptive import PRIOR, AdaptiveDrafter, Candidates, Correction, DraftGate
from medusa_heads.kernels.exact_attention import uses_exact_attention
from medusa_heads.kernels.prepack import bf16_supported, is_prepacked
from medusa_heads.inference.propose import Draft, RowDrafter
from medusa_heads.machine import cost_key, find_cost, hardware, kernels_key
from medusa_heads.tree.adaptive import Acceptance, CostModel, LookupAcceptance, best_size, expected_tokens, isotonic
from medusa_heads.tree.buffers import build_buffers, from_parents
from medusa_heads.tree.spec import TreeSpec

from conftest import assert_diverges_only_at_a_near_tie, randomize_heads, tiny_model
from test_sampling import DRAWS, SETTINGS, TREE, exact_joint, p_value, sample_counts

EDGES = (0.0, 0.1, 0.3, 0.6, 1.0)
FLAT = CostModel(contexts=(0,), sizes=(1, 2, 32), ms=((10.0, 10.0, 12.0),), draft_ms=0.1)  # trees nearly free
STEEP = CostModel(contexts=(0,), sizes=(1, 2, 32), ms=((10.0, 30.0, 500.0),), draft_ms=0.1)  # a node costs 2 steps


def calibrated(base, cost: CostModel, rates=(0.2, 0.5, 0.8, 0.95), num_heads: int = 3, std: float = 0.3, **kw) -> MedusaModel:
    """Random path-conditioned heads with a hand-made calibration and cost model for this base's kernels."""
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, num_heads=num_heads, condition="path", **kw), std=std)
    model.config.adaptive = {
        "acceptance": Acceptance(EDGES, (rates,) * num_heads).to_dict(),
        "lookup": LookupAcceptance((1, 2, 3), ((0.3,), (0.6,), (0.8, 0.9))).to_dict(),
        "cost": {kernels_key(base, prepacked=False): cost.to_dict()},
    }
    model.set_tree("adaptive")
    return model


def test_the_most_valuable_nodes_per_millisecond_win_and_none_is_a_plain_step():
    step = torch.tensor([10.0, 10.0, 10.0, 10.0, 40.0])  # ms with 1..5 tree tokens
    assert best_size(expected_tokens(torch.tensor([0.9, 0.8, 0.1, 0.05]), 5), step) == 3  # 2.8 / 10 beats 2.7 / 10 and 2.85 / 40
    assert best_size(expected_tokens(torch.tensor([0.9, 0.8, 0.1, 0.05]), 5), torch.tensor([10.0, 10.0, 10.0, 20.0, 40.0])) == 2
    assert best_size(expected_tokens(torch.tensor([0.01, 0.01]), 3), torch.tensor([10.0, 11.0, 12.0])) == 0  # 1/10 > 1.01/11
    assert best_size(expected_tokens(torch.tensor([]), 5), step) == 0
    assert isotonic([0.1, 0.3, 0.2, 0.5], [1, 1, 1, 2]) == pytest.approx([0.1, 0.25, 0.25, 0.5])


def test_the_cost_model_interpolates_sizes_and_contexts():
    cost = CostModel(contexts=(256, 1024), sizes=(1, 3), ms=((10.0, 14.0), (20.0, 30.0)))
    assert cost.verify_ms(256).tolist() == pytest.approx([10, 12, 14])
    assert cost.verify_ms(640).tolist() == pytest.approx([15, 18.5, 22])
    assert cost.verify_ms(0)[0] == pytest.approx(10)  # below the measured contexts: the first row
    assert cost.verify_ms(1792)[0] == pytest.approx(30)  # above: extrapolated
    assert CostModel.from_dict(cost.to_dict()) == cost
    noisy = CostModel(contexts=(0,), sizes=(1, 2, 3, 4), ms=((10.0, 14.0, 12.0, 16.0),), fit="line")
    assert noisy.verify_ms(0).tolist() == pytest.approx([10, 13, 14, 15])  # a line through the trees: none looks free
    assert CostModel.from_dict({k: v for k, v in noisy.to_dict().items() if k != "fit"}) == noisy  # older configs
    with pytest.raises(ValueError, match="fit must be one of"):
        CostModel(contexts=(0,), sizes=(1,), ms=((1.0,),), fit="spline")
    with pytest.raises(ValueError, match="sizes must increase from 1"):
        CostModel(contexts=(1,), sizes=(2, 4), ms=((1.0, 2.0),))
    with pytest.raises(ValueError, match="rise from 0 to 1"):
        Acceptance((0.0, 0.5), ((0.1,),))


def test_the_steps_fit_keeps_the_kernels_row_blocks_and_smooths_noise_into_no_free_tree():
    # as measured for SmolLM2 on AVX2 (256 cached tokens): flat to 6 tokens, a jump at 7, a noisy dip at 6
    ms = (44.3, 49.0, 44.0, 42.8, 42.1, 45.0, 51.0, 49.7, 49.9, 51.2, 52.8, 55.3, 61.9)
    cost = CostModel(contexts=(300,), sizes=(*range(1, 13), 16), ms=(ms,))
    fit = cost.verify_ms(300)
    assert (fit.diff() >= 0).all()  # never does a larger tree look cheaper
    assert fit[:6].tolist() == pytest.approx([44.3, *[(49.0 + 44.0 + 42.8 + 42.1) / 4] * 4, 45.0])  # 1..6: a plain step
    assert fit[6] - fit[5] > 4.0  # the seventh row's block is charged
    assert fit[12:].tolist() == pytest.approx([55.3 + (61.9 - 55.3) * i / 4 for i in range(1, 5)])  # interpolated
    line = CostModel(contexts=(300,), sizes=(*range(1, 13), 16), ms=(ms,), fit="line").verify_ms(300)
    assert line[5] - line[0] > 2.0  # the line charges 6 tokens more than a plain step


def test_the_measured_fit_charges_each_size_its_own_time_and_a_tree_grows_to_a_cheaper_size():
    # MKL's fp32 GEMM on an AVX-512 EPYC, 256 cached tokens (3e4d292:results/round22): 3 and 7 rows cost more than 4 and 8
    ms = (61.0, 102.0, 127.0, 89.0, 92.0, 104.0, 124.0, 96.0)
    cost = CostModel(contexts=(256, 1024), sizes=tuple(range(1, 9)), ms=(ms, tuple(m + 10 for m in ms)), fit="measured")
    assert cost.verify_ms(256).tolist() == pytest.approx(ms)
    assert cost.verify_ms(640).tolist() == pytest.approx([m + 5 for m in ms])  # contexts still interpolate
    assert CostModel.from_dict(cost.to_dict()) == cost
    values = torch.tensor([0.9, 0.8, 0.05, 0.02, 0.01, 0.01, 0.01])
    # 2 drafted nodes would be 2.7 tokens in 127 ms; a third, worth only 0.05, makes it 2.75 in 89 ms
    assert best_size(expected_tokens(values, cost.max_size), cost.verify_ms(256)) == 3
    steps = CostModel(contexts=(256,), sizes=tuple(range(1, 9)), ms=(ms,)).verify_ms(256)
    assert steps[2] == pytest.approx(steps[3])  # smoothed, a 3-token tree is charged what a 4-token one costs


def test_a_plain_step_dearer_than_a_small_tree_is_charged_its_own_time_and_never_chosen():
    # bf16 on this CPU at 4K cached tokens (results/transformers/bf16/one_token.md): one token costs more than two
    ms = (122.4, 73.6, 83.5, 77.6, 71.6, 74.4, 97.9)
    fit = CostModel(contexts=(4096,), sizes=tuple(range(1, 8)), ms=(ms,)).verify_ms(4096)
    assert fit[0] == pytest.approx(122.4)  # pooled with the trees, 1 to 6 tokens would all be charged 83.85
    assert (fit[1:].diff() >= 0).all() and fit[1:6].tolist() == pytest.approx([73.6, *[(83.5 + 77.6 + 71.6 + 74.4) / 4] * 4])
    base = tiny_model("llama", seed=2)
    dear_one = CostModel(contexts=(0,), sizes=(1, 2, 3, 32), ms=((20.0, 10.0, 30.0, 500.0),), draft_ms=0.1)
    model = calibrated(base, dear_one, rates=(0.01, 0.02, 0.03, 0.05))  # heads that are rarely right
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    ref = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False)
    res = model.generate(ids, max_new_tokens=30, return_dict_in_generate=True)
    assert torch.equal(res.sequences, ref)
    assert set(res.stats.tree_sizes) == {1}, "one drafted node is cheaper than none, and a second costs 3x"


def test_the_cost_model_measured_on_this_hardware_is_found_first():
    """The same kernels cost otherwise on another CPU ISA (an AVX2 fp32 verify grows with the tree where an
    AVX-512 one is flat to 6 tokens): this machine's entry, else one stored without hardware, else another's."""
    base = tiny_model("llama", seed=0)
    here, kernels = cost_key(base, prepacked=False), kernels_key(base, prepacked=False)
    assert here == f"{kernels}-{hardware(torch.device('cpu'))}" and hardware(torch.device("cpu")) in ("avx2", "avx512", "default")
    other = {f"{kernels}-zz9": 1, f"{kernels}-aa1": 2, f"prepacked-{kernels.split('-', 1)[1]}-{hardware(torch.device('cpu'))}": 3}
    assert find_cost({**other, here: 0, kernels: 4}, base, prepacked=False) == here
    assert find_cost({**other, kernels: 4}, base, prepacked=False) == kernels
    assert find_cost(other, base, prepacked=False) == f"{kernels}-aa1"  # sorted: the same on every run
    assert find_cost({f"prepacked-{kernels.split('-', 1)[1]}": 0}, base, prepacked=False) is None


def test_a_model_sizes_its_trees_by_this_machines_cost_model():
    """Stored: trees nearly free on other hardware, a node costing two steps here. Here, every step is plain."""
    base = tiny_model("llama", seed=4)
    model = calibrated(base, FLAT, rates=(0.95,) * 4)
    model.config.adaptive["cost"] = {f"{kernels_key(base, False)}-otherisa": FLAT.to_dict(), cost_key(base, False): STEEP.to_dict()}
    assert model.cost_model() == STEEP and model.cost_model_key() == cost_key(base, False)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    res = model.generate(ids, max_new_tokens=12, prompt_lookup_num_tokens=0, return_dict_in_generate=True)
    assert set(res.stats.tree_sizes) == {0}
    del model.config.adaptive["cost"][cost_key(base, False)]
    assert model.cost_model() == FLAT and model.cost_model_key() == f"{kernels_key(base, False)}-otherisa"
    res = model.generate(ids, max_new_tokens=12, prompt_lookup_num_tokens=0, return_dict_in_generate=True)
    assert max(res.stats.tree_sizes) > 4


def test_a_lookup_token_is_worth_at_most_what_its_drafted_siblings_leave():
    """The target takes one token after a node: where the heads' children of the root are worth 0.7 and 0.2, a
    lookup token that is neither is worth at most 0.1, though its n-gram rate says 0.8; one that repeats the 0.2
    child may raise it to at most 0.3. Below a node the heads did not expand, the lookup's own rates hold."""
    base = tiny_model("llama", seed=0)
    model = calibrated(base, FLAT)
    drafter = model.adaptive_drafter(lookup=4, ngram=3)
    sequence = torch.tensor([5, 6, 7, 8, 9, 5, 6, 7])  # "5 6 7" matched: the continuation is 8, 9, 5, 6
    for first, expected in ((11, 0.1), (8, 0.3)):
        tok, par, val, slot = [7, 12, first], [-1, 0, 0], [1.0, 0.7, 0.2], [0, 1, 1]
        paths = [[7], [7, 12], [7, first]]
        drafter._merge_lookup(sequence, tok, par, val, slot, paths)
        lookup = LookupAcceptance.from_dict(model.config.adaptive["lookup"]).chain(3, 4)
        nodes = {tuple(p[1:]): i for i, p in enumerate(paths)}
        assert val[nodes[(8,)]] == pytest.approx(expected)  # 0.8 without the cap
        assert val[nodes[(8, 9)]] == pytest.approx(expected * lookup[1])
        assert val[nodes[(8, 9, 5, 6)]] == pytest.approx(expected * lookup[1] * lookup[2] * lookup[3])


def test_a_lookup_token_that_repeats_a_drafted_child_raises_it_as_independent_evidence():
    """Heads 0.3 and lookup 0.8 for the same token: 1 - 0.7 x 0.2 = 0.86, not the larger 0.8; the child's drafted
    subtree keeps its rates given the child (its worth rises with it), and the next lookup token is capped by it."""
    base = tiny_model("llama", seed=0)
    drafter = calibrated(base, FLAT).adaptive_drafter(lookup=4, ngram=3)
    sequence = torch.tensor([5, 6, 7, 8, 9, 5, 6, 7])  # "5 6 7" matched: the continuation is 8, 9, 5, 6 at 0.8, 0.9, ...
    tok, par, val, slot = [7, 8, 12, 20], [-1, 0, 0, 1], [1.0, 0.3, 0.1, 0.15], [0, 1, 1, 2]
    paths = [[7], [7, 8], [7, 12], [7, 8, 20]]
    drafter._merge_lookup(sequence, tok, par, val, slot, paths)
    nodes = {tuple(p[1:]): i for i, p in enumerate(paths)}
    assert val[nodes[(8,)]] == pytest.approx(0.86) and slot[nodes[(8,)]] == drafter.repeat
    assert val[nodes[(8, 20)]] == pytest.approx(0.86 * 0.5) and val[nodes[(12,)]] == pytest.approx(0.1)
    assert val[nodes[(8, 9)]] == pytest.approx(0.86 * 0.5)  # 0.9, capped by the 0.5 its sibling 20 holds
    assert val[nodes[(8, 9, 5, 6)]] == pytest.approx(0.86 * 0.5 * 0.9 * 0.9)
    assert all(val[i] <= val[par[i]] for i in range(1, len(tok)))  # worth never grows down a path
    # a drafted grandchild as sure as its parent (rate 1) stays at most its parent's worth through the rescaling
    for heads in (0.1, 0.3, 0.7, 1 / 3, 0.123456789):
        tok, par, val, slot = [7, 8, 12, 20], [-1, 0, 0, 1], [1.0, heads, 0.05, heads], [0, 1, 1, 2]
        paths = [[7], [7, 8], [7, 12], [7, 8, 20]]
        drafter._merge_lookup(sequence, tok, par, val, slot, paths)
        assert val[3] <= val[1] and val[1] > heads
        drafter._merge_lookup(sequence, tok, par, val, slot, paths)  # a second merge raises it again, from there
        assert all(val[i] <= val[par[i]] for i in range(1, len(tok)))


def test_a_second_lookup_branch_is_a_sibling_worth_what_the_first_leaves():
    """"5 6 7" was followed by 8 at 0 and by 3 at 5: with two branches or more both continuations (there are no
    others) hang below the root, the earlier one capped by what the heads' child and the latest leave (1 - 0.5 -
    0.5: nothing); below a root without drafted children, by what the latest leaves (1 - 0.8)."""
    base = tiny_model("llama", seed=0)
    model = calibrated(base, FLAT)
    sequence = torch.tensor([5, 6, 7, 8, 9, 5, 6, 7, 3, 4, 5, 6, 7])
    for branches in (1, 2, 3):
        model.config.lookup_branches = branches
        drafter = model.adaptive_drafter(lookup=2, ngram=3)
        tok, par, val, slot, paths = [7, 12], [-1, 0], [1.0, 0.5], [0, 1], [[7], [7, 12]]
        drafter._merge_lookup(sequence, tok, par, val, slot, paths)
        nodes = {tuple(p[1:]): i for i, p in enumerate(paths)}
        assert val[nodes[(3,)]] == pytest.approx(0.5) and val[nodes[(3, 4)]] == pytest.approx(0.5 * 0.9)  # latest
        assert ((8,) in nodes) == ((8, 9) in nodes) == (branches > 1) and len(tok) == 4 + 2 * (branches > 1)
        assert branches == 1 or val[nodes[(8,)]] == 0.0
    # a root with no drafted children: the second branch gets what the first leaves, 1 - 0.8
    tok, par, val, slot, paths = [7], [-1], [1.0], [0], [[7]]
    drafter._merge_lookup(sequence, tok, par, val, slot, paths)
    nodes = {tuple(p[1:]): i for i, p in enumerate(paths)}
    assert val[nodes[(3,)]] == pytest.approx(0.8) and val[nodes[(8,)]] == pytest.approx(0.2)
    assert all(val[i] <= val[par[i]] for i in range(1, len(tok)))


def test_raised_children_and_the_lookups_own_tokens_learn_their_corrections_apart():
    """A call whose raised children were all accepted raises them further, not the lookup's own tokens; one whose
    lookup tokens all failed lowers the lookup's rate inside the noisy OR, not the raised children's own shift."""
    base = tiny_model("llama", seed=0)
    model = calibrated(base, FLAT)
    lookup = LookupAcceptance.from_dict(model.config.adaptive["lookup"]).chain(3, 4)
    sequence = torch.tensor([5, 6, 7, 8, 9, 5, 6, 7])  # "5 6 7" matched: the continuation is 8, 9, 5, 6

    def merged(drafter):
        tok, par, val, slot = [7, 8, 12], [-1, 0, 0], [1.0, 0.3, 0.05], [0, 1, 1]
        paths = [[7], [7, 8], [7, 12]]
        drafter._merge_lookup(sequence, tok, par, val, slot, paths)
        nodes = {tuple(p[1:]): i for i, p in enumerate(paths)}
        return val[nodes[(8,)]], val[nodes[(8, 9)]] / val[nodes[(8,)]], slot[nodes[(8,)]], slot[nodes[(8, 9)]]

    fresh = model.adaptive_drafter(lookup=4, ngram=3)
    assert merged(fresh) == pytest.approx((0.86, lookup[1], fresh.repeat, 0))
    sure = model.adaptive_drafter(lookup=4, ngram=3)
    for _ in range(8):
        sure.correction.add(sure.repeat, 0.5, 1.0)
    sure.correction.fit()
    raised = sure.correction(sure.repeat, 0.86)
    assert 0.86 < raised and merged(sure)[:2] == pytest.approx((min(raised, 0.95), lookup[1]))  # 0.95: the sibling
    doubt = model.adaptive_drafter(lookup=4, ngram=3)
    for _ in range(8):
        doubt.correction.add(0, 0.8, 0.0)
    doubt.correction.fit()
    r = doubt.correction(0, 0.8)
    assert r < 0.8 and merged(doubt)[:2] == pytest.approx((1 - 0.7 * (1 - r), doubt.correction(0, lookup[1])))
    assert doubt.correction.shift[doubt.repeat] == sure.correction.shift[0] == 0.0


def test_the_online_correction_learns_the_calibrations_error_not_what_is_left_of_it():
    """A source rated 0.5 and accepted 0.25 of the time, drafted with the corrected rate step after step: the shift
    converges to logit(0.25) - logit(0.5) (less the prior's pull), and solves the MAP equation after each fit. A
    correction fitted to the corrected rates would drift back towards no shift as it succeeds."""
    c = Correction(3)
    gen = torch.Generator().manual_seed(0)
    for step in range(300):
        rated = c(1, 0.5)  # what the drafter rates the node now
        for _ in range(4):
            c.add(1, rated, float(torch.rand((), generator=gen) < 0.25))
        c.fit()
    assert list(c.trials) == [(1, 0.0)]  # kept before the shift: logit(0.5), 1,200 trials in one count
    (n, hits), b = c.trials[(1, 0.0)], c.shift[1]
    assert n == 1200 and hits - n / (1 + math.exp(-b)) == pytest.approx(PRIOR / 4 * b, abs=1e-3)  # the MAP equation
    assert b == pytest.approx(math.log(1 / 3), abs=0.15) and c.shift[0] == c.shift[2] == 0.0
    assert c(1, 0.5) == pytest.approx(0.25, abs=0.03) and c(1, 0.99) > 0.95 and c(1, 0.01) < 0.01


def test_acceptance_reads_its_bin_and_depth():
    acc = Acceptance(EDGES, ((0.1, 0.2, 0.3, 0.4), (0.5, 0.6, 0.7, 0.8)))
    assert acc(1, torch.tensor([0.0, 0.1, 0.35, 0.99])).tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert acc(5, torch.tensor([0.05])).tolist() == pytest.approx([0.5])  # deeper than measured: the last row
    assert LookupAcceptance((1, 3), ((0.2,), (0.7, 0.9))).chain(2, 3) == [0.2, 0.2, 0.2]


def test_trees_by_shape_are_built_once_and_match_the_spec_builder():
    spec = TreeSpec.from_paths([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    built = build_buffers(spec)
    dynamic = from_parents((-1, 0, 0, 1, 1, 3))
    for name in ("mask", "depth", "parent", "paths", "path_len"):
        assert torch.equal(getattr(dynamic, name), getattr(built, name)), name
    assert dynamic.children == built.children and from_parents((-1, 0, 0, 1, 1, 3)) is dynamic


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_adaptive_trees_keep_greedy_output_the_targets(arch):
    base = tiny_model(arch, seed=2)
    for cost in (FLAT, STEEP):
        model = calibrated(base, cost)
        sizes = []
        for seed in range(3):
            motif = torch.randint(0, 96, (5,), generator=torch.Generator().manual_seed(seed))
            ids = torch.cat([motif, motif, motif[:2]])[None]  # repeats itself: the lookup finds continuations
            ref = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
            for lookup, branches in ((0, 1), (6, 1), (6, 3)):
                model.config.lookup_branches = branches
                res = model.generate(ids, max_new_tokens=40, prompt_lookup_num_tokens=lookup, return_dict_in_generate=True)
                assert torch.equal(res.sequences, ref), f"{arch}, prompt {seed}, lookup {lookup}, branches {branches}"
                sizes += res.stats.tree_sizes
        if cost is STEEP:
            assert set(sizes) == {0}, "a node that costs two plain steps is never worth drafting"
        else:
            assert len(set(sizes)) > 2 and max(sizes) > 6, "cheap trees should vary with the heads' confidence"


@pytest.mark.parametrize("cost,skips", [
    (FLAT, False),  # nodes nearly free: every level is worth drafting
    (STEEP, True),
    (CostModel(contexts=(0,), sizes=(1, 6, 7, 32), ms=((10.0, 10.0, 13.0, 40.0),), draft_ms=0.8), True),
], ids=["flat", "steep", "steps"])
def test_a_level_is_skipped_only_where_drafting_it_could_not_give_a_better_tree(cost, skips, monkeypatch):
    """The bound behind skipping a level: the tree chosen without it promises at least the expected tokens per
    millisecond of the tree chosen when every level is drafted (and paid for); prompt lookup off."""
    model = calibrated(tiny_model(), cost, rates=(0.1, 0.4, 0.7, 0.97), num_heads=4, std=0.5)
    g = torch.Generator().manual_seed(3)
    cases = [(torch.randn(32, generator=g) * s, torch.randint(0, 96, (12,), generator=g)) for s in (0.3, 1.0, 3.0, 10.0)
             for _ in range(6)]

    def promised(skip: bool) -> tuple[list[float], int]:
        """Each case's expected tokens per ms of its chosen tree, counting the levels drafted; levels in all."""
        drafter = AdaptiveDrafter(model.heads, model.drafting().acceptance, cost, topk=3, beam=3)
        if not skip:
            monkeypatch.setattr(AdaptiveDrafter, "_worth_drafting", lambda self, *a: True)
        calls, real = [], model.heads.head_logits
        monkeypatch.setattr(model.heads, "head_logits", lambda k, *a: calls.append(k) or real(k, *a))
        out = []
        for h, seq in cases:
            before = len(calls)
            draft = drafter._draft_row(h, seq)
            worth = drafter._drafted[-1][1]  # the root's 1, then each kept node's worth
            ms = cost.verify_ms(seq.shape[0] - 1)[draft.tokens.shape[0]] + (len(calls) - before) * cost.draft_ms
            out.append(sum(worth) / float(ms + (cost.overhead_ms if draft.tokens.shape[0] else 0.0)))
        monkeypatch.undo()
        return out, len(calls)

    (pruned, pruned_levels), (full, full_levels) = promised(skip=True), promised(skip=False)
    assert all(p >= f - 1e-6 for p, f in zip(pruned, full)), list(zip(pruned, full))
    assert full_levels == 4 * len(cases) and (pruned_levels < full_levels) == skips


def test_trees_shrink_where_the_heads_are_wrong():
    """Heads that promise 95% but are always wrong: the call's own acceptance pulls the tree down to plain steps."""
    base = tiny_model("llama", seed=4)
    model = calibrated(base, CostModel(contexts=(0,), sizes=(1, 2, 8, 32), ms=((10.0, 11.0, 14.0, 40.0),), draft_ms=0.5),
                       rates=(0.95,) * 4, std=3.0)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    res = model.generate(ids, max_new_tokens=60, prompt_lookup_num_tokens=0, return_dict_in_generate=True)
    sizes = res.stats.tree_sizes
    assert sizes[0] > 4 and sum(sizes[-10:]) < sum(sizes[:10]) / 3, sizes


def test_the_gate_rests_the_heads_while_they_lose_and_doubles_each_rest():
    """A step whose tokens fall short of its cost in plain steps rests the heads for 2 steps, the next shortfall
    for 4 (the record decays by DECAY a step, rested steps included); a step that pays resets the rest."""
    gate = DraftGate()
    assert gate.open()
    gate.record(1, 2.0)  # a 1-token step that cost two plain steps
    assert [gate.open() or gate.record(1, None) for _ in range(3)] == [None, None, True]
    gate.record(1, 2.0)
    closed = 0
    while not gate.open():
        gate.record(1, None)
        closed += 1
    assert closed == 4
    gate.record(6, 2.0)  # pays, even with the decayed shortfalls before it
    assert gate.open() and gate.wait == DraftGate.WAIT


def test_the_heads_rest_where_their_trees_do_not_pay(monkeypatch):
    """The same drafter, steps verified two ways: where the target rejects every drafted node the heads run at a
    minority of steps (the gate and the corrected rates stop them; the lookup still drafts); where it accepts each
    tree's deepest path the gate stays open at every step."""
    cost = CostModel(contexts=(0,), sizes=(1, 2, 8, 32), ms=((10.0, 11.0, 14.0, 40.0),), draft_ms=0.5, overhead_ms=1.0)
    model = calibrated(tiny_model("llama", seed=4), cost, rates=(0.95,) * 4, std=3.0)
    g = torch.Generator().manual_seed(0)

    def open_steps(accept_all: bool) -> tuple[int, int]:
        """Steps the gate was open at, and steps the heads ran at."""
        drafter = AdaptiveDrafter(model.heads, model.drafting().acceptance, cost, topk=3, beam=3)
        calls, real, opened = [], model.heads.head_logits, 0
        monkeypatch.setattr(model.heads, "head_logits", lambda k, *a: calls.append(k) or real(k, *a))
        for _ in range(40):
            opened += drafter.gate.open()
            before = len(calls)
            drafter._draft_row(torch.randn(32, generator=g), torch.randint(0, 96, (12,), generator=g))
            assert drafter.gate.open() or len(calls) == before  # a closed gate runs no head
            parents = drafter._drafted[-1][0]
            path = [len(parents) - 1] if accept_all else [0]  # the last kept node is a deepest one
            while path[-1] > 0:
                path.append(parents[path[-1]])
            drafter.update([torch.tensor(path[::-1])])
        monkeypatch.undo()
        return opened, calls.count(0)

    assert open_steps(accept_all=False)[1] < 40 / 2  # the heads ran at fewer than half the steps
    assert open_steps(accept_all=True)[0] == 40


@pytest.mark.slow
def test_adaptive_sampling_is_exact_with_plain_steps_among_tree_steps():
    base = tiny_model("llama", seed=5, vocab_size=6, initializer_range=0.6)
    # trees are cheap after 3 cached tokens (the first step) and dear from 4 on: plain steps follow tree steps
    cost = CostModel(contexts=(3, 4), sizes=(1, 2, 4, 32), ms=((10.0, 10.5, 11.0, 60.0), (10.0, 40.0, 80.0, 500.0)))
    model = calibrated(base, cost, rates=(0.05, 0.4, 0.7, 0.95), std=1.0, tree=TREE)
    ids = torch.tensor([[1, 4, 2]])
    law = exact_joint(base, ids, **SETTINGS)
    counts, sizes, _ = sample_counts(model, ids, DRAWS, torch.Generator().manual_seed(99), **SETTINGS)
    assert 0 in sizes and max(sizes) >= 3, "the test must mix plain steps and tree steps"
    assert sum(1 for s in sizes if s) > DRAWS // 4
    assert p_value(law, counts) > 1e-3


def test_a_seed_reproduces_an_adaptive_sample():
    base = tiny_model("llama", seed=7)
    model = calibrated(base, FLAT)
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(3))
    outs = [model.generate(ids, max_new_tokens=30, do_sample=True, temperature=0.8,
                           generator=torch.Generator().manual_seed(11)) for _ in range(2)]
    assert torch.equal(outs[0], outs[1])


class ChainPerRow(RowDrafter):
    """Row b drafts a chain of b + 1 wrong-or-right tokens (its reference continuation): trees differ per row."""

    def __init__(self, reference: torch.Tensor) -> None:
        self.reference = reference

    def draft(self, hidden, sequences, buffers):
        out = []
        for seq in sequences:
            row = next(b for b in range(self.reference.shape[0]) if torch.equal(self.reference[b, : seq.shape[0]], seq))
            n = row + 1
            truth = torch.cat([self.reference[row], torch.zeros(n, dtype=torch.long)])[seq.shape[0] : seq.shape[0] + n]
            out.append(Draft(truth, from_parents(tuple(range(-1, n)))))
        return out


def test_batched_rows_may_draft_trees_of_different_shapes():
    base = tiny_model("llama", seed=3)
    model = MedusaModel.from_pretrained(base, heads=None, tree="cpu-8")
    ids = torch.randint(3, 90, (3, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[2, :2], ids[2, :2] = 0, 0
    ref = base.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)
    res = model.generate(ids, attention_mask=mask, max_new_tokens=24, pad_token_id=0, eos_token_id=None,
                         drafter=ChainPerRow(ref), return_dict_in_generate=True)
    assert torch.equal(res.sequences, ref)
    assert res.stats.mean_accepted > 2.0  # each row accepts its own chain: 1, 2 and 3 drafted tokens a step
    lookup = model.generate(ids, attention_mask=mask, max_new_tokens=24, pad_token_id=0, eos_token_id=None,
                            prompt_lookup_num_tokens=5)  # the lookup grows each row's tree differently
    assert torch.equal(lookup, ref)


def test_a_batch_cost_model_interpolates_rows_and_round_trips():
    one = CostModel(contexts=(0,), sizes=(1, 4), ms=((10.0, 13.0),))
    two = CostModel(contexts=(0,), sizes=(1, 3), ms=((12.0, 20.0),))
    four = CostModel(contexts=(0,), sizes=(1, 3), ms=((16.0, 40.0),))
    cost = one.with_batches({4: four, 2: two})
    assert [b for b, _ in cost.batches] == [2, 4] and cost.batched and not one.batched
    assert cost.verify_ms(0).tolist() == pytest.approx([10, 11, 12, 13])  # one row: the model itself
    assert cost.verify_ms(0, rows=2).tolist() == pytest.approx([12, 16, 20])  # a batch's sizes: its own table's
    assert cost.verify_ms(0, rows=3).tolist() == pytest.approx([14, 22, 30])  # between measured row counts
    assert cost.verify_ms(0, rows=8).tolist() == pytest.approx([24, 52, 80])  # beyond: extrapolated, as compute grows
    assert CostModel.from_dict(cost.to_dict()) == cost
    assert CostModel.from_dict(one.to_dict()) == one and "batches" not in one.to_dict()  # older configs
    with pytest.raises(ValueError, match="measured one row only"):
        one.verify_ms(0, rows=2)
    with pytest.raises(ValueError, match="increasing row counts of 2 or more"):
        one.with_batches({1: two})
    with pytest.raises(ValueError, match="batches or a greedy cost of its own"):
        one.with_batches({2: cost})


def test_a_greedy_cost_model_stands_in_for_greedy_steps_and_round_trips():
    """One row's greedy verify (the screen: no LM head) has its own table; drafting, overhead and the batches
    stay the full model's."""
    full = CostModel(contexts=(0,), sizes=(1, 4), ms=((10.0, 13.0),), draft_ms=0.5, overhead_ms=2.0)
    two = CostModel(contexts=(0,), sizes=(1, 3), ms=((12.0, 20.0),))
    greedy = CostModel(contexts=(0,), sizes=(1, 4), ms=((7.0, 10.0),), draft_ms=9.0)  # drafting: the full model's
    cost = full.with_batches({2: two}).with_greedy(greedy)
    assert full.for_greedy() is full  # not measured: greedy steps are charged the full verify
    g = cost.for_greedy()
    assert g.verify_ms(0).tolist() == pytest.approx([7, 8, 9, 10]) and cost.verify_ms(0).tolist() == pytest.approx([10, 11, 12, 13])
    assert (g.draft_ms, g.overhead_ms, g.batches, g.greedy) == (0.5, 2.0, cost.batches, None)
    assert CostModel.from_dict(cost.to_dict()) == cost and "greedy" not in full.to_dict()
    with pytest.raises(ValueError, match="greedy cost model is one row's"):
        full.with_greedy(cost)
    with pytest.raises(ValueError, match="batches or a greedy cost of its own"):
        full.with_batches({2: two.with_greedy(greedy)})


@pytest.mark.skipif(not bf16_supported(), reason="the screen needs bf16 kernels")
def test_greedy_calls_size_their_trees_by_the_greedy_cost_where_the_screen_serves():
    """Stored: a node costs two plain steps, but a screened greedy verify leaves trees nearly free. Greedy calls take
    trees (and still equal generate's output); sampling, and greedy with the screen off, take plain steps."""
    base = tiny_model("llama", seed=4)
    model = calibrated(base, STEEP.with_greedy(CostModel(FLAT.contexts, FLAT.sizes, FLAT.ms)), rates=(0.95,) * 4)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    res = model.generate(ids, max_new_tokens=16, prompt_lookup_num_tokens=0, return_dict_in_generate=True)
    assert max(res.stats.tree_sizes) > 4
    assert torch.equal(res.sequences, base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False))
    torch.manual_seed(0)
    res = model.generate(ids, max_new_tokens=16, prompt_lookup_num_tokens=0, do_sample=True, return_dict_in_generate=True)
    assert set(res.stats.tree_sizes) == {0}
    model.target.screen.enabled = False
    res = model.generate(ids, max_new_tokens=16, prompt_lookup_num_tokens=0, return_dict_in_generate=True)
    assert set(res.stats.tree_sizes) == {0}


BATCH_FLAT = FLAT.with_batches({2: FLAT, 8: FLAT})  # a batch's trees nearly free as well
BATCH_STEEP = FLAT.with_batches({2: STEEP, 8: STEEP})  # trees free for one row, dear for a batch


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_batch_chooses_one_tree_size_for_its_rows_and_keeps_greedy_output(arch):
    base = tiny_model(arch, seed=2)
    motifs = torch.randint(3, 90, (3, 5), generator=torch.Generator().manual_seed(4))
    ids = torch.cat([motifs, motifs, motifs[:, :2]], dim=1)  # each row repeats itself: the lookup finds continuations
    mask = torch.ones_like(ids)
    mask[2, :3], ids[2, :3] = 0, 0  # left padding
    ref = base.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0, eos_token_id=None)
    for cost in (BATCH_FLAT, BATCH_STEEP):
        model, tau = calibrated(base, cost), {}
        for lookup in (0, 6):
            res = model.generate(ids, attention_mask=mask, max_new_tokens=30, pad_token_id=0, eos_token_id=None,
                                 prompt_lookup_num_tokens=lookup, return_dict_in_generate=True)
            assert torch.equal(res.sequences, ref), f"{arch}, lookup {lookup}"
            sizes = res.stats.tree_sizes
            if cost is BATCH_STEEP:
                assert set(sizes) == {0}, "a node that costs a batch two plain steps is never worth drafting"
            else:
                assert len(set(sizes)) > 2 and max(sizes) > 6, sizes
                tau[lookup] = res.stats.mean_accepted
        if cost is BATCH_FLAT:
            assert tau[6] > tau[0] * 1.1, f"the rows accept their lookups' continuations: {tau}"
        # one row alone still reads the one-row table, where trees are cheap
        alone = model.generate(ids[:1], max_new_tokens=30, eos_token_id=None, return_dict_in_generate=True)
        assert torch.equal(alone.sequences, ref[:1]) and max(alone.stats.tree_sizes) > 0


def test_rows_of_a_batch_share_one_size_and_the_best_per_millisecond():
    """Two rows' candidates: the size maximises the rows' expected tokens together per millisecond of the batch's
    step, and a row with fewer candidates than that keeps what it has."""
    model = calibrated(tiny_model(), BATCH_FLAT, num_heads=2)
    two = CostModel(contexts=(0,), sizes=(1, 2, 3, 4, 5), ms=((10.0, 10.0, 16.0, 17.0, 30.0),))
    drafter = AdaptiveDrafter(model.heads, model.drafting().acceptance, FLAT.with_batches({2: two}), topk=2, beam=2)
    found = {0: [0.9, 0.2, 0.1, 0.1], 1: [0.8]}
    drafter._candidates_rows = lambda hidden, seqs, verify_ms: [Candidates(
        [0] + [5] * len(found[h]), [-1] + [0] * len(found[h]), [1.0, *found[h]], [0] * (len(found[h]) + 1),
        list(range(1, len(found[h]) + 1)), found[h], 0) for h in hidden]
    drafts = drafter._draft_batch([0, 1], [torch.zeros(4, dtype=torch.long)] * 2)
    # tokens per ms (no levels drafted, no overhead): n=0: 2/10, n=1: 3.7/10, n=2: 3.9/16, n=3: 4.0/17
    assert [d.tokens.shape[0] for d in drafts] == [1, 1]
    two = CostModel(contexts=(0,), sizes=(1, 2, 3, 4, 5), ms=((10.0, 10.0, 10.0, 10.5, 30.0),))
    drafter.cost = FLAT.with_batches({2: two})  # now n=2: 3.9/10 beats n=1: 3.7/10 and n=3: 4.0/10.5
    assert [d.tokens.shape[0] for d in drafter._draft_batch([0, 1], [torch.zeros(4, dtype=torch.long)] * 2)] == [2, 1]


def test_batched_adaptive_sampling_is_exact_with_plain_steps_among_tree_steps():
    """The joint law of a padded row's first tokens, sampled beside another row with per-step trees for the batch:
    trees are cheap after 4 cached tokens per row (the first step) and dear from 5 on, so plain steps follow."""
    base = tiny_model("llama", seed=5, vocab_size=6, initializer_range=0.6)
    mixed = CostModel(contexts=(4, 5), sizes=(1, 2, 4, 32), ms=((10.0, 10.5, 11.0, 60.0), (10.0, 40.0, 80.0, 500.0)))
    model = calibrated(base, FLAT.with_batches({2: mixed}), rates=(0.05, 0.4, 0.7, 0.95), std=1.0, tree=TREE)
    law = exact_joint(base, torch.tensor([[1, 4, 2]]), **SETTINGS)
    ids, mask = torch.tensor([[0, 1, 4, 2], [3, 5, 1, 1]]), torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    g = torch.Generator().manual_seed(99)
    counts, sizes = {}, []
    for _ in range(2500):
        res = model.generate(ids, attention_mask=mask, max_new_tokens=3, generator=g, pad_token_id=0, eos_token_id=None,
                             return_dict_in_generate=True, **SETTINGS)
        key = tuple(res.sequences[0, 4:].tolist())
        counts[key] = counts.get(key, 0) + 1
        sizes += res.stats.tree_sizes
    assert 0 in sizes and max(sizes) >= 3, "the test must mix plain steps and tree steps"
    assert p_value(law, counts) > 1e-3


def test_a_batch_drafts_each_level_once_for_its_rows_and_each_row_as_alone():
    model = calibrated(tiny_model(), BATCH_FLAT, rates=(0.1, 0.4, 0.7, 0.97), num_heads=4, std=0.5)
    # head 2 is rarely right and heads 3 and 4 often: a row may skip level 2 and yet find level 3 worth drafting
    rates = Acceptance(EDGES, ((0.1, 0.4, 0.7, 0.97), (0.01, 0.01, 0.01, 0.02), (0.5, 0.8, 0.95, 0.99), (0.5, 0.8, 0.95, 0.99)))
    drafter = AdaptiveDrafter(model.heads, rates, FLAT, topk=3, beam=3)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(6, 32, generator=g) * torch.tensor([0.3, 1.0, 3.0, 10.0, 30.0, 0.1])[:, None]
    sequences = [torch.randint(0, 96, (n,), generator=g) for n in (5, 9, 12, 7, 6, 8)]
    cost = CostModel(contexts=(0,), sizes=(1, 6, 7, 32), ms=((10.0, 10.0, 13.0, 40.0),), draft_ms=0.8)  # rows stop apart
    verify_ms = cost.verify_ms(12).tolist()
    calls, real = [], model.heads.head_logits
    model.heads.head_logits = lambda k, *a: calls.append(k) or real(k, *a)
    together = drafter._candidates_rows(hidden, sequences, verify_ms)
    assert calls == sorted(set(calls)), "one call per level for all the rows"
    for b, found in enumerate(together):
        alone = drafter._row_candidates(hidden[b], sequences[b], verify_ms)
        assert found.tok == alone.tok and found.par == alone.par and found.levels == alone.levels
        assert found.values == pytest.approx(alone.values, rel=1e-4)
    assert len({found.levels for found in together}) > 1, "the rows must stop drafting at different levels"


def test_batches_without_a_batch_cost_draft_the_fixed_tree():
    base = tiny_model("llama", seed=3)
    model = calibrated(base, FLAT)  # one row measured only
    ids = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(1))
    res = model.generate(ids, max_new_tokens=12, pad_token_id=0, eos_token_id=None, return_dict_in_generate=True)
    assert set(res.stats.tree_sizes) == {model.tree.num_nodes}
    assert torch.equal(res.sequences, base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                                    do_sample=False, pad_token_id=0, eos_token_id=None))


def test_new_heads_fit_the_default_tree_and_adaptive_needs_a_calibration():
    base = tiny_model("llama")
    model = MedusaModel.from_pretrained(base, heads=None, num_heads=2)
    assert model.tree.depth <= 2
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model.generate(ids, max_new_tokens=12), base.generate(ids, max_new_tokens=12, do_sample=False))
    with pytest.raises(ValueError, match="run medusa-heads calibrate"):
        model.set_tree("adaptive")
    with pytest.raises(ValueError, match="needs its measured acceptance"):
        AdaptiveDrafter(model.heads, Acceptance(EDGES, ((0.5,) * 4,)), FLAT, None, lookup_tokens=4)


@pytest.mark.skipif(not bf16_supported(), reason="no oneDNN bf16 kernels on this CPU")
def test_the_shipped_heads_choose_trees_for_a_bf16_target_and_its_output_is_generates():
    """bf16 on a CPU has its own cost model in the shipped heads (results/transformers/bf16/), and from_pretrained gives a bf16
    target the row-exact attention (where this CPU's products allow it): the output is generate's token for token."""
    model = MedusaModel.from_pretrained(default_model_path(), dtype=torch.bfloat16)
    base = model.base_model
    assert model.adaptive and kernels_key(base, is_prepacked(base)) == "prepacked-bfloat16-cpu"
    tok = AutoTokenizer.from_pretrained(default_model_path())
    ids = prompt_ids(tok, "List three uses of copper and say why each needs it.")
    ref = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False)
    res = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, return_dict_in_generate=True)
    assert res.stats.mean_accepted > 1.5 and max(res.stats.tree_sizes) > 1
    if uses_exact_attention(base):
        assert torch.equal(res.sequences, ref)
    else:  # a CPU whose bf16 products are not row-invariant: a 12-token verify rounds otherwise than a one-token step
        assert_diverges_only_at_a_near_tie(base, res.sequences, ref)


def test_the_loop_is_charged_to_every_step_and_a_tree_s_work_to_trees_alone():
    """A plain step pays the loop's own work too: charged to every size, it makes a tree that a bare verify would
    not pay for the better choice; the gate's plain step carries it likewise. Both round-trip through the config."""
    cost = CostModel(contexts=(0,), sizes=(1, 2), ms=((10.0, 14.0),), draft_ms=0.5, overhead_ms=0.2, loop_ms=4.0)
    assert CostModel.from_dict(json.loads(json.dumps(cost.to_dict()))) == cost
    assert "loop_ms" not in dataclasses.replace(cost, loop_ms=0.0).to_dict()  # tables stored before it read as 0
    model = calibrated(tiny_model(), cost, rates=(0.1, 0.4, 0.7, 0.97), num_heads=4)
    drafter = AdaptiveDrafter(model.heads, model.drafting().acceptance, cost)
    assert drafter._step_ms([10.0, 14.0], levels=2) == [15.0, 19.2]
    tau = expected_tokens(torch.tensor([0.35]), 2)  # one node worth 0.35: 1.35 tokens against a plain step's 1
    bare = dataclasses.replace(cost, loop_ms=0.0, overhead_ms=0.0, draft_ms=0.0)
    assert best_size(tau, torch.tensor([10.0, 14.0])) == 0  # 0.1 against 0.096 tokens a ms: plain
    assert best_size(tau, torch.tensor(AdaptiveDrafter(model.heads, model.drafting().acceptance, bare)
                                       ._step_ms([10.0, 14.0], 0))) == 0
    assert best_size(tau, torch.tensor(drafter._step_ms([10.0, 14.0], 0))) == 1  # 0.071 against 0.074: the tree
    drafter._draft_row(torch.zeros(32), torch.tensor([1, 2, 3]))
    assert drafter._step[2] == float(cost.verify_ms(2)[0]) + 4.0  # the gate's plain step: its verify and the loop
