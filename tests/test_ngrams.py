"""The target's phrasebook (tree/ngrams.py): an n-gram store of its own answers, drafting beside the heads."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from medusa_heads import MedusaModel
from medusa_heads.calibration.measure import ngram_acceptance
from medusa_heads.checkpoint import NGRAMS_NAME, load_ngrams, save_ngrams
from medusa_heads.tree.adaptive import Acceptance, CostModel, PhraseAcceptance
from medusa_heads.tree.ngrams import NgramStore, max_order

from conftest import rotated_conversations, tiny_model, tiny_model_with_tokenizer
from test_adaptive import EDGES, FLAT, calibrated
from test_sampling import DRAWS, SETTINGS, TREE, exact_joint, p_value, sample_counts

SURE = PhraseAcceptance((2,), (Acceptance(EDGES, ((0.9, 0.9, 0.9, 0.9),) * 8),))  # chains rated as nearly sure


def whole(seqs: list[list[int]]) -> list[tuple[torch.Tensor, list[tuple[int, int]]]]:
    return [(torch.tensor(s), [(0, len(s))]) for s in seqs]


def test_the_store_keeps_each_ngrams_most_frequent_follower_as_counting_would():
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 5, (int(n),), generator=g).tolist() for n in torch.randint(3, 40, (30,), generator=g)]
    store = NgramStore.build(whole(seqs), vocab_size=5, min_n=1, max_n=3, min_count=2)
    followers: dict[tuple[int, ...], Counter] = {}
    for s in seqs:
        for i in range(1, len(s)):
            for n in range(1, min(3, i) + 1):
                followers.setdefault(tuple(s[i - n : i]), Counter())[s[i]] += 1
    kept = {k: c for k, c in followers.items() if sum(c.values()) >= 2}
    assert len(store) == len(kept)  # keys of every length in one array, none colliding
    for ngram, c in kept.items():
        row = store.find(list(ngram))
        best = max(c.values())
        assert row >= 0 and int(store.tokens[row]) == min(t for t, k in c.items() if k == best)  # ties: lower id
        assert float(store.confidence[row]) == pytest.approx(best / sum(c.values()))
    assert store.find([4, 4, 4, 4]) == -1


def test_only_tokens_inside_the_spans_are_learned_with_whatever_context_precedes_them():
    ids = torch.tensor([7, 8, 1, 2, 3, 7, 8, 9])
    store = NgramStore.build([(ids, [(6, 8)])], vocab_size=10, min_n=2, max_n=2, min_count=1)
    assert store.chain([7, 8], 3) == ([9], [1.0], [2])  # (7, 8) -> 1 lies outside the span: not learned
    assert store.find([8, 9]) == -1 and store.find([1, 2]) == -1


def test_a_chain_backs_off_to_shorter_ngrams_and_reads_its_own_drafts():
    seqs = [[1, 2, 3, 4]] * 2 + [[9, 2, 3, 5]] * 3 + [[3, 5, 6]] * 2
    store = NgramStore.build(whole(seqs), vocab_size=10, min_n=2, max_n=3, min_count=2)
    tokens, conf, orders = store.chain([1, 2, 3], 4)
    assert tokens == [4] and conf == [1.0] and orders == [3]  # (1, 2, 3) -> 4; then (2, 3, 4), (3, 4): unknown
    tokens, conf, orders = store.chain([8, 2, 3], 4)
    assert tokens == [5, 6] and conf == pytest.approx([0.6, 1.0]) and orders == [2, 2]  # (2, 3) -> 5, (3, 5) -> 6
    assert store.chain([0], 4) == ([], [], [])  # shorter than min_n


def test_bad_stores_are_refused():
    assert max_order(49152) == 4 and max_order(128256) == 3
    with pytest.raises(ValueError, match="do not fit an int64"):
        NgramStore.build(whole([[1, 2, 3, 4, 5, 6]]), vocab_size=128256, max_n=4)
    with pytest.raises(ValueError, match="strictly increasing"):
        NgramStore(torch.tensor([5, 3]), torch.tensor([1, 1]), torch.ones(2), 10, 2, 3)
    with pytest.raises(ValueError, match=r"lie in \[0, 10\)"):
        NgramStore(torch.tensor([3, 5]), torch.tensor([1, 10]), torch.ones(2), 10, 2, 3)
    with pytest.raises(ValueError, match="one shape"):
        NgramStore(torch.tensor([3, 5]), torch.tensor([1]), torch.ones(2), 10, 2, 3)
    with pytest.raises(ValueError, match="no n-grams"):
        NgramStore.build(whole([[1]]), vocab_size=10)


def test_a_store_round_trips_beside_the_heads_and_another_vocabulary_is_refused(tmp_path):
    store = NgramStore.build(whole([[1, 2, 3, 4]] * 2 + [[1, 2, 5]] * 3), vocab_size=96, min_n=2, max_n=4)
    assert load_ngrams(tmp_path) is None
    save_ngrams(tmp_path, store)
    back = load_ngrams(tmp_path, vocab_size=96)
    assert torch.equal(back.keys, store.keys) and torch.equal(back.tokens, store.tokens)
    assert (back.min_n, back.max_n, back.vocab_size) == (2, 4, 96)
    tokens, conf, orders = store.chain([1, 2], 3)
    assert back.chain([1, 2], 3) == (tokens, pytest.approx(conf, abs=1e-3), orders)
    with pytest.raises(ValueError, match="vocabulary of 96, the heads have 100"):
        load_ngrams(tmp_path, vocab_size=100)

    base = tiny_model("llama", seed=1)  # the model saves its phrasebook with its heads, and loads it back
    model = calibrated(base, FLAT)
    model.phrases = store
    model.config.adaptive["ngrams"] = SURE.to_dict()
    model.save_pretrained(tmp_path / "heads")
    again = MedusaModel.from_pretrained(base, heads=tmp_path / "heads")
    assert torch.equal(again.phrases.keys, store.keys) and again.config.adaptive["ngrams"] == SURE.to_dict()

    (tmp_path / "bad").mkdir()
    from safetensors.torch import save_file
    save_file({"keys": store.keys}, tmp_path / "bad" / NGRAMS_NAME, metadata={"vocab_size": "96", "min_n": "2", "max_n": "4"})
    with pytest.raises(ValueError, match=f"bad/{NGRAMS_NAME}: n-gram store lacks"):
        load_ngrams(tmp_path / "bad")


def _phrasebook_of(base, prompts: list[torch.Tensor], new: int) -> tuple[NgramStore, list[torch.Tensor]]:
    """A store of the target's own greedy answers to these prompts (an oracle for them), and those answers."""
    refs = [base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False) for ids in prompts]
    answers = [(r[0], [(p.shape[1], r.shape[1])]) for p, r in zip(prompts, refs)]
    return NgramStore.build(answers, vocab_size=base.config.vocab_size, min_n=2, max_n=3, min_count=1), refs


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_phrasebook_keeps_greedy_output_the_targets_and_a_right_one_raises_tau(arch):
    base = tiny_model(arch, seed=3)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 96, (1, 6), generator=g) for _ in range(3)]
    right, refs = _phrasebook_of(base, prompts, 40)
    wrong = NgramStore.build(whole([torch.randint(0, 96, (60,), generator=g).tolist() for _ in range(20)]),
                             vocab_size=96, min_n=2, max_n=3, min_count=1)
    model = calibrated(base, FLAT, rates=(0.05, 0.1, 0.2, 0.3))  # random heads, rated as the poor drafters they are
    steps = {}
    for name, store in (("none", None), ("right", right), ("wrong", wrong)):
        model.phrases = store
        if store is None:
            model.config.adaptive.pop("ngrams", None)
        else:
            model.config.adaptive["ngrams"] = SURE.to_dict()
        steps[name] = 0
        for ids, ref in zip(prompts, refs):
            res = model.generate(ids, max_new_tokens=40, prompt_lookup_num_tokens=0, return_dict_in_generate=True)
            assert torch.equal(res.sequences, ref), f"{arch}, phrasebook {name}"
            steps[name] += res.stats.steps
    assert steps["right"] < steps["none"] / 2, steps  # the target's own text, drafted and accepted
    assert steps["wrong"] >= steps["none"] - 2, steps


def test_a_phrasebook_without_its_measured_acceptance_does_not_draft():
    base = tiny_model("llama", seed=3)
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(1))
    right, (ref,) = _phrasebook_of(base, [ids], 30)
    model = calibrated(base, FLAT, rates=(0.05, 0.1, 0.2, 0.3))
    plain = model.generate(ids, max_new_tokens=30, prompt_lookup_num_tokens=0, return_dict_in_generate=True)
    model.phrases = right  # no config.adaptive["ngrams"]: the store is not used
    res = model.generate(ids, max_new_tokens=30, prompt_lookup_num_tokens=0, return_dict_in_generate=True)
    assert torch.equal(res.sequences, ref) and res.stats.tokens_per_step == plain.stats.tokens_per_step


@pytest.mark.slow
def test_adaptive_sampling_is_exact_with_a_phrasebook():
    base = tiny_model("llama", seed=5, vocab_size=6, initializer_range=0.6)
    cost = CostModel(contexts=(3, 4), sizes=(1, 2, 4, 32), ms=((10.0, 10.5, 11.0, 60.0), (10.0, 11.0, 12.0, 20.0)))
    model = calibrated(base, cost, rates=(0.05, 0.1, 0.2, 0.3), std=1.0, tree=TREE)
    g = torch.Generator().manual_seed(2)
    model.phrases = NgramStore.build(whole([torch.randint(0, 6, (40,), generator=g).tolist() for _ in range(10)]),
                                     vocab_size=6, min_n=2, max_n=3, min_count=1)
    model.config.adaptive["ngrams"] = SURE.to_dict()
    ids = torch.tensor([[1, 4, 2]])
    law = exact_joint(base, ids, **SETTINGS)
    counts, sizes, _ = sample_counts(model, ids, DRAWS, g, **SETTINGS)
    assert max(sizes) >= 3, "the phrasebook's chains must be drafted"
    assert p_value(law, counts) > 1e-3


def test_the_phrasebooks_acceptance_is_measured_on_answers_it_did_not_learn():
    store = NgramStore.build(whole([[1, 2, 3, 4]] * 3 + [[1, 2, 5, 6]]), vocab_size=10, min_n=2, max_n=2)
    # stored: (1, 2) -> 3 (3 of 4), (2, 3) -> 4; (2, 5) -> 6 was seen once. Roots 1..4 (the last token is none):
    # (0, 1) unknown; (1, 2) -> 3 right, then (2, 3) -> 4 wrong (9); (2, 3) -> 4 wrong; (3, 9) unknown
    answers = [(torch.tensor([0, 1, 2, 3, 9, 7]), [(1, 6)])]
    acceptance, report = ngram_acceptance(store, answers, tokens=3, edges=(0.0, 0.5, 1.0))
    assert report["roots"] == 4 and report["tried"] == [2, 1, 0] and report["accepted"] == [1, 0, 0]
    assert acceptance.orders == (2,) and report["first_by_order"] == {2: [2, 1]}
    rates = acceptance.tables[0].rates  # too few trials for a length of their own: all lengths' rates
    assert rates[:2] == ((0.5, 0.5), (0.0, 0.0)) and rates[2] == rates[1]  # an unreached depth: the one above
    assert report["test"]["observed"] == [0.5, 0.0, 0.0] and report["test"]["predicted"] == [0.5, 0.0, 0.0]
    other = [(torch.tensor([5, 1, 2, 3, 4, 7]), [(1, 6)])]  # tested on other answers: (1, 2) -> 3, (2, 3) -> 4 right
    _, report = ngram_acceptance(store, answers, other, tokens=3, edges=(0.0, 0.5, 1.0))
    assert report["test"]["tried"] == [2, 1, 0] and report["test"]["observed"][:2] == [1.0, 1.0]
    assert report["test"]["predicted"][:2] == [0.5, 0.0]
    with pytest.raises(ValueError, match="continues none"):
        ngram_acceptance(store, [(torch.tensor([9, 9, 9]), [(0, 3)])])


@pytest.mark.parametrize("vocab", [None, 262_144])  # Gemma 3's vocabulary: n-grams of 3 tokens at most (int64 keys)
def test_calibrate_builds_the_phrasebook_measures_it_on_held_out_prompts_and_stores_both(tmp_path, capsys, vocab):
    import json

    from medusa_heads.cli import main
    from medusa_heads.corpus import is_eval

    tok, base = tiny_model_with_tokenizer(tmp_path / "model")
    if vocab:
        base = tiny_model("llama", vocab_size=vocab)
        base.save_pretrained(tmp_path / "model")
    convs = rotated_conversations(40)
    MedusaModel.from_pretrained(base, heads=None).save_pretrained(tmp_path / "heads")
    config = json.loads((tmp_path / "heads" / "config.json").read_text())
    config["extra"] = {"recipe": {"eval_fraction": 0.3}}
    (tmp_path / "heads" / "config.json").write_text(json.dumps(config))
    assert {is_eval(c["id"], 0.3) for c in convs} == {False, True}  # both sides have prompts
    half = len(convs) // 2
    for name, rows in (("a.jsonl", convs[:half]), ("b.jsonl", convs[half:])):
        (tmp_path / name).write_text("".join(json.dumps(c) + "\n" for c in rows))
    main(["calibrate", "--heads", str(tmp_path / "heads"), "--model", str(tmp_path / "model"), "--parts", "ngrams",
          "--ngram-data", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--threads", "1",
          "--report", str(tmp_path / "report")])
    assert "phrasebook:" in capsys.readouterr().out
    saved = json.loads((tmp_path / "heads" / "config.json").read_text())
    acceptance = PhraseAcceptance.from_dict(saved["adaptive"]["ngrams"])
    assert acceptance.rate(1, 4, 1.0) > 0.5  # the held-out answers are rotations of the learned ones
    assert saved["extra"]["adaptive_calibration"]["ngrams"]["roots"] > 0
    store = load_ngrams(tmp_path / "heads", vocab_size=vocab or len(tok))
    assert store.max_n == (3 if vocab else 4)
    the_cat = tok(" the cat", add_special_tokens=False)["input_ids"]
    assert store.chain(the_cat, 2)[0] == tok(" sat on", add_special_tokens=False)["input_ids"]
    assert "## The phrasebook" in (tmp_path / "report" / "report.md").read_text()
    with pytest.raises(SystemExit, match="missing.jsonl: no such file"):
        main(["calibrate", "--heads", str(tmp_path / "heads"), "--model", str(tmp_path / "model"), "--parts", "ngrams",
              "--ngram-data", str(tmp_path / "missing.jsonl")])


def test_children_the_phrasebook_raises_learn_their_correction_apart_from_the_lookups():
    base = tiny_model("llama", seed=0)
    model = calibrated(base, FLAT)
    model.phrases = NgramStore.build(whole([[5, 6, 7, 8, 9]] * 2), vocab_size=96, min_n=2, max_n=3)
    model.config.adaptive["ngrams"] = SURE.to_dict()

    def merged(drafter):  # the heads drafted 8 (0.3) and 12 (0.05) below the root 7; the store continues 8, 9
        tok, par, val, slot = [7, 8, 12], [-1, 0, 0], [1.0, 0.3, 0.05], [0, 1, 1]
        paths = [[7], [7, 8], [7, 12]]
        drafter._merge_lookup(torch.tensor([1, 6, 7]), tok, par, val, slot, paths)
        nodes = {tuple(p[1:]): i for i, p in enumerate(paths)}
        return val[nodes[(8,)]], val[nodes[(8, 9)]], slot[nodes[(8,)]], slot[nodes[(8, 9)]]

    fresh = model.adaptive_drafter(lookup=0, ngram=3)
    raised = fresh.raised[fresh.phrase_slot]
    assert raised not in (fresh.repeat, fresh.phrase_slot) and raised > fresh.depth
    assert merged(fresh) == pytest.approx((1 - 0.7 * 0.1, (1 - 0.7 * 0.1) * 0.9, raised, fresh.phrase_slot))
    other = model.adaptive_drafter(lookup=0, ngram=3)
    for _ in range(8):  # the lookup's raised children all failed: the phrasebook's are not pulled down with them
        other.correction.add(other.repeat, 0.9, 0.0)
    other.correction.fit()
    assert other.correction.shift[other.repeat] < 0 and merged(other) == pytest.approx(merged(fresh))
    doubt = model.adaptive_drafter(lookup=0, ngram=3)
    for _ in range(8):
        doubt.correction.add(raised, 0.9, 0.0)
    doubt.correction.fit()
    assert merged(doubt)[0] < merged(fresh)[0]


def test_rates_are_fitted_per_matched_length_where_there_are_trials_enough(monkeypatch):
    import medusa_heads.calibration.measure as measure

    store = NgramStore.build(whole([[1, 2, 3, 4]] * 3), vocab_size=10, min_n=2, max_n=3)
    # root 2: (1, 2) -> 3 right (a 2-gram), then (1, 2, 3) -> 4 wrong (9); root 3: (1, 2, 3) -> 4 wrong (a 3-gram)
    answers = [(torch.tensor([0, 1, 2, 3, 9]), [(1, 5)])]
    monkeypatch.setattr(measure, "MIN_TRIALS", 1)
    acceptance, report = ngram_acceptance(store, answers, tokens=2, edges=(0.0, 0.5, 1.0))
    assert acceptance.orders == (2, 3) and report["first_by_order"] == {2: [1, 1], 3: [1, 0]}
    assert acceptance.rate(1, 2, 1.0) == 1.0 and acceptance.rate(1, 3, 1.0) == 0.0
    assert acceptance.rate(1, 1, 1.0) == 1.0 and acceptance.rate(1, 4, 1.0) == 0.0  # shorter: the first; longer: the last
    assert PhraseAcceptance.from_dict(acceptance.to_dict()) == acceptance
    with pytest.raises(ValueError, match="increasing n-gram lengths"):
        PhraseAcceptance((3, 2), acceptance.tables)
    with pytest.raises(ValueError, match="same depths"):
        PhraseAcceptance((2, 3), (acceptance.tables[0], Acceptance((0.0, 1.0), ((0.5,),))))
