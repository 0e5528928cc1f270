"""Property tests (hypothesis): tree buffers and acceptance hold their invariants on random inputs."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from medusa_heads.inference.accept import accept_choices
from medusa_heads.tree import TreeSpec, build_buffers

path = st.lists(st.integers(0, 4), min_size=1, max_size=4).map(tuple)


@st.composite
def valid_specs(draw):
    paths = set(draw(st.lists(path, min_size=1, max_size=24)))
    closed = {p[:d] for p in paths for d in range(1, len(p) + 1)}  # add every prefix
    return TreeSpec(tuple(closed))


@given(valid_specs())
@settings(max_examples=150, deadline=None)
def test_buffers_invariants(spec):
    b = build_buffers(spec)
    nodes = [()] + list(spec.paths)
    t = len(nodes)
    for i, p in enumerate(nodes):
        ancestors = {nodes.index(p[:d]) for d in range(len(p) + 1)}
        assert set(b.mask[i].nonzero().flatten().tolist()) == ancestors  # the ancestor closure, self included
        assert int(b.depth[i]) == len(p)
        if i:
            assert nodes[int(b.parent[i])] == p[:-1] and i in b.children[int(b.parent[i])]
            assert int(b.parent[i]) < i  # parents first
    for row, n in zip(b.paths.tolist(), b.path_len.tolist()):
        chain = row[:n]
        assert chain[0] == 0 and not b.children[chain[-1]]  # root to a leaf
        assert all(int(b.parent[c]) == a for a, c in zip(chain, chain[1:]))
    assert sorted(r[n - 1] for r, n in zip(b.paths.tolist(), b.path_len.tolist())) == [i for i in range(t) if not b.children[i]]


@given(st.lists(path, min_size=1, max_size=12))
@settings(max_examples=150, deadline=None)
def test_specs_without_their_prefixes_are_refused(paths):
    paths = set(paths)
    if all(p[:-1] in paths for p in paths if len(p) > 1):
        TreeSpec(tuple(paths))  # prefix-closed: valid
    else:
        with pytest.raises(ValueError, match="has no parent"):
            TreeSpec(tuple(paths))


@given(valid_specs(), st.integers(0, 2**31 - 1))
@settings(max_examples=150, deadline=None)
def test_greedy_acceptance_equals_walking_the_tree(spec, seed):
    b = build_buffers(spec)
    g = torch.Generator().manual_seed(seed)
    vocab = 4
    tokens = torch.randint(0, vocab, (b.size,), generator=g)
    # siblings must carry distinct tokens (heads' top-k ranks are distinct tokens)
    for kids in b.children:
        for r, c in enumerate(kids):
            tokens[c] = r % vocab if len(kids) <= vocab else tokens[c]
    if any(len(k) > vocab for k in b.children):
        return
    choice = torch.randint(0, vocab, (b.size,), generator=g)
    nodes, bonus = accept_choices(tokens, choice, b)
    node, walk = 0, [0]
    while True:  # step by step: descend while the target's choice is a drafted child
        nxt = [c for c in b.children[node] if tokens[c] == choice[node]]
        if not nxt:
            break
        node = nxt[0]
        walk.append(node)
    assert nodes.tolist() == walk and bonus == int(choice[walk[-1]])


@pytest.fixture(scope="module")
def tiny_medusa():
    from medusa_heads import MedusaModel

    from conftest import randomize_heads, tiny_model

    return randomize_heads(MedusaModel.from_pretrained(tiny_model("llama", seed=8), heads=None))


@given(
    st.integers(1, 20), st.booleans(), st.floats(0.2, 2.0), st.integers(0, 30), st.floats(0.2, 1.0),
    st.sampled_from([None, 0.05]), st.floats(1.0, 2.0), st.integers(0, 3), st.sampled_from(["chain-4", "cpu-8", "cpu-16", "plain"]),
    st.integers(0, 10_000),
)
@settings(max_examples=60, deadline=None)
def test_random_generate_arguments_never_crash_nor_overrun(tiny_medusa, max_new, do_sample, temperature, top_k, top_p,
                                                          min_p, rep, ngram, tree, seed):
    ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(seed))
    kwargs = dict(max_new_tokens=max_new, repetition_penalty=rep, no_repeat_ngram_size=ngram, eos_token_id=seed % 96)
    if do_sample:
        kwargs.update(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                      generator=torch.Generator().manual_seed(seed))
    res = tiny_medusa.generate(ids, tree=tree, return_dict_in_generate=True, **kwargs)
    new = res.sequences[0, 5:]
    assert torch.equal(res.sequences[0, :5], ids[0]) and 1 <= new.shape[0] <= max_new
    assert res.stats.new_tokens == new.shape[0]
    assert (new == seed % 96).sum() <= 1 and (new[:-1] != seed % 96).all()  # nothing after EOS
