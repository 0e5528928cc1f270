"""Training: loss falls, resume equals an uninterrupted run, distill resumes without loss or duplicates."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from medusa_heads import MedusaModel
from medusa_heads.training import trainer as trainer_mod
from medusa_heads.corpus import append_conversations, read_conversations, read_prompts
from medusa_heads.kernels.prepack import prepack_linears, prepack_supported
from medusa_heads.kernels.tap import LMHeadTap
from medusa_heads.prompting import mask_runs
from medusa_heads.shards import Segment, next_shard_path, write_shard
from medusa_heads.training.features import answer_segments
from medusa_heads.training.recipe import TrainRecipe
from medusa_heads.training.trainer import train

from conftest import distilled_tiny_base, tiny_model


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """A tiny base saved as an HF directory, 24 greedy 'answers' it wrote itself, and their features."""
    root = tmp_path_factory.mktemp("tiny")
    base = tiny_model("llama", seed=7)
    base.save_pretrained(root / "base")
    convs, segments = [], []
    for i in range(24):
        ids = torch.randint(0, 96, (1, 4), generator=torch.Generator().manual_seed(i))
        with LMHeadTap(base, last_only=True) as tap:
            out = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
        new = out[0, 4:]
        segments.append(Segment(f"c{i}#0", tap.hidden()[0], new))
        convs.append({"id": f"c{i}", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]})
    write_shard(next_shard_path(root / "features"), segments[:12])
    write_shard(next_shard_path(root / "features"), segments[12:])
    append_conversations(root / "data.jsonl", convs)
    return root


def recipe(root, out, **kw) -> TrainRecipe:
    base = dict(model=str(root / "base"), data=str(root / "data.jsonl"), features=str(root / "features"), out=str(out),
                num_heads=3, draft_vocab_size=64, max_steps=30, batch_size=64, warmup_steps=3, lr=3e-3,
                eval_every=10, save_every=5, eval_fraction=0.2, tree="chain-4")
    return TrainRecipe(**{**base, **kw})


def test_tapped_hidden_states_reproduce_the_greedy_tokens(tiny_data):
    base = tiny_model("llama", seed=7)
    seg = next(s for s in trainer_mod.load_segments(tiny_data / "features"))
    logits = seg.hidden.float() @ base.lm_head.weight.T
    assert torch.equal(logits.argmax(-1), seg.tokens)


@pytest.mark.parametrize("condition,mlp_size,precision", [("none", 0, "no"), ("path", 0, "no"), ("path", 64, "no"), ("path", 64, "bf16")])
def test_training_lowers_the_loss_and_writes_loadable_heads(tiny_data, tmp_path, condition, mlp_size, precision):
    out = train(recipe(tiny_data, tmp_path / "heads", num_heads=2, tree="cpu-8", max_steps=60, lr=1e-2, condition=condition,
                       mlp_size=mlp_size, mixed_precision=precision))
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    trains = [r for r in log if r["kind"] == "train"]
    assert log[0]["kind"] == "data" and 0 < log[0]["coverage_eval"] <= 1
    assert trains[-1]["loss"] < trains[0]["loss"] * 0.9  # held-out loss barely moves on 19 random-model answers
    assert {"top1_1", "top5_2", "ce_2"} <= set(next(r for r in log if r["kind"] == "eval"))
    assert (out / "train_plot.png").stat().st_size > 1000
    base = tiny_model("llama", seed=7)
    model = MedusaModel.from_pretrained(base, heads=out)
    assert model.config.condition == condition and model.config.mlp_size == mlp_size
    ids = torch.tensor([[5, 6, 7]])
    ref = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=30), ref)


def test_answers_distill_reused_from_earlier_data_are_not_trained_on_twice(tiny_data, tmp_path):
    """A conversation's answer marked reused (distill --reuse: the same answer is in the earlier data) is left out of
    training, features or not."""
    convs = read_conversations(tiny_data / "data.jsonl")
    for c in convs[:6]:
        c["messages"][1]["reused"] = True
    append_conversations(tmp_path / "data.jsonl", convs)
    info = []
    for data in (tiny_data / "data.jsonl", tmp_path / "data.jsonl"):
        out = train(recipe(tiny_data, tmp_path / f"heads-{len(info)}", data=str(data), max_steps=1, eval_every=1))
        info.append(json.loads((out / "train_log.jsonl").read_text().splitlines()[0]))
    segments = {s.id: s for s in trainer_mod.load_segments(tiny_data / "features")}
    dropped = sum(segments[f"{c['id']}#0"].tokens.shape[0] for c in convs[:6])
    assert info[1]["train_tokens"] + info[1]["eval_tokens"] == info[0]["train_tokens"] + info[0]["eval_tokens"] - dropped


@pytest.mark.parametrize("accum,soft", [(1, 0.0), (2, 0.0), (1, 0.5)])
def test_resume_reproduces_the_uninterrupted_run(tiny_data, tmp_path, monkeypatch, accum, soft):
    full = train(recipe(tiny_data, tmp_path / "full", grad_accum=accum, soft_weight=soft))
    real_save = trainer_mod.save_checkpoint
    calls = {"n": 0}

    def crash_after_second_checkpoint(*args, **kwargs):
        real_save(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # killed between checkpoints

    monkeypatch.setattr(trainer_mod, "save_checkpoint", crash_after_second_checkpoint)
    with pytest.raises(KeyboardInterrupt):
        train(recipe(tiny_data, tmp_path / "cut", grad_accum=accum, soft_weight=soft))
    monkeypatch.setattr(trainer_mod, "save_checkpoint", real_save)
    with pytest.raises(ValueError, match="--resume"):
        train(recipe(tiny_data, tmp_path / "cut", grad_accum=accum, soft_weight=soft))
    cut = train(recipe(tiny_data, tmp_path / "cut", grad_accum=accum, soft_weight=soft), resume=True)
    a, b = load_file(full / "heads.safetensors"), load_file(cut / "heads.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_training_continues_from_trained_heads_and_refuses_heads_of_another_shape(tiny_data, tmp_path):
    first = train(recipe(tiny_data, tmp_path / "first", condition="path", mlp_size=32))
    more = train(recipe(tiny_data, tmp_path / "more", condition="path", mlp_size=32, max_steps=10, init_heads=str(first)))
    evals = [[json.loads(line) for line in (d / "train_log.jsonl").read_text().splitlines() if '"eval"' in line]
             for d in (first, more)]
    assert evals[1][0]["step"] == 0 and evals[1][0] == {**evals[0][-1], "step": 0}  # the same heads on the same split
    assert evals[1][-1]["step"] == 10 and evals[1][-1] != evals[1][0]
    config = [json.loads((d / "config.json").read_text()) for d in (first, more)]
    assert config[1]["draft_vocab"] == config[0]["draft_vocab"]
    with pytest.raises(ValueError, match=r"num_heads=3 \(recipe: 2\).*mlp_size=32 \(recipe: 0\)"):
        train(recipe(tiny_data, tmp_path / "bad", condition="path", num_heads=2, init_heads=str(first)))


def test_training_reads_several_answer_files_as_one_and_refuses_a_conversation_given_twice(tiny_data, tmp_path):
    rows = read_conversations(tiny_data / "data.jsonl")
    append_conversations(tmp_path / "a.jsonl", rows[:10])
    append_conversations(tmp_path / "b.jsonl", rows[10:])
    one = train(recipe(tiny_data, tmp_path / "one", max_steps=10))
    two = train(recipe(tiny_data, tmp_path / "two", max_steps=10, data=f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}"))
    a, b = load_file(one / "heads.safetensors"), load_file(two / "heads.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match=r"'c0' is in both .*a.jsonl and .*data.jsonl"):
        train(recipe(tiny_data, tmp_path / "dup", data=f"{tmp_path / 'a.jsonl'},{tiny_data / 'data.jsonl'}"))
    with pytest.raises(FileNotFoundError, match="missing.jsonl does not exist"):
        train(recipe(tiny_data, tmp_path / "gone", data=f"{tmp_path / 'a.jsonl'},{tmp_path / 'missing.jsonl'}"))


def test_unwritable_output_is_refused_before_work(tiny_data, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="not writable"):
        train(recipe(tiny_data, blocker / "heads"))


def test_answer_segments_pair_each_hidden_state_with_the_token_it_produced_and_stop_at_eos():
    # positions:        0  1  2  3  4  5  6  7  8  9 10 11
    ids = torch.tensor([5, 6, 7, 9, 1, 5, 6, 8, 8, 9, 1, 4])
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0], dtype=torch.bool)  # two answer turns
    hidden = torch.arange(12.0)[:, None]  # hidden[p] stands for the LM-head input at p
    whole = answer_segments("c", ids, mask, hidden)
    assert [s.id for s in whole] == ["c#0", "c#1"]
    assert whole[0].tokens.tolist() == [7, 9, 1] and whole[0].hidden[:, 0].tolist() == [1.0, 2.0, 3.0]
    assert whole[1].tokens.tolist() == [8, 8, 9, 1] and whole[1].hidden[:, 0].tolist() == [6.0, 7.0, 8.0, 9.0]
    cut = answer_segments("c", ids, mask, hidden, eos=9)  # through the first eos (the template's newline after it is no answer)
    assert [s.tokens.tolist() for s in cut] == [[7, 9], [8, 8, 9]]
    unfinished = answer_segments("c", ids, mask, hidden, eos=9, finished=[True, False])  # the model never wrote turn 1's eos
    assert [s.tokens.tolist() for s in unfinished] == [[7, 9], [8, 8]]
    assert [s.id for s in answer_segments("c", ids, mask, None, eos=7)] == ["c#0", "c#1"]
    assert [s.id for s in answer_segments("c", ids, mask, None, eos=7, finished=[False, True])] == ["c#1"]  # empty: left out


def test_mask_runs_are_the_answers_turn_by_turn_including_runs_at_either_end():
    mask = torch.tensor([1, 1, 0, 0, 1, 0, 1, 1], dtype=torch.bool)
    assert mask_runs(mask) == [(0, 2), (4, 5), (6, 8)]
    assert mask_runs(torch.zeros(3, dtype=torch.bool)) == [] and mask_runs(torch.ones(3, dtype=torch.bool)) == [(0, 3)]
    # an answer at position 0 has no hidden state before it: its first token is left out, and it is still turn 0
    segs = answer_segments("c", torch.arange(8), mask, torch.arange(8.0)[:, None])
    assert [(s.id, s.tokens.tolist()) for s in segs] == [("c#0", [1]), ("c#1", [4]), ("c#2", [6, 7])]


def test_recipe_keys_and_overrides(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("max_steps: 10\nlr: 1\n")
    r = TrainRecipe.load(path, ["batch_size=8", "tree=chain-4"])
    assert (r.max_steps, r.lr, r.batch_size, r.tree) == (10, 1.0, 8, "chain-4")
    with pytest.raises(ValueError, match="unknown recipe keys: bogus"):
        TrainRecipe.load(path, ["bogus=1"])
    with pytest.raises(ValueError, match="max_steps must be int"):
        TrainRecipe.load(path, ["max_steps=ten"])
    assert TrainRecipe.load(path, ["lr=2e-4"]).lr == 2e-4  # YAML 1.1 reads this as a string
    with pytest.raises(ValueError, match="lr must be float, got 'fast'"):
        TrainRecipe.load(path, ["lr=fast"])


def test_joint_batches_cover_the_epoch_once_in_like_lengths_and_repeat_for_a_seed():
    from medusa_heads.training.joint import epoch_batches

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 600, (203,), generator=g).tolist()
    batches = epoch_batches(lengths, 8, seed=5, pool=4)
    seen = [i for b in batches for i in b]
    assert len(batches) == 203 // 8 and all(len(b) == 8 for b in batches) and len(set(seen)) == len(seen) == 200
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches) / sum(lengths[i] for i in seen)
    assert padded < 1.25  # random batches of 8 pad about 1.7x
    assert batches == epoch_batches(lengths, 8, seed=5, pool=4) and batches != epoch_batches(lengths, 8, seed=6, pool=4)


def test_prompt_file_errors_name_the_line(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: not valid JSON"):
        read_prompts(p)
    p.write_text('{"prompt": "a"}\n\n{"turns": []}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:3: \"turns\" must be a non-empty list"):
        read_prompts(p)
    p.write_text('{"prompt": "  "}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:1: empty prompt"):
        read_prompts(p)
    p.write_text('{"prompt": "a"}\n{"prompt": "b", "id": "x~2"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: id 'x~2' contains '~'"):
        read_prompts(p)


def test_a_second_answer_per_prompt_gets_its_own_id_and_the_prompts_side_of_the_split(tmp_path):
    from medusa_heads.cli import main
    from medusa_heads.corpus import as_variant
    from medusa_heads.corpus import is_eval

    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(400)))
    rows = read_prompts(p)
    sampled = as_variant(rows, "t07")
    assert [r.id for r in sampled[:2]] == ["p:1~t07", "p:2~t07"] and sampled[0].turns == rows[0].turns
    held = [is_eval(r.id, 0.1) for r in rows]
    assert 10 < sum(held) < 80  # the split is not degenerate...
    assert held == [is_eval(r.id, 0.1) for r in sampled]  # ...and every answer to a prompt falls on its side
    for bad in ["", "a~b", "a#b", " t"]:
        with pytest.raises(ValueError, match="variant name"):
            as_variant(rows, bad)
    with pytest.raises(SystemExit, match="--temperature > 0"):  # a greedy second answer would repeat the first
        main(["distill", "--prompts", str(p), "--out", str(tmp_path / "d.jsonl"), "--variant", "t0"])
    p.write_text('{"text": "a"}\n')
    with pytest.raises(ValueError, match=r'p.jsonl:1: a row needs exactly one of "prompt" or "turns"'):
        read_prompts(p)


def test_a_truncated_last_line_is_repaired_not_lost(tmp_path):
    p = tmp_path / "d.jsonl"
    append_conversations(p, [{"id": "a", "messages": []}, {"id": "b", "messages": []}])
    with p.open("a") as f:
        f.write('{"id": "c", "mess')  # a writer killed mid-line
    with pytest.raises(ValueError, match="truncated"):
        read_conversations(p)
    assert [r["id"] for r in read_conversations(p, repair=True)] == ["a", "b"]
    assert p.read_text().endswith("\n")


def test_gzipped_conversations_read_as_plain_and_a_cut_archive_names_itself(tmp_path):
    import gzip

    rows = [{"id": "a", "messages": [{"role": "user", "content": "hi\u2028there"}]}, {"id": "b", "messages": []}]
    plain, packed = tmp_path / "d.jsonl", tmp_path / "d.jsonl.gz"
    append_conversations(plain, rows)
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert read_conversations(packed) == read_conversations(plain) == rows
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(packed.read_bytes()[:-6])
    with pytest.raises(ValueError, match="cut.jsonl.gz: not a complete gzip file"):
        read_conversations(cut)
    torn = tmp_path / "torn.jsonl.gz"
    torn.write_bytes(gzip.compress(plain.read_bytes() + b'{"id": "c", "mess'))
    with pytest.raises(ValueError, match="torn.jsonl.gz: last line is truncated .*decompress it to repair it"):
        read_conversations(torn, repair=True)


def test_distill_resumes_after_a_crash_without_loss_or_duplicates(tmp_path, monkeypatch, real_base):
    from medusa_heads.training import distill as distill_mod
    from medusa_heads.shards import load_segments

    _, tok = real_base
    base = tiny_model("llama", seed=1, vocab_size=len(tok))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question number {i}?" + " more" * i}) + "\n" for i in range(10)))
    rows = read_prompts(prompts)
    out, feats = tmp_path / "d.jsonl", tmp_path / "features"
    real_append = distill_mod.append_conversations
    calls = {"n": 0}

    def crash_on_third_batch(path, written):
        calls["n"] += 1
        if calls["n"] == 3:
            with open(path, "a") as f:
                f.write(json.dumps(written[0])[:25])  # killed in the middle of a line
            raise KeyboardInterrupt
        real_append(path, written)

    monkeypatch.setattr(distill_mod, "append_conversations", crash_on_third_batch)
    with pytest.raises(KeyboardInterrupt):
        distill_mod.distill(base, tok, rows, out, max_new_tokens=6, batch_size=3, features=feats)
    monkeypatch.setattr(distill_mod, "append_conversations", real_append)
    counts = distill_mod.distill(base, tok, rows, out, max_new_tokens=6, batch_size=3, features=feats)
    assert counts["done_before"] == 6 and counts["written"] == 4
    ids = [r["id"] for r in read_conversations(out)]
    assert sorted(ids) == sorted(r.id for r in rows)  # nothing lost, nothing twice
    segs = load_segments(feats, keep_ids=set(ids))
    assert sorted(s.id for s in segs) == sorted(f"{r.id}#0" for r in rows)
    assert all(s.hidden.shape == (s.tokens.shape[0], 32) and 1 <= s.tokens.shape[0] <= 6 for s in segs)


def test_distilled_answers_and_features_are_the_targets_own_batched_greedy_answers(tmp_path, real_base):
    from medusa_heads.training import distill as distill_mod
    from medusa_heads.shards import load_segments

    _, tok = real_base
    base = tiny_model("llama", seed=3, vocab_size=len(tok))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["Hi", "Name three rivers in Europe.", "2+2?"]))
    rows = read_prompts(prompts)
    distill_mod.distill(base, tok, rows, tmp_path / "d.jsonl", max_new_tokens=12, batch_size=3, features=tmp_path / "f")
    segs = {s.id: s for s in load_segments(tmp_path / "f")}
    # the reference: transformers' own generate on the same left-padded batch, with its own (growing) cache
    texts = [tok.apply_chat_template([{"role": "user", "content": r.turns[0]}], tokenize=False, add_generation_prompt=True) for r in rows]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    ref = base.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)[:, enc["input_ids"].shape[1]:]
    eos = {tok.eos_token_id}
    for r, row in zip(rows, ref.tolist()):
        n = next((k + 1 for k, t in enumerate(row) if t in eos), len(row))
        assert segs[f"{r.id}#0"].tokens.tolist() == row[:n]
        logits = segs[f"{r.id}#0"].hidden.float() @ base.lm_head.weight.T  # each feature reproduces its token
        assert torch.equal(logits.argmax(-1), segs[f"{r.id}#0"].tokens)


def _launch(n: int, *argv: str) -> subprocess.CompletedProcess:
    """`accelerate launch` of n processes on this CPU: its torchrun launcher (--multi_gpu) with ACCELERATE_USE_CPU,
    which makes them one gloo process group (`--cpu --num_processes n` alone starts one process)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(n), "--num_machines",
           "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "medusa_heads.cli", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("soft_weight", [0.0, 0.5])
def test_two_processes_train_the_heads_one_process_trains_on_the_same_global_batch(tiny_data, tmp_path, soft_weight):
    """DDP through `accelerate launch`: each process takes half of every micro-batch and divides its loss by the
    whole micro-batch's targets, so the heads are one process's on the same batch, to float rounding."""
    import yaml
    from safetensors.torch import load_file

    common = dict(max_steps=6, save_every=3, eval_every=3, soft_weight=soft_weight, condition="path")
    two = tmp_path / "two.yaml"
    two.write_text(yaml.safe_dump(recipe(tiny_data, tmp_path / "ddp", batch_size=32, **common).to_dict()))
    proc = _launch(2, "train", "--config", str(two))
    assert "step 6" in proc.stdout + proc.stderr and "2 processes" in proc.stdout + proc.stderr
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(recipe(tiny_data, tmp_path / "one", batch_size=64, **common))
    finally:
        torch.set_num_threads(threads)
    a, b = load_file(tmp_path / "ddp" / "heads.safetensors"), load_file(tmp_path / "one" / "heads.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k].float(), b[k].float(), atol=2e-5, rtol=1e-4)
    evals = [[json.loads(x) for x in (tmp_path / d / "train_log.jsonl").read_text().splitlines()][-1] for d in ("ddp", "one")]
    assert evals[0]["top1_1"] == evals[1]["top1_1"] and abs(evals[0]["loss"] - evals[1]["loss"]) < 1e-4


def test_features_shard_across_processes_and_merge_by_name(tiny_data, tmp_path):
    """`accelerate launch --num_processes 2 ... features`: each process computes its share into one folder under
    names of its own; together they are one process's features, and a rerun computes nothing."""
    from medusa_heads.shards import load_segments, shard_paths
    from medusa_heads.training.features import features_from_conversations

    from conftest import tiny_model_with_tokenizer

    tok, base = tiny_model_with_tokenizer(tmp_path / "model")
    convs = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"Question {i}: " + "why? " * i},
                                          {"role": "assistant", "content": f"Because {i} " + "so " * (2 * i)}]}
             for i in range(10)]
    append_conversations(tmp_path / "d.jsonl", convs)
    proc = _launch(2, "features", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "d.jsonl"),
                   "--features", str(tmp_path / "two"), "--no-prepack", "--threads", "1")
    assert "process 0 of 2" in proc.stderr and "process 1 of 2" in proc.stderr
    names = [p.name for p in shard_paths(tmp_path / "two")]
    assert any(n.endswith("-r0.safetensors") for n in names) and any(n.endswith("-r1.safetensors") for n in names)
    assert features_from_conversations(base, tok, convs, tmp_path / "one", batch_tokens=64) == 10
    two = {s.id: s for s in load_segments(tmp_path / "two")}
    one = {s.id: s for s in load_segments(tmp_path / "one")}
    assert two.keys() == one.keys() and len(one) == 10
    for k in one:
        assert torch.equal(one[k].tokens, two[k].tokens)
        torch.testing.assert_close(one[k].hidden.float(), two[k].hidden.float(), atol=0.02, rtol=0.02)  # bf16, other batches
    assert features_from_conversations(base, tok, convs, tmp_path / "two") == 0


def test_features_in_bf16_are_the_fp32_features_to_bf16_precision(tmp_path):
    """`features --dtype bf16` runs the target in bf16 (the cheap pass on a CPU with bf16 kernels, the serving dtype on
    a GPU): the same segments and tokens as fp32, hidden states within bf16's error, and not the fp32 ones exactly."""
    from medusa_heads.cli import main
    from medusa_heads.shards import load_segments

    from conftest import tiny_model_with_tokenizer

    tiny_model_with_tokenizer(tmp_path / "model")
    convs = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"Question {i}: " + "why? " * i},
                                          {"role": "assistant", "content": f"Because {i} " + "so " * (2 * i)}]}
             for i in range(6)]
    append_conversations(tmp_path / "d.jsonl", convs)
    for dtype in ("fp32", "bf16"):
        main(["features", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "d.jsonl"), "--features",
              str(tmp_path / dtype), "--dtype", dtype, "--threads", "1"])
    f32 = {s.id: s for s in load_segments(tmp_path / "fp32")}
    b16 = {s.id: s for s in load_segments(tmp_path / "bf16")}
    assert f32.keys() == b16.keys() and len(f32) == 6
    differ = 0
    for k in f32:
        assert torch.equal(f32[k].tokens, b16[k].tokens)
        a, b = f32[k].hidden.float(), b16[k].hidden.float()
        assert float((a - b).norm() / a.norm()) < 0.05
        differ += not torch.equal(a, b)
    assert differ > 0  # the pass really ran in bf16


def test_features_from_conversations_match_those_tapped_during_distillation(tmp_path, real_base):
    from medusa_heads.training import distill as distill_mod
    from medusa_heads.shards import load_segments
    from medusa_heads.training.features import features_from_conversations

    base, tok = real_base
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Name two colours."}) + "\n" + json.dumps({"prompt": "Say hi."}) + "\n")
    out = tmp_path / "d.jsonl"
    distill_mod.distill(base, tok, read_prompts(prompts), out, max_new_tokens=12, batch_size=2, features=tmp_path / "tapped")
    convs = read_conversations(out)
    assert features_from_conversations(base, tok, convs, tmp_path / "forward") == 2
    tapped = {s.id: s for s in load_segments(tmp_path / "tapped")}
    for s in load_segments(tmp_path / "forward"):
        t = tapped[s.id]
        assert torch.equal(s.tokens, t.tokens)  # the answer re-tokenises to exactly the generated tokens
        torch.testing.assert_close(s.hidden.float(), t.hidden.float(), atol=0.05, rtol=0.02)  # bf16, padded batch
    assert features_from_conversations(base, tok, convs, tmp_path / "forward") == 0  # nothing twice


def test_conversations_with_unicode_line_separators_round_trip(tmp_path):
    p = tmp_path / "d.jsonl"
    rows = [{"id": "a", "messages": [{"role": "user", "content": "one\u2028two\x85three"}]}, {"id": "b", "messages": []}]
    append_conversations(p, rows)
    assert read_conversations(p) == rows


def test_a_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tiny_data, tmp_path, monkeypatch):
    real_loss = trainer_mod.medusa_loss
    calls = {"n": 0}

    def loss_going_nan(*args, **kwargs):
        loss, metrics = real_loss(*args, **kwargs)
        calls["n"] += 1
        return (loss * float("nan") if calls["n"] == 8 else loss), metrics

    monkeypatch.setattr(trainer_mod, "medusa_loss", loss_going_nan)
    with pytest.raises(FloatingPointError, match="loss is nan at step 7"):
        train(recipe(tiny_data, tmp_path / "nan"))
    state = json.loads((tmp_path / "nan" / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 5
    assert all(torch.isfinite(t).all() for t in load_file(tmp_path / "nan" / "checkpoint" / "heads.safetensors").values())


def test_a_tokenizer_that_does_not_fit_the_model_is_refused(tmp_path, real_base):
    from medusa_heads.training.distill import distill

    _, tok = real_base
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(ValueError, match=r"the tokenizer has 49152 tokens but the model's vocabulary has 96"):
        distill(tiny_model("llama"), tok, read_prompts(prompts), tmp_path / "d.jsonl")


# ---- real kills: a child process gets SIGKILL in the middle of writing, then the run is resumed ------------------

KILLED_TRAIN = """
import sys, time, pathlib, yaml
from medusa_heads.training import trainer as T
from medusa_heads.training.recipe import TrainRecipe
recipe, marker = TrainRecipe(**yaml.safe_load(open(sys.argv[1]))), pathlib.Path(sys.argv[2])
real, calls = T.save_heads, []
def stall_inside_third_checkpoint(*a, **k):
    out = real(*a, **k)  # heads are in the temporary folder; optimizer state and the rename are still to come
    calls.append(1)
    if len(calls) == 3:
        marker.write_text("now")
        time.sleep(600)
    return out
T.save_heads = stall_inside_third_checkpoint
T.train(recipe)
"""

KILLED_DISTILL = """
import json, sys, time, pathlib
sys.path.insert(0, sys.argv[4])
from conftest import tiny_model
from transformers import AutoTokenizer
from medusa_heads import default_model_path
from medusa_heads.training import distill as D
from medusa_heads.corpus import read_prompts
out, marker = pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
tok = AutoTokenizer.from_pretrained(default_model_path())
real, calls = D.append_conversations, []
def stall_mid_line(path, written):
    calls.append(1)
    if len(calls) == 3:
        with open(path, "a") as f:
            f.write(json.dumps(written[0])[:30])
            f.flush()
        marker.write_text("now")
        time.sleep(600)
    real(path, written)
D.append_conversations = stall_mid_line
D.distill(tiny_model("llama", seed=1, vocab_size=len(tok)), tok, read_prompts(sys.argv[1]), out,
          max_new_tokens=6, batch_size=3, features=out.parent / "features")
"""


def _run_and_kill(script: str, args: list[str], marker) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", script, *map(str, args)], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not marker.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the child ended before the kill point: {proc.stderr.read()[-2000:]}")
        assert time.time() < deadline, "the child never reached the kill point"
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


def test_kill_9_inside_a_checkpoint_write_then_resume_equals_the_uninterrupted_run(tiny_data, tmp_path):
    import yaml

    full = train(recipe(tiny_data, tmp_path / "full"))
    cfg = tmp_path / "cut.yaml"
    cfg.write_text(yaml.safe_dump(recipe(tiny_data, tmp_path / "cut").to_dict()))
    _run_and_kill(KILLED_TRAIN, [cfg, tmp_path / "marker"], tmp_path / "marker")
    state = json.loads((tmp_path / "cut" / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 10  # the third checkpoint (step 15) was cut short; the second is intact
    cut = train(recipe(tiny_data, tmp_path / "cut"), resume=True)
    a, b = load_file(full / "heads.safetensors"), load_file(cut / "heads.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_kill_9_of_distill_mid_line_then_rerun_loses_and_repeats_nothing(tmp_path, real_base):
    from pathlib import Path

    from medusa_heads.training import distill as distill_mod
    from medusa_heads.shards import load_segments

    _, tok = real_base
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question number {i}?" + " more" * i}) + "\n" for i in range(10)))
    out = tmp_path / "d.jsonl"
    _run_and_kill(KILLED_DISTILL, [prompts, out, tmp_path / "marker", Path(__file__).parent], tmp_path / "marker")
    assert len(out.read_text().splitlines()) == 7  # 6 whole rows and a torn one
    base = tiny_model("llama", seed=1, vocab_size=len(tok))
    rows = read_prompts(prompts)
    counts = distill_mod.distill(base, tok, rows, out, max_new_tokens=6, batch_size=3, features=tmp_path / "features")
    assert counts["done_before"] == 6 and counts["written"] == 4
    ids = [r["id"] for r in read_conversations(out)]
    assert sorted(ids) == sorted(r.id for r in rows)  # nothing lost, nothing twice
    segs = load_segments(tmp_path / "features", keep_ids=set(ids))
    assert sorted(s.id for s in segs) == sorted(f"{r.id}#0" for r in rows)


# ---- Medusa-2: heads trained jointly with LoRA adapters on the target ----------------------------------------------

@pytest.fixture(scope="module")
def joint_data(tmp_path_factory, real_base):
    """A tiny base with the real tokenizer, saved as an HF directory, and 12 answers it distilled itself."""
    _, tok = real_base
    root = tmp_path_factory.mktemp("joint")
    distilled_tiny_base(root, tok, 1, [f"Tell me about number {i}." for i in range(12)], max_new_tokens=24, batch_size=6)
    return root


def joint_recipe(root, out, **kw) -> TrainRecipe:
    return TrainRecipe(**{**dict(model=str(root / "base"), data=str(root / "d.jsonl"), out=str(out),
                                 num_heads=2, draft_vocab_size=256, max_steps=8, batch_size=4, warmup_steps=1, lr=3e-3,
                                 eval_every=4, save_every=4, eval_fraction=0.2, tree="cpu-8", condition="path",
                                 lora_rank=4, lora_lr=1e-2, lm_weight=1.0, kl_weight=0.1), **kw})


def test_joint_lora_training_saves_heads_with_their_adapter_and_generation_is_exact_for_the_adapted_model(joint_data, tmp_path):
    from peft import PeftModel

    out = train(joint_recipe(joint_data, tmp_path / "joint"))
    assert (out / "adapter" / "adapter_model.safetensors").is_file() and (out / "heads.safetensors").is_file()
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    evals = [x for x in log if x["kind"] == "eval"]
    assert evals[-1]["kl_to_frozen"] > 0  # the adapters did move the target
    base = tiny_model("llama", seed=1, vocab_size=49152)
    model = MedusaModel.from_pretrained(base, heads=out)  # merges the adapter into base
    adapted = PeftModel.from_pretrained(tiny_model("llama", seed=1, vocab_size=49152), out / "adapter").merge_and_unload()
    original = tiny_model("llama", seed=1, vocab_size=49152)
    ids = torch.tensor([[5, 6, 7, 8]])
    ref = adapted.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=24), ref)
    if prepack_supported():  # the adapter is merged before the linears are packed (as the CLI loads)
        packed = MedusaModel.from_pretrained(tiny_model("llama", seed=1, vocab_size=49152), heads=out, prepack=True)
        assert torch.equal(packed.generate(ids, max_new_tokens=24), ref)
        prepacked_base = tiny_model("llama", seed=1, vocab_size=49152)
        prepack_linears(prepacked_base)
        with pytest.raises(ValueError, match="already prepacked"):
            MedusaModel.from_pretrained(prepacked_base, heads=out)
    first = {n: p for n, p in original.named_parameters()}
    assert any(not torch.equal(p, first[n]) for n, p in adapted.named_parameters()), "the adapter must change the target"

    stage2 = train(joint_recipe(joint_data, tmp_path / "stage2", max_steps=2, init_heads=str(out)))  # from trained heads
    assert MedusaModel.from_pretrained(tiny_model("llama", seed=1, vocab_size=49152), heads=stage2).config.draft_vocab == model.config.draft_vocab


def test_joint_training_leaves_out_answers_distill_reused(joint_data, real_base):
    """A reused answer (distill --reuse) trains neither heads nor adapter twice: its mask run is cleared, and the
    next answer keeps its own tokens and its own finished flag."""
    from medusa_heads.training.joint import _seqs

    _, tok = real_base
    conv = {"id": "c", "messages": [{"role": "user", "content": "Name a colour."},
                                     {"role": "assistant", "content": "Blue.", "reused": True},
                                     {"role": "user", "content": "And another one?"},
                                     {"role": "assistant", "content": "Red, and then gre", "finished": False}]}
    plain = {**conv, "messages": [{k: v for k, v in m.items() if k != "reused"} for m in conv["messages"]]}
    rec = joint_recipe(joint_data, "unused")
    (full,), _ = _seqs(rec, tok, [plain])
    (kept,), _ = _seqs(rec, tok, [conv])
    before = answer_segments("c", full.ids, full.mask, None, tok.eos_token_id, full.finished)
    after = answer_segments("c", kept.ids, kept.mask, None, tok.eos_token_id, kept.finished)
    assert len(before) == 2 and len(after) == 1 and torch.equal(after[0].tokens, before[1].tokens)
    start = int(full.mask.nonzero()[0])
    end = start + int((~full.mask[start:]).nonzero()[0])  # the first answer's run of the mask
    first = torch.zeros_like(full.mask)
    first[start:end] = True
    assert kept.finished == [False] and torch.equal(kept.mask, full.mask & ~first)
    conv["messages"][3]["reused"] = True  # nothing left to train on: said, not silently dropped
    with pytest.raises(ValueError, match="no answers to train on"):
        _seqs(rec, tok, [conv])


def test_joint_training_resumes_heads_and_adapter_exactly(joint_data, tmp_path, monkeypatch):
    full = train(joint_recipe(joint_data, tmp_path / "full", max_steps=6, save_every=2, eval_every=6))
    real_save, calls = trainer_mod.save_checkpoint, []

    def crash_after_second_checkpoint(*args, **kwargs):
        real_save(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt

    import medusa_heads.training.joint as joint_mod

    monkeypatch.setattr(joint_mod, "save_checkpoint", crash_after_second_checkpoint)
    with pytest.raises(KeyboardInterrupt):
        train(joint_recipe(joint_data, tmp_path / "cut", max_steps=6, save_every=2, eval_every=6))
    monkeypatch.setattr(joint_mod, "save_checkpoint", real_save)
    cut = train(joint_recipe(joint_data, tmp_path / "cut", max_steps=6, save_every=2, eval_every=6), resume=True)
    for name in ("heads.safetensors", "adapter/adapter_model.safetensors"):
        a, b = load_file(full / name), load_file(cut / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
