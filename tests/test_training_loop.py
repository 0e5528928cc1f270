"""The shared training loop: `train` computes the features it lacks, and bad data files are said at once."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from medusa_heads.training import features as features_mod
from medusa_heads.corpus import read_conversations
from medusa_heads.shards import feature_ids, load_segments
from medusa_heads.training.features import features_from_conversations
from medusa_heads.training.recipe import TrainRecipe
from medusa_heads.training.trainer import train

from conftest import distilled_tiny_base


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """A tiny base with the real tokenizer, saved as an HF directory, and 8 answers it distilled, without features."""
    from transformers import AutoTokenizer

    from medusa_heads import default_model_path

    tok = AutoTokenizer.from_pretrained(default_model_path())
    root = tmp_path_factory.mktemp("distilled")
    base = distilled_tiny_base(root, tok, 2, [f"Count to {i}." for i in range(8)], max_new_tokens=16, batch_size=4)
    return root, base, tok


def recipe(root, out, **kw) -> TrainRecipe:
    return TrainRecipe(**{**dict(model=str(root / "base"), data=str(root / "d.jsonl"), features=str(out / "features"),
                                 out=str(out / "heads"), num_heads=2, draft_vocab_size=64, max_steps=4, batch_size=16,
                                 warmup_steps=1, eval_every=2, save_every=2, eval_fraction=0.2, tree="chain-4"), **kw})


def test_train_computes_the_features_it_lacks_and_keeps_those_it_has(distilled, tmp_path):
    root, base, tok = distilled
    convs = read_conversations(root / "d.jsonl")
    assert features_from_conversations(base, tok, convs[:3], tmp_path / "features") == 3
    before = {p.name: p.read_bytes() for p in (tmp_path / "features").iterdir()}
    out = train(recipe(root, tmp_path))
    assert (out / "heads.safetensors").is_file()
    assert feature_ids(tmp_path / "features") == {c["id"] for c in convs}
    assert all((tmp_path / "features" / name).read_bytes() == data for name, data in before.items())  # kept as they were
    ids = [s.id for s in load_segments(tmp_path / "features")]
    assert len(ids) == len(set(ids))  # none computed twice
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert log[0]["conversations"] == len(convs)


def test_features_resume_after_a_crash_without_redoing_what_was_written(distilled, tmp_path, monkeypatch):
    root, base, tok = distilled
    convs = read_conversations(root / "d.jsonl")
    real, calls = features_mod.answer_segments, []

    def crash_on_fourth(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(features_mod, "answer_segments", crash_on_fourth)
    with pytest.raises(KeyboardInterrupt):
        features_from_conversations(base, tok, convs, tmp_path / "f", per_shard=1)
    monkeypatch.setattr(features_mod, "answer_segments", real)
    assert len(feature_ids(tmp_path / "f")) == 3
    assert features_from_conversations(base, tok, convs, tmp_path / "f", per_shard=1) == len(convs) - 3
    assert feature_ids(tmp_path / "f") == {c["id"] for c in convs}


def test_a_missing_or_empty_data_file_is_said_before_any_work(distilled, tmp_path):
    root, _, _ = distilled
    with pytest.raises(FileNotFoundError, match="nothing.jsonl"):
        train(recipe(root, tmp_path, data=str(tmp_path / "nothing.jsonl")))
    with pytest.raises(FileNotFoundError, match="nothing.jsonl"):  # joint training reads its data the same way
        train(recipe(root, tmp_path, data=str(tmp_path / "nothing.jsonl"), lora_rank=2))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl holds no conversations"):
        train(recipe(root, tmp_path, data=str(tmp_path / "empty.jsonl")))
    assert not (tmp_path / "heads").exists()


def test_joint_training_does_not_import_the_feature_trainer():
    code = ("import sys, medusa_heads.training.joint, medusa_heads.training.loop; "
            "assert 'medusa_heads.training.trainer' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_resumed_features_equal_those_computed_in_one_go(distilled, tmp_path):
    root, base, tok = distilled
    convs = read_conversations(root / "d.jsonl")
    features_from_conversations(base, tok, convs[:5], tmp_path / "parts", per_shard=2)
    features_from_conversations(base, tok, convs, tmp_path / "parts", per_shard=2)
    features_from_conversations(base, tok, convs, tmp_path / "whole")
    parts = {s.id: s for s in load_segments(tmp_path / "parts")}
    whole = {s.id: s for s in load_segments(tmp_path / "whole")}
    assert parts.keys() == whole.keys()
    assert all(torch.equal(parts[k].hidden, whole[k].hidden) and torch.equal(parts[k].tokens, whole[k].tokens) for k in whole)
