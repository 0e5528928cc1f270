"""Heads for vLLM: in the layout vLLM's own Medusa reads (export_vllm, check_vllm_export), or for the project's vLLM
plugin, which serves any heads (export_vllm_plugin). Both write config.json + model.safetensors and read them back."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from medusa_heads.checkpoint import CONFIG_NAME, _atomic_write
from medusa_heads.config import MedusaConfig
from medusa_heads.heads import MedusaHeads


# ---- vLLM's Medusa (vllm/model_executor/models/medusa.py, 0.32) ----------------------------------------------------
# vLLM runs Medusa-1 heads: head k is x + SiLU(W x + b) repeated num_hidden_layers times over the target's final
# hidden state, then an LM head; it proposes each head's top-1 token (a chain, no tree). Its config (MedusaConfig,
# vllm/transformers_utils/configs/medusa.py) renames keys holding "num" + "heads"/"layers"; the linears have a bias only
# with medusa_fc_bias; a draft vocabulary is truncated_vocab_size + a "token_map" tensor (draft row -> token id), and
# vLLM fills -inf outside it, so drafts stay inside the map; original_lm_head: one LM head shared by every head.
# vLLM resets truncated_vocab_size when vocab_size differs from the target's, so vocab_size is always the base's.
VLLM_WEIGHTS = "model.safetensors"
SERVING_RECIPE = "configs/train/smollm2-135m-serving.yaml"


def vllm_exportable(config: MedusaConfig) -> None:
    """Raise a one-line ValueError when vLLM's Medusa cannot run these heads, saying what to train instead."""
    train = (f"export them with --format vllm for the project's vLLM plugin (vllm_plugin/), which serves any heads, or "
             f"train Medusa-1 heads (condition: none, mlp_size: 0; e.g. {SERVING_RECIPE})")
    if config.condition != "none":
        raise ValueError(f'heads with condition="{config.condition}" read the tokens above each node, '
                         f"but vLLM's Medusa reads the hidden state only; {train}")
    if config.mlp_size:
        raise ValueError(f"heads with mlp_size={config.mlp_size} have H -> {config.mlp_size} -> H blocks, "
                         f"but vLLM's Medusa runs square blocks x + SiLU(W x + b) only; {train}")
    if config.own_lm_head and config.draft_vocab is not None:
        raise ValueError("heads with their own LM heads over a draft vocabulary: vLLM 0.32 truncates only a shared "
                         "LM head (original_lm_head); train heads that share the base LM head (own_lm_head: false)")


def export_vllm(heads: MedusaHeads, lm_head_weight: torch.Tensor, out: str | os.PathLike, base_name: str = "") -> Path:
    """Write heads as vLLM 0.32 reads them in full: config.json + model.safetensors under vLLM's parameter names
    (blocks.{k}.layers.{j}.weight/bias; lm_head.weight when shared, else lm_heads.{k}.weight), medusa_fc_bias, and a
    draft vocabulary as truncated_vocab_size + token_map with only its LM-head rows."""
    cfg = heads.config
    vllm_exportable(cfg)
    v, h = lm_head_weight.shape
    if (v, h) != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(f"heads expect an LM head of ({cfg.vocab_size}, {cfg.hidden_size}), the base's is {(v, h)}")
    state = {}
    for k in range(cfg.num_heads):
        for j in range(cfg.num_layers):
            block = heads.blocks[k][j].linear
            state[f"blocks.{k}.layers.{j}.weight"], state[f"blocks.{k}.layers.{j}.bias"] = block.weight, block.bias
    token_map = None if cfg.draft_vocab is None else torch.tensor(cfg.draft_vocab, dtype=torch.long)
    if cfg.own_lm_head:
        for k in range(cfg.num_heads):
            state[f"lm_heads.{k}.weight"] = heads.lm_heads[k].weight
    else:
        rows = lm_head_weight.detach().to("cpu")
        state["lm_head.weight"] = rows if token_map is None else rows[token_map]  # (V', H)
    dtype = heads.blocks[0][0].linear.weight.dtype if cfg.num_layers else lm_head_weight.dtype
    state = {key: t.detach().to(device="cpu", dtype=dtype).contiguous().clone() for key, t in state.items()}
    if token_map is not None:
        state["token_map"] = token_map
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _atomic_write(out / VLLM_WEIGHTS, lambda p: save_file(state, p, metadata={"format": "pt"}))
    config = {
        "model_type": "medusa", "architectures": ["MedusaModel"],
        "medusa_num_heads": cfg.num_heads, "medusa_num_layers": cfg.num_layers,
        "hidden_size": h, "vocab_size": v, "truncated_vocab_size": v if token_map is None else len(token_map),
        "medusa_fc_bias": cfg.num_layers > 0, "original_lm_head": not cfg.own_lm_head,
        "base_model_name_or_path": base_name, "torch_dtype": str(dtype).removeprefix("torch."),
    }
    _atomic_write(out / CONFIG_NAME, lambda p: Path(p).write_text(json.dumps(config, indent=1) + "\n"))
    check_vllm_export(out, lm_head_weight)
    return out


def check_vllm_export(directory: str | os.PathLike, lm_head_weight: torch.Tensor | None = None) -> dict:
    """Read an export back as vLLM would and check it: every key vLLM has a parameter for and no other, shapes,
    medusa_fc_bias set when biases are present, and a token_map that is exactly the draft vocabulary (distinct ids
    inside the base vocabulary, one per LM-head row; with `lm_head_weight`, those rows are the base's). Returns the
    config."""
    d = Path(directory)
    config = json.loads((d / CONFIG_NAME).read_text())
    state = load_file(d / VLLM_WEIGHTS)
    k_heads, layers, h, v = (config[key]
                             for key in ("medusa_num_heads", "medusa_num_layers", "hidden_size", "vocab_size"))
    rows = config["truncated_vocab_size"]
    shared = config.get("original_lm_head", False)
    expected = {f"blocks.{k}.layers.{j}.weight": (h, h) for k in range(k_heads) for j in range(layers)}
    if config.get("medusa_fc_bias", False):
        expected |= {f"blocks.{k}.layers.{j}.bias": (h,) for k in range(k_heads) for j in range(layers)}
    expected |= {"lm_head.weight": (rows, h)} if shared else {f"lm_heads.{k}.weight": (v, h) for k in range(k_heads)}
    if rows < v:
        expected["token_map"] = (rows,)
    if set(state) != set(expected):
        raise ValueError(f"{d / VLLM_WEIGHTS}: vLLM would ignore {sorted(set(state) - set(expected))} and miss "
                         f"{sorted(set(expected) - set(state))} (check medusa_fc_bias and truncated_vocab_size)")
    for key, shape in expected.items():
        if tuple(state[key].shape) != shape:
            raise ValueError(f"{d / VLLM_WEIGHTS}: {key} has shape {tuple(state[key].shape)}, "
                             f"the config implies {shape}")
    if rows < v:
        if not shared:
            raise ValueError(f"{d / CONFIG_NAME}: a token_map needs original_lm_head "
                             "(vLLM 0.32 truncates a shared LM head only)")
        tmap = state["token_map"]
        if tmap.dtype != torch.long:
            raise ValueError(f"{d / VLLM_WEIGHTS}: token_map must be int64 token ids, got {tmap.dtype}")
        if len(set(tmap.tolist())) != rows or int(tmap.min()) < 0 or int(tmap.max()) >= v:
            raise ValueError(f"{d / VLLM_WEIGHTS}: token_map must hold {rows} distinct token ids in [0, {v})")
        if lm_head_weight is not None:
            want = lm_head_weight.detach().to("cpu")[tmap].to(state["lm_head.weight"].dtype)
            if not torch.equal(state["lm_head.weight"], want):
                raise ValueError(f"{d / VLLM_WEIGHTS}: lm_head.weight rows are not the base LM head's rows "
                                 "at token_map")
    return config


# ---- the project's vLLM plugin (vllm_plugin/, package medusa-heads-vllm) -------------------------------------------
# Any heads this project trains, for the draft architecture the plugin registers: vLLM's MedusaProposer builds it
# from config.json's "architectures", so model_type stays "medusa". The heads' own key names, plus the target's LM
# head (the root token, and the rows a shared LM head scores through), its input embeddings where conditioned heads
# read tokens and they are not the LM head, and the draft vocabulary. No key of config.json's top level may hold
# "num" beside "heads"/"layers" other than medusa_num_heads: vLLM's MedusaConfig renames such keys.
PLUGIN_ARCHITECTURE = "MedusaHeadsDraft"
PLUGIN_FORMAT = 1


def export_vllm_plugin(heads: MedusaHeads, base: PreTrainedModel, out: str | os.PathLike, base_name: str = "",
                       root: str = "exact", draft_dtype: str | None = None) -> Path:
    """Write config.json + model.safetensors for the vLLM plugin (every head shape), then read them back.
    root: "exact" (the whole LM head finds the root token) or "draft" (its draft-vocabulary rows: cheaper, wrong where
    the target's token is outside the draft vocabulary); draft_dtype: the heads' dtype in vLLM (None: the engine's)."""
    if root not in ("exact", "draft"):
        raise ValueError(f"root must be exact or draft, got {root!r}")
    if draft_dtype not in (None, "bfloat16", "float16", "float32"):
        raise ValueError(f"draft_dtype must be bfloat16, float16 or float32, got {draft_dtype!r}")
    cfg = heads.config
    lm = base.get_output_embeddings().weight.detach()
    embed = base.get_input_embeddings().weight.detach()
    if tuple(lm.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(f"heads expect an LM head of ({cfg.vocab_size}, {cfg.hidden_size}), "
                         f"the base's is {tuple(lm.shape)}")
    tied = embed.shape == lm.shape and (embed.data_ptr() == lm.data_ptr() or torch.equal(embed, lm))
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in heads.state_dict().items()}
    state["lm_head.weight"] = lm.to("cpu").contiguous().clone()
    if cfg.context_size and not tied:
        state["embed_tokens.weight"] = embed.to("cpu").contiguous().clone()
    if cfg.draft_vocab is not None:
        state["draft_vocab"] = torch.tensor(cfg.draft_vocab, dtype=torch.long)
    spec = {"format": PLUGIN_FORMAT, "num_heads": cfg.num_heads, "num_layers": cfg.num_layers, "mlp_size": cfg.mlp_size,
            "condition": cfg.condition, "own_lm_head": cfg.own_lm_head, "draft_vocab_size": cfg.draft_vocab_size,
            "tied_embeddings": bool(tied), "root": root, "draft_dtype": draft_dtype}
    config = {"model_type": "medusa", "architectures": [PLUGIN_ARCHITECTURE], "medusa_num_heads": cfg.num_heads,
              "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "truncated_vocab_size": cfg.vocab_size,
              "medusa_heads": spec, "base_model_name_or_path": base_name,
              "torch_dtype": str(state["lm_head.weight"].dtype).removeprefix("torch.")}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _atomic_write(out / VLLM_WEIGHTS, lambda p: save_file(state, p, metadata={"format": "pt"}))
    _atomic_write(out / CONFIG_NAME, lambda p: Path(p).write_text(json.dumps(config, indent=1) + "\n"))
    back = load_file(out / VLLM_WEIGHTS)
    if set(back) != set(state) or any(not torch.equal(back[k], state[k]) for k in state):
        raise ValueError(f"{out / VLLM_WEIGHTS}: read back differs from what was written")
    return out
