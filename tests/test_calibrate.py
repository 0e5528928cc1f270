"""`medusa-heads calibrate`'s measurements for the per-step tree: acceptance bins, prompt lookup, cost model."""
from __future__ import annotations

import json

import pytest
import torch

from medusa_heads import MedusaModel
from medusa_heads.config import MedusaConfig
from medusa_heads.inference.propose import lookup_match
from medusa_heads.shards import Segment
from medusa_heads.machine import hardware
from medusa_heads.tree.adaptive import Acceptance, CostModel, LookupAcceptance, isotonic
from medusa_heads.calibration.measure import (
    ACCEPT_EDGES, TEMPERATURES, CandidateSamples, answer_spans, calibrate_acceptance, candidate_samples, correct_ranks,
    fit_isotonic, fit_temperature, lookup_acceptance, measure_cost, merge_adaptive,
)
from medusa_heads.calibration.latency import fit_loop

from conftest import randomize_heads, rotated_conversations, tiny_model, tiny_model_with_tokenizer


def test_isotonic_is_monotone_and_pools_violators_by_weight():
    assert isotonic([1.0, 3.0, 2.0, 4.0], [1, 1, 1, 1]) == [1.0, 2.5, 2.5, 4.0]
    assert isotonic([0.5, 0.1], [1, 3]) == pytest.approx([0.2, 0.2])  # (0.5 + 0.3) / 4
    assert isotonic([3.0, 2.0, 1.0], [1, 1, 2]) == pytest.approx([1.75] * 3)
    y = torch.rand(50, generator=torch.Generator().manual_seed(0)).tolist()
    fit = isotonic(y, [1.0] * 50)
    assert all(a <= b + 1e-12 for a, b in zip(fit, fit[1:]))
    assert sum(fit) == pytest.approx(sum(y))  # each pooled block keeps its mean


def test_fit_isotonic_bins_by_hand():
    edges = (0.0, 0.5, 1.0)
    # bin [0, .5): 3 of 4 accepted; bin [.5, 1]: 1 of 2 -> violates, pooled to 4 / 6
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.6, 1.0])
    hits = torch.tensor([True, True, True, False, True, False])
    assert fit_isotonic(probs, hits, edges) == pytest.approx([4 / 6, 4 / 6], abs=1e-4)  # stored to 4 decimals
    # an empty bin takes the rate below it; leading empty bins the first rate above
    edges = (0.0, 0.25, 0.5, 0.75, 1.0)
    probs, hits = torch.tensor([0.3, 0.3, 0.9]), torch.tensor([False, True, True])
    assert fit_isotonic(probs, hits, edges) == pytest.approx([0.5, 0.5, 0.5, 1.0])
    with pytest.raises(ValueError, match="no candidates"):
        fit_isotonic(torch.zeros(0), torch.zeros(0, dtype=torch.bool), edges)


def _synthetic(n: int, vocab: int, k: int, truth_temperature: float | None, f=None, seed: int = 0) -> CandidateSamples:
    """Candidates of random logits, accepted with probability f(p) or with the candidates' probability at a
    known temperature."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 3
    top = logits.topk(k, dim=-1)
    probs = (top.values - torch.logsumexp(logits, -1, keepdim=True)).exp()
    lse = torch.stack([torch.logsumexp(logits / t, -1) for t in TEMPERATURES], -1)
    if truth_temperature is not None:  # one true token per position, drawn from softmax(logits / T)
        truth = torch.multinomial((logits / truth_temperature).softmax(-1), 1, generator=g)
        hits = top.indices == truth
    else:
        hits = torch.rand(n, k, generator=g) < f(probs)
    half = torch.arange(n) % 2 == 1
    return CandidateSamples(probs, hits, top.values, lse, half)


def test_acceptance_bins_recover_a_known_calibration():
    f = lambda p: 0.4 + 0.5 * p ** 2  # noqa: E731  true acceptance of a candidate of head probability p
    samples = [_synthetic(20000, 16, 4, None, f, seed=d) for d in range(2)]
    acceptance, report = calibrate_acceptance(samples)
    assert acceptance.depth == 2 and acceptance.edges == ACCEPT_EDGES and report["method"] == "isotonic"
    for d, s in enumerate(samples, start=1):
        b = torch.bucketize(s.probs.flatten(), torch.tensor(ACCEPT_EDGES[1:-1]), right=True)
        for i, rate in enumerate(acceptance.rates[d - 1]):
            inside = s.probs.flatten()[b == i]
            if inside.numel() > 1500:  # well-populated bins: the fit is the bin's true mean acceptance
                assert rate == pytest.approx(float(f(inside).mean()), abs=0.04)
        row = report["depths"][d - 1]
        assert row["isotonic"]["mean"] == pytest.approx(row["observed"], abs=0.02)  # calibrated on the test half
        assert abs(row["raw"]["mean"] - row["observed"]) > 0.1  # the raw probability is not
        assert row["isotonic"]["log_loss"] < row["raw"]["log_loss"]
        assert all(a <= b for a, b in zip(acceptance.rates[d - 1], acceptance.rates[d - 1][1:]))


def test_temperature_fit_recovers_a_known_temperature():
    s = _synthetic(30000, 12, 6, truth_temperature=2.0)
    t = TEMPERATURES[fit_temperature(s)]
    assert 1.7 < t < 2.35
    _, report = calibrate_acceptance([s])
    row = report["depths"][0]
    assert row["temperature"]["log_loss"] < row["raw"]["log_loss"]
    assert row["temperature"]["mean"] == pytest.approx(row["observed"], abs=0.02)


def test_calibrate_acceptance_names_an_empty_half():
    s = _synthetic(100, 8, 2, truth_temperature=1.0)
    s.half[:] = False
    with pytest.raises(ValueError, match="depth 1: no held-out candidates in one half"):
        calibrate_acceptance([s])


def test_candidate_samples_keep_positions_whose_parent_is_in_the_tree():
    model = randomize_heads(MedusaModel.from_pretrained(tiny_model("llama"), heads=None, condition="path"), std=0.1)
    g = torch.Generator().manual_seed(3)
    segments = [Segment(f"c{i}#0", torch.randn(30 + i, 32, generator=g), torch.randint(0, 96, (30 + i,), generator=g))
                for i in range(6)]
    k = 8
    samples = candidate_samples(model.heads, segments, topk=k, chunk=7)
    ranks = correct_ranks(model.heads, segments, topk=k)
    assert len(samples) == 4 and len(samples[0].hits) == len(ranks)
    for d, s in enumerate(samples, start=1):
        expect = [r for r in ranks if all(x >= 0 for x in r[: d - 1])]  # the true path above is in the tree
        assert len(s.hits) == len(expect)
        assert int(s.hits.sum()) == sum(r[d - 1] >= 0 for r in expect)  # one hit where the truth is in the top-k
        assert torch.all(s.probs[:, :-1] >= s.probs[:, 1:]) and torch.all(s.probs <= 1)
        assert torch.allclose(s.temperature_probs(TEMPERATURES.index(min(TEMPERATURES, key=lambda t: abs(t - 1)))),
                              s.probs, atol=0.05)


def test_lookup_match_agrees_with_lookup():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        seq = torch.randint(0, 5, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g)
        cont, n = lookup_match(seq, 6, max_ngram=3, min_ngram=2)
        assert torch.equal(cont, lookup_match(seq, 6, max_ngram=3, min_ngram=2)[0])
        assert (n == 0) == (cont.numel() == 0)
        if n:  # the last n tokens occur earlier, and the continuation is what followed them there
            starts = [i for i in range(len(seq) - n) if torch.equal(seq[i : i + n], seq[-n:])]
            assert starts and torch.equal(cont, seq[starts[-1] + n : starts[-1] + n + 6])
    cont, n = lookup_match(torch.tensor([1, 2, 3, 1, 2]), 4)
    assert n == 2 and cont.tolist() == [3, 1, 2]
    cont, n = lookup_match(torch.tensor([1, 2, 3, 4]), 4)
    assert n == 0 and cont.numel() == 0


def test_lookup_acceptance_on_hand_made_tokens():
    ids = torch.tensor([5, 6, 7, 8, 5, 6, 7, 9])
    # root 5 (p=4): 1-gram [5] -> 6 7 8 5 vs truth 6 7 9: two accepted, the third missed
    # root 6 (p=5): 2-gram [5 6] -> 7 8 .. vs 7 9: one accepted; root 7 (p=6): 3-gram [5 6 7] -> 8 vs 9: missed
    lk, report = lookup_acceptance([(ids, [(4, 8)])], lookup_tokens=4, every_position=True)
    assert report["roots"] == 3 and report["matched"] == [1, 1, 1]
    assert report["tried"] == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]]
    assert report["accepted"] == [[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
    assert lk.ngrams == (1, 2, 3)
    assert lk.rates == ((1.0, 1.0, 0.0, 0.0), (1.0, 0.0, 0.0, 0.0), (0.0, 0.0, 0.0, 0.0))
    assert LookupAcceptance.from_dict(json.loads(json.dumps(lk.to_dict()))) == lk
    # as decoding walks it: after root 5 accepts 6 7, the target's own 9 is the next root, the answer's last token
    lk, report = lookup_acceptance([(ids, [(4, 8)])], lookup_tokens=4)
    assert report["roots"] == 1 and report["tried"] == [[1, 1, 1, 0], [0] * 4, [0] * 4]
    assert lk.rates[0] == (1.0, 1.0, 0.0, 0.0)
    # no match: a plain step; a continuation accepted to its end: the next root follows it
    ids = torch.tensor([1, 2, 3, 4, 1, 2, 3, 4, 5, 6])
    _, report = lookup_acceptance([(ids, [(1, 10)])], lookup_tokens=2)
    # roots: 2 (p=1, no match), 3 (p=2), 4 (p=3), 1 (p=4: 1-gram -> 2 3 accepted), 4 (p=7: 3-gram 2 3 4 -> 1 vs 5), 5
    assert report["roots"] == 6 and report["tried"] == [[1, 1], [0, 0], [1, 0]]
    assert report["accepted"] == [[1, 1], [0, 0], [0, 0]]
    with pytest.raises(ValueError, match="no answer tokens"):
        lookup_acceptance([(ids, [])])


def test_answer_spans_cut_at_the_end_of_turn():
    ids = torch.tensor([1, 2, 3, 9, 4, 5, 6, 7, 9, 8])
    mask = torch.tensor([0, 1, 1, 1, 0, 0, 1, 1, 1, 1], dtype=torch.bool)
    assert answer_spans(ids, mask, eos=9) == [(1, 4), (6, 9)]
    assert answer_spans(ids, mask, eos=None) == [(1, 4), (6, 10)]


def test_cost_model_measured_stored_and_merged_by_kernels():
    model = MedusaModel.from_pretrained(tiny_model("llama"), heads=None, condition="path")
    cost = measure_cost(model.target, model.heads, sizes=(1, 2, 3, 5), contexts=(8, 24), repeats=1, topk=4, overhead_ms=3.0)
    assert cost.contexts == (8, 24) and cost.sizes == (1, 2, 3, 5) and cost.overhead_ms == 3.0 and cost.fit == "measured"
    assert all(x > 0 for row in cost.ms for x in row) and cost.draft_ms > 0
    assert cost.verify_ms(16).shape == (5,)
    assert CostModel.from_dict(json.loads(json.dumps(cost.to_dict()))) == cost
    other = CostModel((256,), (1, 2), ((40.0, 41.0),), draft_ms=1.0, overhead_ms=3.0)
    adaptive = merge_adaptive(None, cost=("stock-float32-cpu", other))
    acc = Acceptance((0.0, 0.5, 1.0), ((0.1, 0.6),))
    adaptive = merge_adaptive(adaptive, acceptance=acc, cost=("prepacked-float32-cpu", cost))
    assert set(adaptive["cost"]) == {"stock-float32-cpu", "prepacked-float32-cpu"}
    assert CostModel.from_dict(adaptive["cost"]["stock-float32-cpu"]) == other
    again = merge_adaptive(adaptive, cost=("stock-float32-cpu", cost))  # a rerun replaces its own kernels' entry only
    assert CostModel.from_dict(again["cost"]["stock-float32-cpu"]) == cost and again["acceptance"] == acc.to_dict()
    assert again["cost"]["prepacked-float32-cpu"] == adaptive["cost"]["prepacked-float32-cpu"]
    config = MedusaConfig(hidden_size=32, vocab_size=96, adaptive=again)
    assert MedusaConfig.from_dict(json.loads(json.dumps(config.to_dict()))).adaptive == again


def test_calibrate_cli_stores_all_three_and_merges_kernels(tmp_path, capsys):
    from medusa_heads.cli import main
    from medusa_heads.kernels.prepack import bf16_supported, mkl_packs, prepack_supported
    from medusa_heads.training.features import features_from_conversations
    from medusa_heads.calibration.measure import second_half

    tok, base = tiny_model_with_tokenizer(tmp_path / "model")
    convs = rotated_conversations(8)
    vocab = sorted({t for c in convs for m in c["messages"] for t in tok(m["content"])["input_ids"]} | {tok.eos_token_id})
    heads = MedusaModel.from_pretrained(base, heads=None, condition="path", draft_vocab=vocab)
    randomize_heads(heads, std=0.1).save_pretrained(tmp_path / "heads")
    config = json.loads((tmp_path / "heads" / "config.json").read_text())
    config["extra"] = {"recipe": {"eval_fraction": 1.0}}  # every conversation held out
    (tmp_path / "heads" / "config.json").write_text(json.dumps(config))
    assert {second_half(c["id"]) for c in convs} == {False, True}
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    features_from_conversations(base, tok, convs, tmp_path / "features")
    common = ["calibrate", "--heads", str(tmp_path / "heads"), "--model", str(tmp_path / "model"), "--data",
              str(tmp_path / "data.jsonl"), "--features", str(tmp_path / "features"), "--contexts", "8,16",
              "--repeats", "1", "--threads", "1", "--report", str(tmp_path / "report"),
              "--accept-topk", str(len(vocab)),  # every candidate: each depth has positions whose parent is in the tree
              "--force-cost"]  # a test runner's load is no reason to drop these timings (tests/test_errors.py checks that)
    main(common + ["--parts", "acceptance,lookup,cost", "--no-prepack"])
    out = capsys.readouterr().out
    assert "acceptance given the parent accepted" in out and "prompt lookup" in out and "verify ms (stock-float32-cpu-" in out
    no_data = [str(tmp_path / "missing.jsonl") if a == str(tmp_path / "data.jsonl") else a for a in common]
    main(no_data + ["--parts", "cost", "--prepack"])  # timings need no conversations
    main(no_data + ["--parts", "batch", "--no-prepack", "--batch-rows", "2,3"])  # added to the stock cost model
    main(common + ["--parts", "greedy", "--no-prepack"])  # likewise, where the screen serves the model (on answers)
    greedy_out = capsys.readouterr().out
    main(common + ["--parts", "loop", "--no-prepack"])  # the loop's own work, timed in greedy calls, added likewise
    assert "calibrate: the loop (stock-float32-cpu-" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--batch-rows takes increasing batch sizes of 2 or more"):
        main(no_data + ["--parts", "batch", "--batch-rows", "4,1"])
    with pytest.raises(SystemExit, match="missing.jsonl: no such file"):
        main(no_data + ["--parts", "lookup"])
    saved = MedusaConfig.load(tmp_path / "heads" / "config.json")
    assert saved.tree == config["tree"]  # the fixed tree is left alone without the "tree" part
    isa = hardware(torch.device("cpu"))  # stored by the hardware the costs were measured on
    packed = "prepacked-mkl" if mkl_packs() else "prepacked"  # fp32 on an Intel CPU packs for MKL
    kernels = {f"stock-float32-cpu-{isa}", f"{packed}-float32-cpu-{isa}" if prepack_supported() else f"stock-float32-cpu-{isa}"}
    assert set(saved.adaptive["cost"]) == kernels
    acceptance = Acceptance.from_dict(saved.adaptive["acceptance"])
    assert acceptance.depth == 4 and acceptance.edges == ACCEPT_EDGES
    assert LookupAcceptance.from_dict(saved.adaptive["lookup"]).ngrams == (1, 2, 3)
    cost = CostModel.from_dict(saved.adaptive["cost"][f"stock-float32-cpu-{isa}"])
    assert cost.contexts == (8, 16) and cost.sizes[-1] == 32 and cost.loop_ms > 0 and cost.overhead_ms >= 0
    loop = saved.extra["adaptive_calibration"]["cost"][f"stock-float32-cpu-{isa}"]["loop"]
    assert loop["steps"] > 100 and loop["fitted"]["loop_ms"] == cost.loop_ms
    assert [b for b, _ in cost.batches] == [2, 3] and cost.batched and cost.verify_ms(8, rows=2).shape == (16,)
    assert cost.batches[0][1].sizes[-1] == 16 and cost.batches[0][1].draft_ms == cost.draft_ms
    if bf16_supported():  # the screen serves the tiny model on this CPU: greedy verifies have their own table
        assert cost.greedy.sizes == cost.sizes and cost.greedy.contexts == (8, 16) and cost.for_greedy().batches == cost.batches
        assert "verify ms (stock-float32-cpu-" + isa + ", greedy)" in greedy_out
    else:
        assert cost.greedy is None and "no greedy cost to measure" in greedy_out
    assert saved.extra["adaptive_calibration"]["cost"][f"stock-float32-cpu-{isa}"]["repeats"] == 1  # kept beside the batch's
    assert saved.extra["adaptive_calibration"]["acceptance"]["method"] in ("isotonic", "temperature")
    report = (tmp_path / "report" / "report.md").read_text()
    assert all(f"## Cost: {k}" in report for k in kernels) and "## Prompt lookup" in report and "| 4 |" in report
    assert f"## Cost of a batch: stock-float32-cpu-{isa}" in report and "| 3 rows, ctx 256 | 3 rows, ctx 1024 |" in report
    assert (f"## Cost of a greedy verify: stock-float32-cpu-{isa}" in report) == bf16_supported()
    assert (tmp_path / "report" / "reliability.png").stat().st_size > 1000

    features_from_conversations(base, tok, convs[:6], tmp_path / "part")  # held-out answers without features are said
    main(common[:7] + ["--features", str(tmp_path / "part"), "--parts", "acceptance", "--accept-topk", str(len(vocab))])
    assert "6 of the 8 held-out conversations have features" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no features for the 8 held-out conversations"):
        main(common[:7] + ["--features", str(tmp_path / "empty"), "--parts", "acceptance"])
    with pytest.raises(SystemExit, match="--parts takes a comma-separated list"):
        main(common + ["--parts", "tree,sizes"])
    config["extra"] = {"recipe": {"eval_fraction": 0.0}}
    (tmp_path / "heads" / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit, match="no held-out conversations"):
        main(common + ["--parts", "lookup"])


def test_a_greedy_verify_is_timed_on_answer_text_after_the_context():
    """The screen's work depends on how sure the target is, so its timing runs on answers: the chain starts in one
    (up to 8 tokens into it) after `context` tokens of the conversations end to end."""
    from medusa_heads.calibration.measure import answer_text

    first = (torch.arange(0, 30), [(10, 30)])  # an answer at 10..30
    second = (torch.arange(100, 150), [(5, 45)])  # at 35..75 end to end
    assert answer_text([first, second], context=12, length=6).tolist() == list(range(6, 24))  # 8 into the first
    text = answer_text([first, second], context=20, length=6)  # too little before the first: the second's, 8 in
    assert text.tolist() == list(range(23, 30)) + list(range(100, 119))
    with pytest.raises(ValueError, match="too few for an answer after 100 tokens"):
        answer_text([first, second], context=100, length=6)


def test_the_loop_s_cost_is_fitted_from_its_steps():
    """fit_loop recovers each term from noisy steps, leaves out a preempted one, and where too few steps drafted or
    kept nodes, takes the measured level and folds the tree's work into the loop's."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(400):
        kept, levels = (i % 3) * 2, (i % 4) if i % 3 else 0  # plain steps, trees without levels, trees with them
        ms = 1.2 + 0.4 * (kept > 0) + 0.7 * levels + 0.02 * float(torch.randn(1, generator=g))
        rows.append((kept, levels, ms))
    rows.append((0, 0, 80.0))  # a collection mid-step
    values, seen = fit_loop(rows, draft_ms=0.3)
    assert values == pytest.approx({"loop_ms": 1.2, "overhead_ms": 0.4, "draft_ms": 0.7}, abs=0.01)
    assert seen["steps"] == 401 and seen["dropped"] == 1 and seen["drafting steps"] > 100
    few = [(4, 0, 1.6)] * 300 + [(0, 0, 1.2)] * 5 + [(4, 1, 2.3)] * 5
    values, _ = fit_loop(few, draft_ms=0.7)
    assert values["draft_ms"] == 0.7 and values["overhead_ms"] == 0.0 and 1.2 < values["loop_ms"] < 1.6
    with pytest.raises(ValueError, match="no step to time"):
        fit_loop([], draft_ms=0.3)
