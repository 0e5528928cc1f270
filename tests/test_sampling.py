"""Sampling is exact: the joint law of the first tokens equals the target's, by a chi-square test with power."""
from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from medusa_heads import MedusaModel
from medusa_heads.inference.sampling import build_processors, build_warpers
from transformers import GenerationConfig

from conftest import randomize_heads, tiny_model

VOCAB, NEW, DRAWS = 6, 3, 6000
TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
SETTINGS = dict(do_sample=True, temperature=0.7, top_p=0.9)


@pytest.fixture(scope="module")
def setup():
    base = tiny_model("llama", seed=5, vocab_size=VOCAB, initializer_range=0.6)
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, num_heads=3, tree=TREE), std=1.0)
    ids = torch.tensor([[1, 4, 2]])
    return base, model, ids


def exact_joint(base, ids, **settings) -> dict[tuple[int, ...], float]:
    """Enumerate P(first NEW tokens) from the target with transformers' own warpers."""
    gc = GenerationConfig(**{**GenerationConfig._get_default_generation_params(), **settings})
    processors, warpers = build_processors(gc, ids.shape[1]), build_warpers(gc)
    law = {}
    for seq in itertools.product(range(VOCAB), repeat=NEW):
        p = 1.0
        for i in range(NEW):
            x = torch.cat([ids, torch.tensor([seq[:i]], dtype=torch.long)], dim=1)
            with torch.no_grad():
                logits = base(x).logits[:, -1]
            p *= float(torch.softmax(warpers(x, processors(x, logits)), -1)[0, seq[i]])
        law[seq] = p
    return law


def sample_counts(model, ids, n, generator, **kwargs) -> tuple[dict[tuple[int, ...], int], list[int], int]:
    """n samples of NEW tokens: how often each sequence came, every step's drafted tree size, and how many samples
    took fewer forwards than tokens (accepted a drafted token)."""
    counts: dict[tuple[int, ...], int] = {}
    sizes, accepted = [], 0
    for _ in range(n):
        res = model.generate(ids, max_new_tokens=NEW, generator=generator, return_dict_in_generate=True, **kwargs)
        key = tuple(res.sequences[0, ids.shape[1]:].tolist())
        counts[key] = counts.get(key, 0) + 1
        sizes += res.stats.tree_sizes
        accepted += res.stats.steps < NEW
    return counts, sizes, accepted


def draws(model, ids, n, **kwargs) -> dict[tuple[int, ...], int]:
    counts, _, accepted = sample_counts(model, ids, n, torch.Generator().manual_seed(1234), **kwargs)
    assert accepted > n // 10, "the test must exercise acceptance of drafted tokens"
    return counts


def p_value(law, counts) -> float:
    n = sum(counts.values())
    keys = sorted(law, key=law.get, reverse=True)
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for k in keys:
        if law[k] * n >= 5:
            obs.append(counts.get(k, 0))
            exp.append(law[k] * n)
        else:
            pool_o += counts.get(k, 0)
            pool_e += law[k] * n
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    elif pool_o > 0:
        return 0.0  # a sequence the target can never produce
    assert sum(counts.get(k, 0) for k in law) == n
    total = sum(exp)  # the enumerated law sums to 1 up to float error
    return float(chisquare(obs, [e * n / total for e in exp]).pvalue)


@pytest.fixture(scope="module")
def law(setup):
    base, _, ids = setup
    return exact_joint(base, ids, **SETTINGS)


def test_exact_sampling_matches_the_target(setup, law):
    _, model, ids = setup
    assert p_value(law, draws(model, ids, DRAWS, **SETTINGS)) > 1e-3


def test_the_test_rejects_a_slightly_wrong_temperature(setup, law):
    _, model, ids = setup
    assert p_value(law, draws(model, ids, DRAWS // 3, **{**SETTINGS, "temperature": 0.8})) < 1e-3


def test_the_test_rejects_typical_acceptance(setup, law):
    _, model, ids = setup
    assert p_value(law, draws(model, ids, DRAWS // 3, acceptance="typical", **SETTINGS)) < 1e-3


@pytest.mark.slow
def test_exact_sampling_with_a_context_dependent_processor(setup):
    """Repetition penalty reads each node's own path: the joint law must still be the target's."""
    base, model, ids = setup
    settings = {**SETTINGS, "repetition_penalty": 1.8}
    law = exact_joint(base, ids, **settings)
    assert p_value(law, draws(model, ids, DRAWS, **settings)) > 1e-3
    assert p_value(exact_joint(base, ids, **SETTINGS), draws(model, ids, DRAWS // 3, **settings)) < 1e-3  # it matters


@pytest.mark.slow
def test_exact_sampling_with_path_conditioned_heads(setup, law):
    """Drafts that depend on the sampled root and on each node's path leave the law the target's."""
    base, plain, ids = setup
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, num_heads=3, condition="path", tree=TREE), std=0.1)
    model.heads.blocks.load_state_dict(plain.heads.blocks.state_dict())  # drafts near the plain heads', which get accepted
    assert p_value(law, draws(model, ids, DRAWS, **SETTINGS)) > 1e-3
    h = torch.randn(32)
    drafts = {tuple(model.heads.topk(h, 2, torch.tensor([r, r, r]))[:, :].flatten().tolist()) for r in range(VOCAB)}
    assert len(drafts) > 1, "the drafts must depend on the context tokens for this test to mean anything"


@pytest.mark.parametrize("settings, tie_at_cut", [
    (dict(temperature=0.7, top_k=10, top_p=0.9), False),
    (dict(temperature=1.3, top_k=12, min_p=0.05), False),
    (dict(temperature=0.9, top_k=10, top_p=0.95), True),  # tied k-th scores: the cut keeps them all (full path)
    (dict(top_k=8, typical_p=0.9), False),  # a warper that is not cut-safe: full path
])
def test_a_draw_after_the_top_k_cut_follows_the_warped_distribution(settings, tie_at_cut, monkeypatch):
    from medusa_heads.inference import sampling
    from medusa_heads.inference.sampling import draw, target_probs

    n, vocab = 20000, 60
    warpers = build_warpers(GenerationConfig(do_sample=True, **settings))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, vocab, generator=g) * 2
    if tie_at_cut:
        order = logits[0].argsort(descending=True)
        logits[0, order[settings["top_k"]]] = logits[0, order[settings["top_k"] - 1]]
    probs = target_probs(logits, warpers)[0].double()
    full = []
    monkeypatch.setattr(sampling, "target_probs", lambda *a: full.append(1) or target_probs(*a))
    counts = torch.bincount(draw(logits.expand(n, -1), warpers, g), minlength=vocab).double()
    assert bool(full) == (tie_at_cut or "typical_p" in settings)  # which path ran
    support = probs > 0
    assert counts[~support].sum() == 0 and int(support.sum()) >= 2
    assert chisquare(counts[support], probs[support] / probs[support].sum() * n).pvalue > 1e-3
    hotter = torch.softmax(logits[0].double() / (1.25 * settings.get("temperature", 1.0)), -1)[support]
    assert chisquare(counts[support], hotter / hotter.sum() * n).pvalue < 1e-6  # the test rejects a wrong temperature
