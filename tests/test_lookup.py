"""Prompt lookup merged into the heads' tree: the match, the grown tree, and output that stays the target's."""
from __future__ import annotations

import pytest
import torch

from medusa_heads import MedusaModel
from medusa_heads.inference.propose import Draft, LookupDrafter, RowDrafter, lookup_continuations, lookup_match
from medusa_heads.tree import TreeSpec, build_buffers
from medusa_heads.tree.buffers import with_chain

from conftest import chat_ids, randomize_heads, tiny_model
from test_sampling import DRAWS, SETTINGS, TREE, draws, exact_joint, p_value

T = torch.tensor


def test_lookup_takes_the_latest_occurrence_of_the_longest_matching_ngram():
    seq = T([5, 6, 7, 8, 1, 2, 5, 6, 7, 9, 3, 4, 6, 7, 0, 5, 6, 7])
    assert lookup_match(seq, 3)[0].tolist() == [9, 3, 4]  # [5, 6, 7] at 0 and 6: the latest, 6
    assert lookup_match(seq, 30)[0].tolist() == seq[9:].tolist()  # as many as follow
    seq2 = T([1, 6, 7, 2, 0, 0, 8, 6, 7])  # no earlier [8, 6, 7]; [6, 7] at 1
    assert lookup_match(seq2, 2)[0].tolist() == [2, 0]
    assert lookup_match(seq2, 2, max_ngram=3, min_ngram=3)[0].tolist() == []
    assert lookup_match(T([1, 2, 3, 4]), 5)[0].tolist() == []
    assert lookup_match(T([4, 1, 4]), 5, max_ngram=1, min_ngram=1)[0].tolist() == [1, 4]
    assert lookup_match(T([3]), 5, max_ngram=3, min_ngram=1)[0].tolist() == []


def test_lookup_branches_follow_earlier_occurrences_that_go_on_differently():
    seq = T([5, 6, 1, 2, 5, 6, 3, 4, 5, 6, 1, 9, 5, 6])  # [5, 6] at 0, 4, 8: followed by 1, 3, 1
    found, n = lookup_continuations(seq, 2, max_ngram=3, min_ngram=1, branches=3)
    assert n == 2 and [f.tolist() for f in found] == [[1, 9], [3, 4]]  # latest first; the second 1 adds nothing
    assert [f.tolist() for f in lookup_continuations(seq, 2, 3, 1, branches=1)[0]] == [lookup_match(seq, 2, 3, 1)[0].tolist()]
    assert lookup_continuations(T([1, 2, 3]), 2, 3, 1, branches=2) == ([], 0)


def test_a_chain_below_a_node_extends_mask_depth_and_paths_and_leaves_the_heads_buffers():
    base = build_buffers(TreeSpec.from_paths([[0], [1], [0, 0]]))  # nodes: 0 root, 1 [0], 2 [1], 3 [0, 0]
    grown = with_chain(base, below=1, length=2)  # nodes 4 (child of 1), 5 (child of 4)
    assert grown.size == 6 and grown.parent.tolist() == [-1, 0, 0, 1, 1, 4]
    assert grown.depth.tolist() == [0, 1, 1, 2, 2, 3]
    assert grown.mask[5].nonzero().flatten().tolist() == [0, 1, 4, 5]
    assert grown.mask[3].nonzero().flatten().tolist() == [0, 1, 3]
    assert grown.children[1] == (3, 4) and grown.children[4] == (5,)
    assert {tuple(p[:n].tolist()) for p, n in zip(grown.paths, grown.path_len)} == {(0, 2), (0, 1, 3), (0, 1, 4, 5)}
    assert torch.equal(grown.draft_index, base.draft_index) and grown.levels is base.levels and grown.topk == base.topk
    with pytest.raises(ValueError, match="does not fit"):
        with_chain(base, below=4, length=1)
    with pytest.raises(ValueError, match="does not fit"):
        with_chain(base, below=0, length=0)


class FixedDrafter(RowDrafter):
    """Drafts the same tokens at every step."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = T(tokens)

    def draft_row(self, hidden, sequence, buffers):
        return self.tokens.clone()


def draft_one(drafter, h, sequence, buffers) -> Draft:
    return drafter.draft(h[None], [sequence], buffers)[0]


def test_the_lookup_follows_drafted_nodes_and_hangs_only_new_tokens_below():
    base = build_buffers(TreeSpec.from_paths([[0], [1], [0, 0]]))
    drafter = LookupDrafter(FixedDrafter([10, 11, 12]), lookup_tokens=4)  # [0] -> 10, [1] -> 11, [0, 0] -> 12
    h = torch.zeros(8)
    tokens, grown = draft_one(drafter, h, T([3, 4, 10, 12, 13, 14, 3, 4]), base)  # continuation 10 12 13 14
    assert tokens.tolist() == [10, 11, 12, 13, 14] and grown.parent.tolist() == [-1, 0, 0, 1, 3, 4]
    tokens, grown2 = draft_one(drafter, h, T([3, 4, 11, 20, 9, 3, 4]), base)  # 11 20 9 3: below node 2
    assert tokens.tolist() == [10, 11, 12, 20, 9, 3] and grown2.parent.tolist() == [-1, 0, 0, 1, 2, 4, 5]
    tokens, same = draft_one(drafter, h, T([3, 4, 10, 12, 3, 4]), base)  # 10 12 3 4: the node path, then 3 4
    assert same.parent.tolist() == [-1, 0, 0, 1, 3, 4] and same is grown  # grown trees are built once
    short = LookupDrafter(FixedDrafter([10, 11, 12]), lookup_tokens=2)
    tokens, plain = draft_one(short, h, T([3, 4, 10, 12, 3, 4]), base)  # the continuation [10, 12] is all drafted
    assert plain is base and tokens.tolist() == [10, 11, 12]
    tokens, plain = draft_one(drafter, h, T([1, 2, 3, 4]), base)  # no match
    assert plain is base and tokens.tolist() == [10, 11, 12]
    with pytest.raises(ValueError, match="lookup_tokens >= 1"):
        LookupDrafter(FixedDrafter([]), lookup_tokens=0)


@pytest.fixture
def grown_steps(monkeypatch):
    """Counts the steps at which the lookup grew the tree (a test that never grows one proves nothing)."""
    count = {"grown": 0}
    draft = LookupDrafter.draft

    def spy(self, hidden, sequences, buffers):
        drafts = draft(self, hidden, sequences, buffers)
        count["grown"] += sum(d.buffers is not buffers for d in drafts)
        return drafts

    monkeypatch.setattr(LookupDrafter, "draft", spy)
    return count


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lookup_keeps_greedy_output_the_targets(arch, grown_steps):
    base = tiny_model(arch, seed=2)
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, tree="cpu-8"))
    for seed in range(3):
        motif = torch.randint(0, 96, (6,), generator=torch.Generator().manual_seed(seed))
        ids = torch.cat([motif, torch.randint(0, 96, (3,)), motif, motif[:2]])[None]  # a prompt that repeats itself
        ref = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
        for n in (1, 4, 10):
            out = model.generate(ids, max_new_tokens=40, prompt_lookup_num_tokens=n)
            assert torch.equal(out, ref), f"{arch}, prompt {seed}, lookup {n}"
    assert grown_steps["grown"] > 10


@pytest.mark.slow
def test_lookup_keeps_sampling_exact(grown_steps):
    base = tiny_model("llama", seed=5, vocab_size=6, initializer_range=0.6)
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, num_heads=3, tree=TREE), std=1.0)
    ids = T([[1, 4, 2, 1, 4]])
    lookup_settings = dict(prompt_lookup_num_tokens=3, max_matching_ngram_size=1)
    law = exact_joint(base, ids, **SETTINGS)
    assert p_value(law, draws(model, ids, DRAWS, **SETTINGS, **lookup_settings)) > 1e-3
    assert grown_steps["grown"] > DRAWS // 10
    assert p_value(law, draws(model, ids, DRAWS // 3, **{**SETTINGS, "temperature": 0.8}, **lookup_settings)) < 1e-3


def test_lookup_grows_each_rows_tree_in_a_batch(grown_steps):
    base = tiny_model("llama", seed=2)
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, tree="cpu-8"))
    motif = torch.randint(3, 96, (2, 5), generator=torch.Generator().manual_seed(4))
    ids = torch.cat([motif, motif, motif[:, :2]], dim=1)  # each row repeats its own motif
    ref = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, max_new_tokens=30, prompt_lookup_num_tokens=6, pad_token_id=0), ref)
    assert grown_steps["grown"] > 3


@pytest.mark.real
def test_real_model_lookup_matches_greedy_and_raises_tau_on_a_copying_prompt(real_base):
    base, tok = real_base
    model = MedusaModel.from_pretrained(base, heads="auto")
    text = ("The committee met on Tuesday to review the budget for the new library, the repairs to the old bridge "
            "and the schedule of the summer festival.")
    ids = chat_ids(tok, f"Repeat this sentence word for word, then say 'done':\n{text}")
    ref = base.generate(ids, max_new_tokens=64, do_sample=False)
    plain = model.generate(ids, max_new_tokens=64, prompt_lookup_num_tokens=0, return_dict_in_generate=True)  # heads only
    shipped = model.generate(ids, max_new_tokens=64, return_dict_in_generate=True)  # the heads' config: lookup on
    looked = model.generate(ids, max_new_tokens=64, prompt_lookup_num_tokens=10, return_dict_in_generate=True)
    assert torch.equal(plain.sequences, ref) and torch.equal(looked.sequences, ref) and torch.equal(shipped.sequences, ref)
    assert looked.stats.mean_accepted > 1.5 * plain.stats.mean_accepted
    assert model.config.lookup_tokens == 10 and shipped.stats.mean_accepted == looked.stats.mean_accepted


def test_the_heads_config_sets_the_default_lookup_and_an_explicit_value_wins(grown_steps):
    base = tiny_model("llama", seed=2)
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, tree="cpu-8"))
    motif = torch.randint(0, 96, (6,), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([motif, motif, motif[:3]])[None]
    ref = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    model.config.lookup_tokens = 5
    assert torch.equal(model.generate(ids, max_new_tokens=20, prompt_lookup_num_tokens=0), ref)
    assert grown_steps["grown"] == 0
    assert torch.equal(model.generate(ids, max_new_tokens=20), ref)
    assert grown_steps["grown"] > 0
    batch = torch.cat([ids, ids])
    assert torch.equal(model.generate(batch, max_new_tokens=20), torch.cat([ref, ref]))  # a batch drafts with the heads only
    with pytest.raises(ValueError, match="lookup_tokens must be >= 0"):
        type(model.config)(hidden_size=8, vocab_size=20, lookup_tokens=-1)
