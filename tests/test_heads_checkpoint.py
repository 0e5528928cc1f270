"""Heads: own parameters, zero init, draft vocabulary; checkpoints round-trip bit for bit; bad input is refused."""
from __future__ import annotations

import json

import pytest
import torch

from medusa_heads import MedusaConfig, MedusaHeads, MedusaModel
from medusa_heads.checkpoint import load_heads, save_heads

from conftest import randomize_heads, tiny_model


def make_heads(**kw) -> MedusaHeads:
    cfg = MedusaConfig(num_heads=3, num_layers=2, hidden_size=8, vocab_size=20, **kw)
    return MedusaHeads(cfg, torch.randn(20, 8))


def test_no_two_heads_or_layers_share_a_tensor():
    heads = make_heads(own_lm_head=True)
    ptrs = [p.data_ptr() for p in heads.parameters()]
    assert len(ptrs) == len(set(ptrs)) == 3 * 2 * 2 + 3  # (weight, bias) per block, plus 3 own LM heads


def test_new_heads_start_as_the_base_lm_head():
    w = torch.randn(20, 8)
    heads = MedusaHeads(MedusaConfig(num_heads=2, hidden_size=8, vocab_size=20), w)
    h = torch.randn(5, 8)
    logits = heads(h)  # (K, 5, V)
    assert logits.shape == (2, 5, 20)
    torch.testing.assert_close(logits[0], h @ w.T)
    torch.testing.assert_close(logits[1], h @ w.T)
    assert heads.shared_weight.data_ptr() == w.data_ptr()  # referenced, not copied


def test_draft_vocabulary_maps_back_to_token_ids():
    w = torch.randn(20, 8)
    vocab = [3, 7, 11, 19]
    heads = MedusaHeads(MedusaConfig(num_heads=2, hidden_size=8, vocab_size=20, draft_vocab=vocab), w)
    h = torch.randn(8)
    top = heads.topk(h, 2)
    full = h @ w.T
    best = torch.tensor(vocab)[full[vocab].topk(2).indices]
    assert torch.equal(top[0], best)
    assert set(top.flatten().tolist()) <= set(vocab)


def test_bad_configs_name_the_problem():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        MedusaConfig(hidden_size=8, vocab_size=20, draft_vocab=[1, 20])
    with pytest.raises(ValueError, match="num_heads"):
        MedusaConfig(num_heads=0, hidden_size=8, vocab_size=20)
    with pytest.raises(ValueError, match="newer"):
        MedusaConfig(hidden_size=8, vocab_size=20, format_version=99)
    with pytest.raises(ValueError, match="unknown keys in heads config: medusa_x"):
        MedusaConfig.from_dict({"hidden_size": 8, "vocab_size": 20, "medusa_x": 1})
    with pytest.raises(ValueError, match=r"LM-head weight has shape \(20, 9\)"):
        MedusaHeads(MedusaConfig(hidden_size=8, vocab_size=20), torch.randn(20, 9))


@pytest.mark.parametrize("own", [False, True])
def test_checkpoint_round_trips_bit_for_bit(tmp_path, own):
    w = torch.randn(20, 8)
    heads = make_heads(own_lm_head=own, draft_vocab=[0, 5, 9])
    for p in heads.parameters():
        p.data.normal_()
    save_heads(tmp_path, heads)
    back = load_heads(tmp_path, w)
    assert back.config == heads.config
    a, b = heads.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoint_errors_name_keys_and_shapes(tmp_path):
    w = torch.randn(20, 8)
    save_heads(tmp_path, make_heads())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"missing keys \['blocks.0.2.linear.bias'"):
        load_heads(tmp_path, w)
    cfg["num_layers"], cfg["hidden_size"], cfg["vocab_size"] = 2, 4, 40
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"blocks.0.0.linear.bias has shape \(8,\), the config implies \(4,\)"):
        load_heads(tmp_path, torch.randn(40, 4))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_heads(tmp_path / "nope", w)


def test_model_save_and_load(tmp_path):
    base = tiny_model("llama")
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, num_heads=3, tree="cpu-8"))
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "heads.safetensors"]
    again = MedusaModel.from_pretrained(base, heads=tmp_path, draft_dtype=torch.float32)  # exactly as saved
    assert again.tree == model.tree
    ids = torch.tensor([[1, 2, 3]])
    saved, loaded = model.heads.state_dict(), again.heads.state_dict()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    torch.testing.assert_close(again.heads(torch.ones(32)), model.heads(torch.ones(32)))  # loaded: oneDNN kernels
    assert torch.equal(again.generate(ids, max_new_tokens=12), model.generate(ids, max_new_tokens=12))

    other = tiny_model("llama", seed=9)
    with pytest.raises(ValueError, match=r"another base model \(lm_head_sha256: heads [0-9a-f]{12}\.\.\., base [0-9a-f]{12}\.\.\.\)"):
        MedusaModel.from_pretrained(other, heads=tmp_path)
    MedusaModel.from_pretrained(other, heads=tmp_path, allow_base_mismatch=True)
    with pytest.raises(ValueError, match=r"heads expect vocab_size=96, hidden_size=32, but the base model's LM head is \(50, 32\)"):
        MedusaModel.from_pretrained(tiny_model("llama", vocab_size=50), heads=tmp_path)
    with pytest.raises(ValueError, match=r"heads expect vocab_size=96, hidden_size=32, but the base model's LM head is \(96, 16\)"):
        MedusaModel.from_pretrained(tiny_model("llama", hidden_size=16), heads=tmp_path)


def test_bad_generate_input():
    base = tiny_model("llama")
    model = MedusaModel.from_pretrained(base, heads=None, num_heads=2, tree=[[0], [0, 0]])
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="empty"):
        model.generate(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(ids, max_new_tokens=0)
    with pytest.raises(ValueError, match=r"\(batch, length\)"):
        model.generate(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="num_beams"):
        model.generate(ids, num_beams=4)
    with pytest.raises(TypeError, match="frobnicate"):
        model.generate(ids, frobnicate=True)
    with pytest.raises(ValueError, match="acceptance"):
        model.generate(ids, acceptance="fast")
    with pytest.raises(ValueError, match="do_sample=True"):
        model.generate(ids, acceptance="typical")
    with pytest.raises(ValueError, match=r"\[0, 0, 0\] has depth 3 but there are only 2 heads"):
        model.set_tree([[0], [0, 0], [0, 0, 0]])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        MedusaModel.from_pretrained(base, heads="/nonexistent/heads")
    with pytest.raises(ValueError, match="the prompt has 513 tokens, more than the model's context of 512"):
        model.generate(torch.ones(1, 513, dtype=torch.long), max_new_tokens=2)


@pytest.mark.parametrize("own", [False, True])
def test_reference_medusa_export_then_import_is_bit_exact(tmp_path, own):
    from medusa_heads.checkpoint import REFERENCE_WEIGHTS, export_reference

    base = tiny_model("llama")
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, num_heads=3, num_layers=2, own_lm_head=own, tree="cpu-8"))
    export_reference(model.heads, base.lm_head.weight, tmp_path, base_name="tiny")
    from safetensors.torch import load_file

    keys = set(load_file(tmp_path / REFERENCE_WEIGHTS))
    assert keys == {f"{k}.{j}.linear.{p}" for k in range(3) for j in range(2) for p in ("weight", "bias")} | {f"{k}.2.weight" for k in range(3)}
    back = MedusaModel.from_pretrained(base, heads=tmp_path, tree="cpu-8", draft_dtype=torch.float32)  # as saved
    assert back.config.own_lm_head == own  # a shared LM head is recognised by equality with the base's
    a, b = model.heads.state_dict(), back.heads.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.tensor([[3, 1, 4]])
    assert torch.equal(back.generate(ids, max_new_tokens=10), model.generate(ids, max_new_tokens=10))


def test_reference_medusa_import_checks_keys_and_shapes(tmp_path):
    from safetensors.torch import save_file

    base = tiny_model("llama")
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 1, "medusa_num_layers": 1}))
    save_file({"0.0.linear.weight": torch.zeros(32, 32), "0.0.linear.bias": torch.zeros(16), "0.1.weight": torch.zeros(96, 32)},
              tmp_path / "medusa_lm_head.safetensors")
    with pytest.raises(ValueError, match=r"0.0.linear.bias has shape \(16,\), the base model implies \(32,\)"):
        MedusaModel.from_pretrained(base, heads=tmp_path)


@pytest.mark.parametrize("condition", ["root", "path"])
def test_token_conditioned_heads_round_trip_and_refuse_the_reference_layout(tmp_path, condition):
    from medusa_heads.checkpoint import export_reference

    w, emb = torch.randn(20, 8), torch.randn(20, 8)
    cfg = MedusaConfig(num_heads=3, num_layers=1, hidden_size=8, vocab_size=20, condition=condition)
    heads = MedusaHeads(cfg, w, emb)
    for p in heads.parameters():
        p.data.normal_()
    assert sum(k.startswith("token_proj.") for k in heads.state_dict()) == (3 if condition == "root" else 6)
    save_heads(tmp_path, heads)
    back = load_heads(tmp_path, w, embed_weight=emb)
    a, b = heads.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the embeddings are not saved
    context = torch.tensor([[1, 2, 3], [4, 5, 6]])
    h = torch.randn(2, 8)
    assert torch.equal(back(h, context), heads(h, context))
    with pytest.raises(ValueError, match="input embeddings"):
        load_heads(tmp_path, w)
    with pytest.raises(ValueError, match=r"need context tokens of shape \(2, 1\)|need context tokens of shape \(2, 2\)"):
        heads(h, context[:, :0])
    with pytest.raises(ValueError, match="reference Medusa layout"):
        export_reference(heads, w, tmp_path / "ref")
    with pytest.raises(ValueError, match="condition must be one of"):
        MedusaConfig(hidden_size=8, vocab_size=20, condition="tokens")


def test_mlp_heads_start_as_the_base_lm_head_round_trip_and_refuse_the_reference_layout(tmp_path):
    from medusa_heads.checkpoint import export_reference

    w, emb = torch.randn(20, 8), torch.randn(20, 8)
    cfg = MedusaConfig(num_heads=2, num_layers=2, mlp_size=24, hidden_size=8, vocab_size=20, condition="path")
    heads = MedusaHeads(cfg, w, emb)
    h, context = torch.randn(5, 8), torch.randint(0, 20, (5, 2))
    torch.testing.assert_close(heads(h, context)[1], h @ w.T)  # zero W2 and token projections: the base LM head
    assert heads.blocks[0][0].up.weight.shape == (24, 8) and heads.blocks[0][0].up.weight.abs().sum() > 0
    for p in heads.parameters():
        p.data.normal_()
    save_heads(tmp_path, heads)
    back = load_heads(tmp_path, w, embed_weight=emb)
    a, b = heads.state_dict(), back.state_dict()
    assert sum(k.startswith("blocks.") for k in a) == 2 * 2 * 4  # (up, down) x (weight, bias) per block
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert back.config.mlp_size == 24 and torch.equal(back(h, context), heads(h, context))
    cfg.condition = "none"
    with pytest.raises(ValueError, match="mlp_size=24 have two-layer blocks"):
        export_reference(MedusaHeads(cfg, w), w, tmp_path / "ref")
    with pytest.raises(ValueError, match="mlp_size must be >= 0"):
        MedusaConfig(hidden_size=8, vocab_size=20, mlp_size=-1)


@pytest.mark.parametrize("prepacked", [False, True])
def test_drafting_projects_the_path_in_one_product_equal_to_the_per_slot_sum_and_follows_new_weights(prepacked):
    from medusa_heads.kernels.prepack import prepack_heads, prepack_supported

    if prepacked and not prepack_supported():
        pytest.skip("no oneDNN packed linear in this PyTorch build")
    w, emb = torch.randn(20, 8), torch.randn(20, 8)
    heads = MedusaHeads(MedusaConfig(num_heads=3, num_layers=1, hidden_size=8, vocab_size=20, condition="path"), w, emb)
    for p in heads.parameters():
        p.data.normal_()
    if prepacked:
        prepack_heads(heads)
    context, h = torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.randn(2, 8)
    seen = []
    for _ in range(1 if prepacked else 2):  # a packed copy serves the weights it was made from only (inference)
        per_slot = heads.hidden(h, context)  # grad mode: one projection per slot, as training runs them
        with torch.no_grad():
            joint = heads.hidden(h, context)  # drafting
        assert torch.allclose(joint, per_slot, atol=1e-5)
        seen.append(joint)
        with torch.no_grad():
            heads.token_proj[2][1].weight.mul_(3.0)  # a training step in place: the joint weight is built anew
    assert prepacked or not torch.allclose(seen[0][2], seen[1][2])  # and the second round saw the new weight
