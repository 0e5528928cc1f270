"""bench and calibrate run end to end on a tiny model; greedy methods agree with transformers."""
from __future__ import annotations

import json


from medusa_heads import MedusaModel
from medusa_heads.bench import run_bench, write_results
from medusa_heads.corpus import PromptRow
from medusa_heads.tree.calibrate import rank_paths
from medusa_heads.tree import load_tree
from medusa_heads.calibration.measure import choose_tree, draft_latency, verify_latency

from conftest import randomize_heads, tiny_model


def test_bench_writes_tables_and_greedy_methods_match(tmp_path, real_base):
    _, tok = real_base
    base = tiny_model("llama", seed=2, vocab_size=len(tok))
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, tree="cpu-8"))
    rows = [PromptRow("a", ["Hello there"], category="chat"), PromptRow("b", ["Two turns", "and again"], category="multi")]
    methods = ["hf", "hf-stock", "pld", "medusa", "medusa-static", "medusa-preset", "medusa:cpu-8", "medusa+pld",
               "medusa:chain-4+pld3"]
    result = run_bench(model, tok, rows, methods, max_new_tokens=8, preset="chain-4", long_tokens=12)
    assert set(result["overall"]) == set(methods) and set(result["by_category"]) == {"chat", "multi"}
    assert all(r["mismatches_vs_hf"] == 0 for r in result["overall"].values())
    assert result["overall"]["hf"]["mean_accepted"] == 1.0
    assert model.tree_buffers.size == 9  # the calibrated tree is restored
    write_results(result, tmp_path, methods)
    assert json.loads((tmp_path / "results.json").read_text())["overall"]["medusa"]["speedup_vs_hf"] > 0
    table = (tmp_path / "results.md").read_text()
    assert (tmp_path / "speedup.png").stat().st_size > 1000 and "medusa-preset" in table
    assert "Slowest category for `medusa`" in table and "Slowest single prompt for `medusa`: " in table
    assert "{" not in table.splitlines()[0] and ": 8 new tokens, greedy, tree fixed, 8 nodes" in table.splitlines()[0]
    ours, pld = (result["overall"][m]["speedup_vs_hf"] for m in ("medusa", "pld"))
    assert table.splitlines()[4].startswith(f"**The heads {'beat' if ours > pld else 'do not beat'} transformers' "
                                            "prompt lookup here**")
    assert "| overall | medusa (heads only) |" in table  # new heads: no prompt lookup of their own
    assert "| overall | medusa+pld (heads + lookup 10) |" in table and "| medusa:chain-4+pld3 (heads + lookup 3) |" in table
    assert result["long"]["medusa"]["tokens"] == 12 and all(result["long"][m]["same_as_hf"] for m in methods)
    assert set(result["by_prompt"]) == {"prompt 1", "prompt 2, turn 1", "prompt 2, turn 2"}  # by place, not by id
    assert result["prompts"]["prompt 2"] == {"id": "b", "category": "multi", "text": "Two turns"}
    sizes = result["verify_sizes"]  # medusa here: the fixed 8-node tree, heads only (new heads have no lookup)
    assert set(sizes) == {9} and abs(sum(v["share"] for v in sizes.values()) - 1) < 1e-9
    assert all(1 <= v["tokens_per_step"] <= size for size, v in sizes.items())
    # tau counts every target forward, greedy verifies without the LM head (medusa_heads/kernels/screen.py) included
    assert 1.0 <= result["overall"]["medusa"]["mean_accepted"] <= sizes[9]["tokens_per_step"]
    assert ("Tree tokens verified per step by `medusa` (root included; share of steps, new tokens per step): "
            f"9: 100.0%, {sizes[9]['tokens_per_step']:.2f}\n") in table


def test_bench_methods_are_checked_and_labelled():
    import re

    import pytest

    from medusa_heads.bench import check_methods, method_label

    assert check_methods(["medusa", "hf", " pld", "medusa"]) == ["hf", "medusa", "pld"]
    for bad in ["medusaa", "medusa:cpu-7", "hf+pld3", "medusa+pldx", "pld+pld"]:
        with pytest.raises(ValueError, match=re.escape(f"unknown bench method {bad!r}; methods: hf, hf-stock, pld, medusa")):
            check_methods([bad])
    assert method_label("medusa", heads_lookup=10) == "medusa (heads + lookup 10)"
    assert method_label("medusa+pld0", heads_lookup=10) == "medusa+pld0 (heads only)"
    assert method_label("medusa-static+pld", heads_lookup=0) == "medusa-static+pld (heads + lookup 10)"
    assert method_label("pld", heads_lookup=0) == "pld (lookup 10)"
    assert method_label("medusa", heads_lookup=10, phrasebook=True) == "medusa (heads + phrasebook + lookup 10)"
    assert method_label("medusa+pld0", heads_lookup=10, phrasebook=True) == "medusa+pld0 (heads + phrasebook only)"
    assert method_label("medusa-static", heads_lookup=10, phrasebook=True) == "medusa-static (heads + lookup 10)"


def test_calibration_picks_a_tree_from_measured_latency():
    model = MedusaModel.from_pretrained(tiny_model("llama"), heads=None)
    latency = verify_latency(model.target, [1, 2, 3, 4, 5], context=16, repeats=1)
    assert set(latency) == {1, 2, 3, 4, 5} and all(t > 0 for t in latency.values())
    paths = rank_paths([(0, 0, -1), (0, 1, 0), (1, -1, 0), (0, 0, 0)])
    assert paths == {(0,): 0.75, (0, 0): 0.5, (0, 0, 0): 0.25, (0, 1): 0.25, (0, 1, 0): 0.25, (1,): 0.25}
    fake = {n: 1.0 + 0.1 * n for n in range(1, 6)}
    out = choose_tree(paths, fake, t_heads=0.0, t_overhead=0.0, max_nodes=4)
    assert [r["nodes"] for r in out["table"]] == [1, 2, 3, 4]
    best = max(out["table"], key=lambda r: r["tokens_per_s"])
    assert out["best"] == best and best["tau"] == 1 + sum(sorted(paths.values(), reverse=True)[: best["nodes"]])
    assert draft_latency(model.heads, load_tree("cpu-8")) > 0
    out = choose_tree(paths, fake, t_heads=lambda spec: 0.5 * spec.num_nodes, t_overhead=0.0, max_nodes=4)
    assert out["best"]["nodes"] == 1  # drafting cost that grows with the tree keeps it small


def test_chat_cli_streams_replies_and_reports_tau(monkeypatch, capsys, real_base):
    import io

    from medusa_heads.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO("What is 2+2?\nAnd times 3?\n\n"))
    main(["chat", "--max-new-tokens", "16"])
    out = capsys.readouterr()
    assert out.out.count("> ") >= 2 and len(out.out) > 40  # two streamed replies
    assert out.err.count("tokens/s, tau") == 2


def test_batch_bench_writes_tables_and_rows_match(tmp_path, real_base):
    from medusa_heads.bench import run_batch_bench, write_batch_results

    _, tok = real_base
    base = tiny_model("llama", seed=2, vocab_size=len(tok))
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, tree="cpu-8"))
    rows = [PromptRow(str(i), [f"Prompt {'long ' * i}number {i}"]) for i in range(5)]
    result = run_batch_bench(model, tok, rows, [1, 2, 4], max_new_tokens=6)
    assert set(result["by_batch"]) == {1, 2, 4} and result["settings"]["prompts"] == 4
    assert all(r["mismatched_rows"] == 0 and r["speedup_vs_hf"] > 0 for r in result["by_batch"].values())
    write_batch_results(result, tmp_path)
    assert (tmp_path / "speedup.png").stat().st_size > 1000 and "| 4 |" in (tmp_path / "results.md").read_text()
