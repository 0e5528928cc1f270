"""The vLLM plugin (vllm_plugin/): an export read back by the plugin's draft model proposes exactly the chain our
decoder drafts with the same heads (root = the target's argmax, then head k reading the tokens above it), for every
head shape we train; and the export refuses nothing it should serve. The plugin's model is plain torch, so this runs
without vLLM; make test-vllm runs it inside vLLM."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from medusa_heads import MedusaModel
from medusa_heads.checkpoint import CONFIG_NAME, PLUGIN_ARCHITECTURE, VLLM_WEIGHTS, export_vllm_plugin

from conftest import randomize_heads, tiny_model
from test_cli import run

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "vllm_plugin"))
from medusa_heads_vllm.heads import DraftHeads  # noqa: E402

VOCAB = [1, 4, 9, 16, 25, 36, 49, 64, 81, 90]

SHAPES = {  # every head shape we train: condition x block x vocabulary x LM head
    "medusa-1": dict(condition="none", mlp_size=0),
    "root-mlp": dict(condition="root", mlp_size=48),
    "path-mlp-draft-vocab": dict(condition="path", mlp_size=48, draft_vocab=VOCAB),
    "path-square-own-head": dict(condition="path", mlp_size=0, own_lm_head=True),
    "path-own-head-draft-vocab": dict(condition="path", mlp_size=48, own_lm_head=True, draft_vocab=VOCAB),
    "none-two-layers-draft-vocab": dict(condition="none", mlp_size=0, num_layers=2, draft_vocab=VOCAB),
}


def our_chain(model: MedusaModel, hidden: torch.Tensor) -> torch.Tensor:
    """(N, H) -> (N, K): the top-1 chain our decoder drafts from these hidden states (a chain-K tree's nodes)."""
    root = model.target.lm_head(hidden).argmax(-1)
    cfg, tokens = model.heads.config, [root]
    for k in range(cfg.num_heads):
        context = torch.stack(tokens, -1) if cfg.context_size else None
        if context is not None and context.shape[-1] < cfg.context_size:
            context = torch.cat([context, context[:, :1].expand(-1, cfg.context_size - context.shape[-1])], -1)
        tokens.append(model.heads.head_topk(k, hidden, 1, context=context)[..., 0])
    return torch.stack(tokens[1:], -1)


def plugin(directory: Path) -> DraftHeads:
    cfg = json.loads((directory / CONFIG_NAME).read_text())
    heads = DraftHeads(cfg["medusa_heads"], cfg["hidden_size"], cfg["vocab_size"])
    heads.load_state(load_file(directory / VLLM_WEIGHTS).items())
    return heads


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_plugin_drafts_our_chain(shape, tied, tmp_path):
    base = tiny_model("llama", tie_word_embeddings=tied)
    kw = dict(num_heads=3, num_layers=1) | SHAPES[shape]
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, tree=[[0], [0, 0], [0, 0, 0]], draft_dtype=torch.float32, **kw))
    export_vllm_plugin(model.heads, base, tmp_path, base_name="tiny")
    cfg = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert cfg["architectures"] == [PLUGIN_ARCHITECTURE] and cfg["model_type"] == "medusa"
    assert cfg["medusa_num_heads"] == 3 and cfg["medusa_heads"]["tied_embeddings"] == tied
    assert ("embed_tokens.weight" in load_file(tmp_path / VLLM_WEIGHTS)) == (not tied and kw["condition"] != "none")
    draft = plugin(tmp_path)
    hidden = torch.randn(300, 32) * 3
    with torch.no_grad():
        ours = our_chain(model, hidden)
        logits = draft.full_vocab(draft.draft(hidden))
    theirs = torch.stack([x.argmax(-1) for x in logits], -1)  # what vLLM's MedusaProposer takes
    assert torch.equal(theirs, ours)
    assert len({t for t in ours.flatten().tolist()}) > 3  # varied drafts: the comparison can fail
    if "draft_vocab" in kw:
        assert set(theirs.flatten().tolist()) <= set(VOCAB)
    draft.heads = 2  # num_speculative_tokens 2: the first two heads, the same tokens
    with torch.no_grad():
        assert torch.equal(torch.stack([x.argmax(-1) for x in draft.full_vocab(draft.draft(hidden))], -1), ours[:, :2])


def test_a_wrong_draft_is_refused_with_the_cause(tmp_path):
    base = tiny_model("llama")
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, num_heads=2, condition="path", mlp_size=48))
    export_vllm_plugin(model.heads, base, tmp_path)
    cfg = json.loads((tmp_path / CONFIG_NAME).read_text())
    state = load_file(tmp_path / VLLM_WEIGHTS)
    with pytest.raises(ValueError, match=r"blocks\.0\.0\.(up|down)\.weight has shape"):
        DraftHeads(cfg["medusa_heads"] | {"mlp_size": 40}, 32, 96).load_state(state.items())
    with pytest.raises(ValueError, match="which these heads do not have"):
        DraftHeads(cfg["medusa_heads"] | {"condition": "none"}, 32, 96).load_state(state.items())
    with pytest.raises(ValueError, match="lacks"):
        DraftHeads({"num_heads": 2}, 32, 96)


def test_cli_exports_any_heads_for_the_plugin_and_medusa_1_heads_for_stock_vllm(tmp_path, capsys):
    base = tiny_model("llama")
    base.save_pretrained(tmp_path / "base")
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, num_heads=2, condition="path", mlp_size=48))
    model.save_pretrained(tmp_path / "heads")
    args = ["export", str(tmp_path / "heads"), "--model", str(tmp_path / "base")]
    assert run([*args[:2], str(tmp_path / "plugin"), *args[2:], "--format", "vllm"], capsys)[0] == 0
    assert plugin(tmp_path / "plugin").condition == "path"
    code, err = run([*args[:2], str(tmp_path / "stock"), *args[2:], "--format", "vllm-stock"], capsys)
    assert code == 1 and 'condition="path"' in err and not (tmp_path / "stock" / VLLM_WEIGHTS).exists()


@pytest.mark.real
def test_the_plugin_drafts_our_chain_with_the_shipped_heads(real_base, tmp_path):
    """The shipped heads, exported for the plugin: on the target's own hidden states of a real answer, the plugin
    proposes the chain our chain-4 decoder drafts (both in fp32), and drafts only inside the draft vocabulary."""
    from conftest import chat_ids

    base, tok = real_base
    model = MedusaModel.from_pretrained(base, heads="auto", tree="chain-4", prepack=False, draft_dtype=torch.float32)
    export_vllm_plugin(model.heads, base, tmp_path, base_name="smollm2-135m-instruct")
    prompt = chat_ids(tok, "Explain in three sentences why the sky is blue.")
    ids = base.generate(prompt, max_new_tokens=48, do_sample=False)
    with torch.no_grad():
        hidden = base.model(ids).last_hidden_state[0]  # (L, H): the states vLLM hands its drafter
        ours = our_chain(model, hidden)
        draft = plugin(tmp_path)
        theirs = torch.stack([x.argmax(-1) for x in draft.full_vocab(draft.draft(hidden))], -1)
    assert torch.equal(theirs, ours)
    assert set(theirs.unique().tolist()) <= set(model.heads.config.draft_vocab)
    p = prompt.shape[1] - 1  # from the last prompt position on, head 1 guesses the answer's next-but-one token
    assert (theirs[p:-2, 0] == ids[0, p + 2:]).float().mean() > 0.15  # 0.26 measured


def test_a_draft_root_in_bf16_drafts_our_chain_where_the_root_is_in_the_draft_vocabulary(tmp_path):
    """root="draft": the root is the best draft-vocabulary row; where the target's own token is one of them the chain
    is ours (bf16 heads: up to rounding at near-ties), elsewhere it starts from another root."""
    base = tiny_model("llama")
    vocab = list(range(0, 96, 2))  # half the tokens
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, num_heads=3, condition="path", mlp_size=48,
                                                        draft_vocab=vocab, tree=[[0], [0, 0], [0, 0, 0]]))
    export_vllm_plugin(model.heads, base, tmp_path, root="draft", draft_dtype="float32")
    draft = plugin(tmp_path)
    hidden = torch.randn(400, 32) * 3
    with torch.no_grad():
        ours = our_chain(model, hidden)
        theirs = torch.stack([x.argmax(-1) for x in draft.full_vocab(draft.draft(hidden))], -1)
        inside = torch.isin(base.lm_head(hidden).argmax(-1), torch.tensor(vocab))
    assert 0.2 < inside.float().mean() < 0.8
    assert torch.equal(theirs[inside], ours[inside])
    assert not torch.equal(theirs[~inside], ours[~inside])  # the root matters: a test of it can fail
    export_vllm_plugin(model.heads, base, tmp_path / "bf16", root="draft", draft_dtype="bfloat16")
    draft = plugin(tmp_path / "bf16")
    with torch.no_grad():
        bf16 = torch.stack([x.argmax(-1) for x in draft.full_vocab(draft.draft(hidden))], -1)
    assert draft.blocks[0][0].up.weight.dtype == torch.bfloat16
    assert (bf16[inside] == ours[inside]).float().mean() > 0.9
