"""`export --format vllm-stock`: what vLLM 0.32's Medusa reads (names, medusa_fc_bias, token_map, original_lm_head), read
back the way vLLM computes its drafts; heads vLLM cannot run and broken exports are refused with the cause."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from medusa_heads import MedusaConfig, MedusaHeads, MedusaModel
from medusa_heads.checkpoint import CONFIG_NAME, VLLM_WEIGHTS, check_vllm_export, export_vllm, save_heads
from medusa_heads.cli import main

from conftest import randomize_heads, tiny_model

VOCAB = [1, 4, 9, 16, 25, 36, 49, 64, 81, 90]  # a draft vocabulary of the tiny models' 96 tokens


def vllm_drafts(directory, hidden: torch.Tensor) -> torch.Tensor:
    """(N, H) -> (N, K): the chain vLLM 0.32 proposes from an export, computed as vllm/model_executor/models/medusa.py
    does: x + SiLU(W x + b) per layer (b only with medusa_fc_bias), the LM head (one shared with original_lm_head),
    logits over truncated_vocab_size rows scattered into -inf over the full vocabulary at token_map, argmax."""
    cfg = json.loads((directory / CONFIG_NAME).read_text())
    state = {k: t.float() if t.is_floating_point() else t for k, t in load_file(directory / VLLM_WEIGHTS).items()}
    v, rows = cfg["vocab_size"], cfg["truncated_vocab_size"]
    token_map = state.get("token_map") if rows < v else None
    drafts = []
    for k in range(cfg["medusa_num_heads"]):
        x = hidden
        for j in range(cfg["medusa_num_layers"]):
            bias = state[f"blocks.{k}.layers.{j}.bias"] if cfg.get("medusa_fc_bias", False) else None
            x = x + F.silu(F.linear(x, state[f"blocks.{k}.layers.{j}.weight"], bias))
        lm = state["lm_head.weight"] if cfg.get("original_lm_head", False) else state[f"lm_heads.{k}.weight"]
        logits = (x @ lm.T)[..., :rows]
        if token_map is not None:
            full = torch.full((*logits.shape[:-1], v), -torch.inf)
            full[..., token_map] = logits
            logits = full
        drafts.append(logits.argmax(-1))
    return torch.stack(drafts, dim=1)


def trained_like(**kw) -> tuple[MedusaModel, torch.nn.Module]:
    base = tiny_model("llama")
    return randomize_heads(MedusaModel.from_pretrained(base, heads=None, num_heads=3, num_layers=2, tree=[[0], [0, 0], [0, 0, 0]], **kw)), base


def test_export_shares_the_truncated_lm_head_and_vllm_drafts_only_inside_the_token_map(tmp_path):
    model, base = trained_like(draft_vocab=VOCAB)
    export_vllm(model.heads, base.lm_head.weight, tmp_path, base_name="tiny")
    cfg = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert cfg["medusa_fc_bias"] is True and cfg["original_lm_head"] is True
    assert (cfg["vocab_size"], cfg["truncated_vocab_size"], cfg["medusa_num_heads"], cfg["medusa_num_layers"]) == (96, 10, 3, 2)
    state = load_file(tmp_path / VLLM_WEIGHTS)
    assert state["token_map"].dtype == torch.long and state["token_map"].tolist() == VOCAB
    assert torch.equal(state["lm_head.weight"], base.lm_head.weight.detach()[VOCAB])  # only the draft rows
    assert torch.equal(state["blocks.2.layers.1.bias"], model.heads.blocks[2][1].linear.bias.detach())
    hidden = torch.randn(200, 32) * 3
    drafts = vllm_drafts(tmp_path, hidden)
    assert set(drafts.unique().tolist()) <= set(VOCAB)
    assert len(drafts.unique()) > 3  # varied drafts, not one token
    assert torch.equal(drafts, model.heads.topk(hidden, 1)[..., 0].T)  # vLLM's chain is our heads' top-1 chain


def test_biases_change_the_drafts_so_medusa_fc_bias_matters(tmp_path):
    model, base = trained_like(draft_vocab=VOCAB)
    export_vllm(model.heads, base.lm_head.weight, tmp_path)
    hidden = torch.randn(200, 32) * 3
    with_bias = vllm_drafts(tmp_path, hidden)
    cfg = json.loads((tmp_path / CONFIG_NAME).read_text())
    (tmp_path / CONFIG_NAME).write_text(json.dumps({**cfg, "medusa_fc_bias": False}))
    assert not torch.equal(vllm_drafts(tmp_path, hidden), with_bias)  # what vLLM ran before this export set the flag
    with pytest.raises(ValueError, match=r"vLLM would ignore \['blocks.0.layers.0.bias'"):
        check_vllm_export(tmp_path)


def test_own_lm_heads_over_the_whole_vocabulary_export_without_a_token_map(tmp_path):
    model, base = trained_like(own_lm_head=True)
    export_vllm(model.heads, base.lm_head.weight, tmp_path)
    cfg = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert cfg["original_lm_head"] is False and cfg["truncated_vocab_size"] == cfg["vocab_size"] == 96
    state = load_file(tmp_path / VLLM_WEIGHTS)
    assert "token_map" not in state and "lm_head.weight" not in state
    assert torch.equal(state["lm_heads.1.weight"], model.heads.lm_heads[1].weight.detach())
    hidden = torch.randn(50, 32) * 3
    assert torch.equal(vllm_drafts(tmp_path, hidden), model.heads.topk(hidden, 1)[..., 0].T)


@pytest.mark.parametrize("kw, cause", [
    (dict(condition="path"), r'condition="path" read the tokens above each node, but vLLM\'s Medusa reads the hidden state only'),
    (dict(condition="root"), r'condition="root" read the tokens above each node'),
    (dict(mlp_size=24), r"mlp_size=24 have H -> 24 -> H blocks, but vLLM's Medusa runs square blocks"),
    (dict(own_lm_head=True, draft_vocab=VOCAB), r"vLLM 0.32 truncates only a shared LM head"),
])
def test_heads_vllm_cannot_run_are_refused_with_the_cause(tmp_path, kw, cause):
    w, emb = torch.randn(96, 32), torch.randn(96, 32)
    heads = MedusaHeads(MedusaConfig(num_heads=2, hidden_size=32, vocab_size=96, **kw), w, emb)
    with pytest.raises(ValueError, match=cause):
        export_vllm(heads, w, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_token_map_that_is_not_the_draft_vocabulary_is_refused(tmp_path):
    model, base = trained_like(draft_vocab=VOCAB)
    export_vllm(model.heads, base.lm_head.weight, tmp_path)
    state = load_file(tmp_path / VLLM_WEIGHTS)
    for bad, cause in [
        (torch.tensor(VOCAB[:-1] + [1]), "must hold 10 distinct token ids"),
        (torch.tensor(VOCAB[:-1] + [96]), r"must hold 10 distinct token ids in \[0, 96\)"),
        (torch.tensor(VOCAB[:-1]), r"token_map has shape \(9,\), the config implies \(10,\)"),
        (torch.tensor(VOCAB, dtype=torch.int32), "token_map must be int64"),
        (torch.tensor(VOCAB[1:] + [0]), "rows are not the base LM head's rows at token_map"),
    ]:
        save_file({**state, "token_map": bad}, tmp_path / VLLM_WEIGHTS)
        with pytest.raises(ValueError, match=cause):
            check_vllm_export(tmp_path, base.lm_head.weight)


def test_export_command_refuses_path_heads_and_heads_of_another_base(tmp_path):
    base = tiny_model("llama")
    base.save_pretrained(tmp_path / "base")
    other = tiny_model("llama", seed=1)
    ok = MedusaModel.from_pretrained(other, heads=None, num_heads=2, draft_vocab=VOCAB, tree=[[0], [0, 0]])
    save_heads(tmp_path / "other", ok.heads)
    with pytest.raises(SystemExit, match="medusa-heads export: these heads were trained for another base model"):
        main(["export", "--format", "vllm-stock", "--model", str(tmp_path / "base"), str(tmp_path / "other"), str(tmp_path / "o1")])
    path_heads = MedusaModel.from_pretrained(base, heads=None, num_heads=2, condition="path", tree=[[0], [0, 0]])
    save_heads(tmp_path / "path", path_heads.heads)
    with pytest.raises(SystemExit, match='medusa-heads export: heads with condition="path" .* export them with --format vllm for the project.s vLLM plugin'):
        main(["export", "--format", "vllm-stock", "--model", str(tmp_path / "base"), str(tmp_path / "path"), str(tmp_path / "o2")])
    good = randomize_heads(MedusaModel.from_pretrained(base, heads=None, num_heads=2, draft_vocab=VOCAB, tree=[[0], [0, 0]]))
    save_heads(tmp_path / "good", good.heads)
    main(["export", "--format", "vllm-stock", "--model", str(tmp_path / "base"), str(tmp_path / "good"), str(tmp_path / "o3")])
    assert check_vllm_export(tmp_path / "o3", base.lm_head.weight)["truncated_vocab_size"] == len(VOCAB)
    hidden = torch.randn(20, 32)
    assert torch.equal(vllm_drafts(tmp_path / "o3", hidden), good.heads.topk(hidden, 1)[..., 0].T)


def test_default_heads_path_kinds():
    from medusa_heads import default_heads_path

    assert default_heads_path().name == "default_heads" and default_heads_path("tree") == default_heads_path()
    with pytest.raises(ValueError, match='the "serving" heads are no longer shipped: vLLM serves the shipped heads'):
        default_heads_path("serving")
    with pytest.raises(ValueError, match="heads kind must be one of tree, got 'medusa'"):
        default_heads_path("medusa")
