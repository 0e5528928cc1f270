"""MedusaModel: an unmodified transformers causal LM plus Medusa heads, with a lossless generate."""
from __future__ import annotations

import copy
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import nn
from transformers import AutoConfig, GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from medusa_heads.calibration.machine import local_cost
from medusa_heads.checkpoint import (
    base_fingerprint, check_fingerprint, is_reference_dir, load_config, load_heads, load_ngrams, load_reference,
    save_heads, save_ngrams,
)
from medusa_heads.config import MedusaConfig
from medusa_heads.heads import MedusaHeads
from medusa_heads.inference.adaptive import AdaptiveDrafter, DraftObserver
from medusa_heads.inference.batch import decode_batch
from medusa_heads.inference.decode import DecodeStats, decode
from medusa_heads.kernels.exactness import has_attention_sinks, promises_exact
from medusa_heads.kernels.exact_attention import (register as register_exact_attention, rows_invariant,
                                                  uses_exact_attention)
from medusa_heads.kernels.int8 import int8_rows_invariant, int8_supported, quantize_linears
from medusa_heads.inference.plan import ADAPTIVE, Drafting, check_tree, make_plan, tree_buffers
from medusa_heads.inference.propose import MAX_NGRAM, Drafter
from medusa_heads.kernels.draft_int8 import INT8, draft_int8_supported, int8_heads
from medusa_heads.kernels.prepack import (bf16_supported, is_prepacked, packs, prepack_heads, prepack_linears,
                                          prepack_supported)
from medusa_heads.engines.hf_probes import check_tree_attention, exactness_problem
from medusa_heads.engines.base import Engine
from medusa_heads.engines.hf import Target
from medusa_heads.engines.llamacpp import open_gguf
from medusa_heads.default_model import DEFAULT_MODEL, default_heads_path
from medusa_heads import generate_args, prompting
from medusa_heads.loading import load_base, source
from medusa_heads.tree import TreeSpec, TreeBuffers, load_tree
from medusa_heads.tree.adaptive import Acceptance, CostModel, LookupAcceptance, PhraseAcceptance
from medusa_heads.tree.ngrams import NgramStore


@dataclass
class MedusaGenerateOutput:
    sequences: torch.Tensor  # (B, prompt + new); finished rows padded with pad_token_id
    stats: DecodeStats


class MedusaModel(nn.Module):
    def __init__(self, base_model: PreTrainedModel, heads: MedusaHeads,
                 tree: str | Sequence[Sequence[int]] | TreeSpec | None = None, phrases: NgramStore | None = None,
                 engine: Engine | None = None) -> None:
        super().__init__()
        self.base_model = base_model
        self.heads = heads
        self.config = heads.config
        self.phrases = phrases  # the target's phrasebook (tree/ngrams.py): drafts beside the heads where calibrated
        self.target = Target(base_model)
        self.engine: Engine = self.target if engine is None else engine  # what runs the target's forwards
        # greedy output is the model's plain decoding bit for bit, checked on this model (bf16 or int8 on a CPU)
        self.exact = False
        if self.engine is self.target:  # the 4D-mask probe; llama.cpp masks by sequences (engines/llamacpp.py)
            check_tree_attention(self.target)
        if self.engine is self.target and promises_exact(base_model):
            problem = exactness_problem(self.target)
            self.exact = problem is None
            if problem:
                warnings.warn(f"{type(base_model).__name__}: greedy output may leave this model's plain decoding at "
                              f"near-ties of the top two tokens: {problem}", UserWarning, stacklevel=3)
        self._drafting: dict[tuple, tuple] = {}  # (kernels, threads) -> (config.adaptive read, its parts, origin)
        self.tree = self._configured_tree()  # the heads' fixed tree: what a call drafts when no per-step tree can be
        # what a call drafts when it names no tree: "adaptive" where the heads were calibrated for these kernels
        self.default_tree = ADAPTIVE if tree is None and self.cost_model() is not None else self.tree
        if tree is not None:
            self.set_tree(tree)

    def _configured_tree(self) -> TreeSpec:
        """The heads' own fixed tree, cut to the heads there are (a preset may be deeper than new heads)."""
        spec = load_tree(self.config.tree)
        return TreeSpec.from_paths([p for p in spec.paths if len(p) <= self.config.num_heads])

    @property
    def adaptive(self) -> bool:
        """Whether calls that name no tree choose one at each step."""
        return isinstance(self.default_tree, str) and self.default_tree == ADAPTIVE

    @property
    def tree_buffers(self) -> TreeBuffers:
        """The fixed tree's buffers on the model's device."""
        return tree_buffers(self.tree, self.base_model.device)

    def drafting(self) -> Drafting:
        """What a call's plan reads of these heads on the engine that runs them (inference/plan.Drafting): the
        stored per-step tree's parts for the engine's kernels, parsed once per kernel key (stock_kernels() changes
        them) and again when config.adaptive changes."""
        parts = dict(self._stored_parts()[1])
        if self.phrases is None:  # the phrasebook is the model's (it may be swapped); its rates are the config's
            parts.pop("phrase_acceptance", None)
        return Drafting(self.heads, self.tree, self.default_tree, self.engine.kernels(), self.config.lookup_tokens,
                        self.config.lookup_branches, phrases=self.phrases if "phrase_acceptance" in parts else None,
                        **parts)

    def _stored_parts(self) -> tuple[dict, dict, str | None]:
        """(config.adaptive as read, its parts for the engine's kernels, which table), read once per kernels."""
        key = (self.engine.kernels(), torch.get_num_threads())
        stored = self.config.adaptive or {}
        found = self._drafting.get(key)
        if found is None or found[0] != stored:
            found = (copy.deepcopy(stored), *self._adaptive_parts(stored))
            self._drafting[key] = found  # one assignment of a whole entry: safe with many threads
        return found

    def _adaptive_parts(self, stored: dict) -> tuple[dict, str | None]:
        """(the per-step tree's parts stored for the engine's kernels, which table and where it came from)."""
        found = self.engine.find_cost(stored.get("cost", {}))
        if not found or "acceptance" not in stored:
            return {}, None
        cost, origin = CostModel.from_dict(stored["cost"][found]), None
        if self.engine is self.target:  # timed on another machine (calibration/machine.py): this one's, cached
            cost, origin = local_cost(self, found, stored["cost"][found], cost)
        cap = self.engine.row_cap
        if cap is not None and cost.max_size > cap:  # trees no larger than its kernels keep a row's bits for
            cost = cost.up_to(cap)
        parts = {"acceptance": Acceptance.from_dict(stored["acceptance"]), "cost": cost,
                 "lookup": LookupAcceptance.from_dict(stored["lookup"]) if "lookup" in stored else None}
        if "ngrams" in stored:
            parts["phrase_acceptance"] = PhraseAcceptance.from_dict(stored["ngrams"])
        return parts, found if origin in (None, "stored") else f"{found} (this machine's: {origin})"

    def cost_model(self) -> CostModel | None:
        """The stored cost model for the kernels this model's verify runs on, if the heads were calibrated for them."""
        return self._stored_parts()[1].get("cost")

    def cost_model_key(self) -> str | None:
        """Which stored cost model that is ("prepacked-float32-cpu-avx512"), and, where it was timed on another
        machine, where this machine's came from (" (this machine's: measured)", "cached", "measured, not cached")."""
        return self._stored_parts()[2]

    # ---- construction -------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        base: str | os.PathLike | PreTrainedModel = DEFAULT_MODEL,
        heads: str | os.PathLike | None = "auto",
        *,
        num_heads: int = 4,
        num_layers: int = 1,
        mlp_size: int = 0,
        own_lm_head: bool = False,
        condition: str = "none",
        draft_vocab: Sequence[int] | None = None,
        tree: str | Sequence[Sequence[int]] | None = None,
        allow_base_mismatch: bool = False,
        prepack: bool | None = None,
        draft_dtype: torch.dtype | None = None,
        quantize: str | None = None,
        gguf: str | os.PathLike | None = None,
        threads: int | None = None,
        **base_kwargs,
    ) -> "MedusaModel":
        """Heads on a causal LM, ready to generate (docs/how-it-works.md has what each option does and why).
        base: the default model's name, a local HF directory, a hub id, a .gguf file or a loaded model.
        heads: a heads directory; "auto" for the shipped heads where they were trained for this base (else new
        heads, with a warning); None for new heads, shaped by num_heads .. draft_vocab (MedusaConfig).
        tree: the default tree of calls that name none (set_tree); generate(..., tree=) chooses per call.
        prepack: the base's linears on packed CPU kernels (default: where this call loads the base onto a CPU);
        loaded heads are packed on a CPU either way. draft_dtype: the heads' dtype (default on a CPU: bf16 with bf16
        kernels, else torch.int8, weight-only). quantize="int8": the base's linears on oneDNN's int8 GEMM (CPU). A bf16
        or int8 base this call loads gets the row-exact attention where this CPU's products allow it; `model.exact` says
        what was checked. gguf: the target on llama.cpp: a GGUF file of this base, or a weight type (f32, bf16, q8_0,
        q4_1, q4_k_m) converted from the base's folder once; threads: llama.cpp's threads (default: torch's)."""
        if gguf is None and not isinstance(base, PreTrainedModel) and str(base).endswith(".gguf"):
            gguf = base
        _check_kernels_asked(quantize, gguf)
        if not isinstance(base, PreTrainedModel):
            base, prepack = _load_base(base, quantize, prepack, gguf, base_kwargs)
        fingerprint = base_fingerprint(base)  # hashes the whole LM head: once per load
        heads, config = _heads_config(base, heads, fingerprint, allow_base_mismatch)
        if config is not None and (Path(heads) / "adapter" / "adapter_config.json").is_file():
            base = _merge_adapter(base, Path(heads))
        base.eval()
        base.requires_grad_(False)
        _set_kernels(base, quantize, prepack)
        shape = dict(num_heads=num_heads, num_layers=num_layers, mlp_size=mlp_size, own_lm_head=own_lm_head,
                     condition=condition, draft_vocab=list(draft_vocab) if draft_vocab is not None else None)
        medusa_heads, phrases = _build_heads(base, heads, config, fingerprint, draft_dtype, shape)
        engine = open_gguf(base, gguf, threads) if gguf is not None else None
        return cls(base, medusa_heads, tree, phrases, engine)

    def on_engine(self, engine: Engine) -> "MedusaModel":
        """These heads (shared, not copied) on another engine that runs the same model, e.g. its GGUF on llama.cpp
        (engines/llamacpp.open_gguf); its default tree follows the heads' calibration for that engine's kernels."""
        return type(self)(self.base_model, self.heads, None, self.phrases, engine)

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Heads only: config.json + heads.safetensors, in the heads' dtype now (loaded heads draft in bf16 on a
        CPU unless from_pretrained was given draft_dtype), and the phrasebook where there is one."""
        self.config.tree = self.tree.to_list()
        out = save_heads(directory, self.heads, self.config)
        if self.phrases is not None:
            save_ngrams(out, self.phrases)
        return out

    def adaptive_drafter(self, lookup: int, ngram: int = MAX_NGRAM, rows: int = 1, greedy: bool = False,
                         observer: DraftObserver | None = None) -> AdaptiveDrafter:
        """The per-step drafter for one call (inference/plan.Drafting.adaptive_drafter); pass it to
        generate(..., drafter=..., prompt_lookup_num_tokens=0) to watch a call's steps through `observer`."""
        return self.drafting().adaptive_drafter(lookup, ngram, rows, greedy, observer)

    def phrasebook(self) -> NgramStore | None:
        """The phrasebook that drafts in the per-step tree, where its acceptance was calibrated; else None."""
        return self.drafting().phrases

    def set_tree(self, tree: str | Sequence[Sequence[int]] | TreeSpec) -> None:
        """The tree of calls that name none (generate's tree= chooses per call): a preset name, rank paths or a
        TreeSpec for that fixed tree at every step (it also becomes model.tree, what save_pretrained stores);
        "adaptive" for a tree chosen at each step, which needs heads calibrated for this model's kernels; "plain" for
        no drafting. Not for while other threads generate with this model: pass tree= to generate instead."""
        tree = check_tree(tree, self.config.num_heads, self.config.draft_vocab_size)
        if isinstance(tree, str) and tree == ADAPTIVE and self.cost_model() is None:
            raise ValueError(f'tree="adaptive" needs the heads calibrated for these kernels ({self.engine.kernels()}): '
                             "run medusa-heads calibrate")
        if isinstance(tree, TreeSpec):
            self.tree = tree
        self.default_tree = tree

    # ---- generation ---------------------------------------------------------------------------------------------
    def generation_config_for(self, generation_config: GenerationConfig | None = None, **kwargs) -> GenerationConfig:
        """The settings generate() would run with for these arguments: the base model's generation config (or the one
        given) updated by kwargs, transformers' defaults for what is unset. Raises for what generate() cannot honour
        (generate_args.py)."""
        return generate_args.generation_config_for(self.base_model, generation_config, **kwargs)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        *,
        acceptance: str = "exact",
        posterior_threshold: float = 0.09,
        posterior_alpha: float = 0.3,
        streamer=None,
        logits_processor: LogitsProcessorList | None = None,
        stopping_criteria: StoppingCriteriaList | None = None,
        drafter: Drafter | None = None,
        generator: torch.Generator | None = None,
        tree: str | Sequence[Sequence[int]] | TreeSpec | None = None,
        **kwargs,
    ) -> torch.Tensor | MedusaGenerateOutput:
        """Like transformers' generate (decoder-only; a batch is left-padded, with its attention_mask). Greedy output
        equals the base model's greedy output token for token, and sampled output follows the base model's distribution
        exactly, unless acceptance="typical" (Medusa's typical acceptance: faster, lossy).
        prompt_lookup_num_tokens=N (as in transformers) adds up to N tokens copied from the text so far after the
        latest earlier occurrence of its last MAX_NGRAM (3, max_matching_ngram_size) down to MIN_NGRAM (2) tokens,
        merged into the heads' tree; output is unchanged, only tau. Unset, it is the heads' config.lookup_tokens (in
        batches, only where they draft per-step trees).
        tree: this call's tree (inference/plan.py): a preset name ("cpu-16", "chain-4"), rank paths or a TreeSpec for
        that fixed tree at every step; "adaptive" for a tree chosen at each step, lookup included; "plain" for no
        drafting. Default: model.default_tree ("adaptive" for heads calibrated for these kernels, else their fixed
        tree). With a per-step tree a batch chooses one size for all its rows, where the heads were calibrated for
        batches of these kernels (`medusa-heads calibrate --parts batch`); the default drafts the fixed tree
        otherwise. Nothing about a call is stored on the model: calls with different trees may run side by side."""
        gc = self.generation_config_for(generation_config, **kwargs)
        attention_mask, batched = generate_args.check_prompt(input_ids, attention_mask, gc, streamer)
        max_new = generate_args.max_new_tokens(self.base_model, input_ids, gc, generation_config, kwargs)
        eos = set(prompting.eos_ids(gc.eos_token_id))

        plan = make_plan(self.drafting(), self.engine, gc, rows=input_ids.shape[0], prompt_len=input_ids.shape[1],
                         tree=tree, acceptance=acceptance, posterior_threshold=posterior_threshold,
                         posterior_alpha=posterior_alpha, logits_processor=logits_processor, drafter=drafter,
                         generator=generator)
        device = self.engine.device
        if batched:
            pad = (gc.pad_token_id if gc.pad_token_id is not None
                   else next(iter(prompting.eos_ids(gc.eos_token_id)), None))
            if pad is None:
                raise ValueError("batched generation needs pad_token_id (or eos_token_id) to pad finished rows")
            mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
            sequences, stats = decode_batch(self.engine, plan, input_ids.to(device), mask.to(device), max_new, eos, pad,
                                            stopping=stopping_criteria)
        else:
            sequences, stats = decode(self.engine, plan, input_ids.to(device), max_new, eos, streamer,
                                      stopping=stopping_criteria)
        if gc.return_dict_in_generate:
            return MedusaGenerateOutput(sequences, stats)
        return sequences


def _check_kernels_asked(quantize: str | None, gguf) -> None:
    """One line, before anything loads, for kernels this build cannot give."""
    if gguf is not None and quantize:
        raise ValueError("gguf= runs the target on llama.cpp, whose weights the GGUF file sets: leave out quantize")
    if quantize not in (None, "int8"):
        raise ValueError(f"quantize={quantize!r}: the one quantisation is 'int8' (None: the base's own dtype)")
    if quantize and not int8_supported():
        raise ValueError("quantize='int8' needs oneDNN's int8 linear (torch.ops.onednn.qlinear_pointwise), which "
                         "this PyTorch build lacks: load the model in bf16 or fp32 instead")


def _load_base(name, quantize: str | None, prepack: bool | None, gguf, kwargs: dict) -> tuple[PreTrainedModel, bool]:
    """The base by name, with the attention exactness needs; and whether to pack its linears (None: on a CPU that
    packs its dtype, unless llama.cpp runs the target)."""
    if quantize and "dtype" not in kwargs and "torch_dtype" not in kwargs:  # int8 linears, bf16 elsewhere
        kwargs["dtype"] = torch.bfloat16 if bf16_supported() else torch.float32
    base = load_base(name, prepack=False, **exact_attention_kwargs(name, kwargs))  # packed after an adapter merges
    if uses_exact_attention(base) and has_attention_sinks(base):  # GPT-OSS: eager takes its sinks; ours does not
        base.set_attn_implementation("eager")
    if prepack is None:
        prepack = base.device.type == "cpu" and packs(base.dtype) and gguf is None
    return base, prepack


def _heads_config(base: PreTrainedModel, heads, fingerprint: dict, allow_base_mismatch: bool):
    """(heads directory or None, its config or None): "auto" resolved to the shipped heads where they fit this base,
    a directory's config checked against the base (a reference Medusa directory has none of ours)."""
    if heads == "auto":
        heads, config = _shipped_heads_for(base, fingerprint)
        if heads is None:
            warnings.warn(f"no shipped heads were trained for {base.name_or_path or type(base).__name__}: drafting "
                          "with new, untrained heads (output is exact, but no faster). Train heads for it "
                          "(medusa-heads distill, then train) and pass heads=DIR, or heads=None for new heads "
                          "without this warning.", UserWarning, stacklevel=3)
        return heads, config
    if heads is None or is_reference_dir(heads):
        return heads, None
    config = load_config(heads)
    check_fingerprint(config, base, allow_base_mismatch, fingerprint)
    return heads, config


def _set_kernels(base: PreTrainedModel, quantize: str | None, prepack: bool) -> None:
    """The base's linears on int8 or packed kernels, in place."""
    if quantize:
        if base.device.type != "cpu":
            raise ValueError(f"quantize='int8' runs on a CPU; this base is on {base.device}: leave out quantize")
        quantize_linears(base)
        if not int8_rows_invariant(base.dtype):
            warnings.warn("quantize='int8': this CPU's int8 products are not exact integer sums (checked: "
                          "int8_rows_invariant), so greedy output may leave the int8 model's plain decoding at "
                          "near-ties of the top two tokens", UserWarning, stacklevel=3)
    elif prepack:
        prepack_linears(base)


def _build_heads(base: PreTrainedModel, heads, config: MedusaConfig | None, fingerprint: dict,
                 draft_dtype: torch.dtype | None, shape: dict) -> tuple[MedusaHeads, NgramStore | None]:
    """Loaded heads (ours or the reference layout's) and their phrasebook, or new heads of `shape`. Loaded heads draft
    in `draft_dtype`, packed on a CPU; new heads keep the base's dtype, for training."""
    lm_weight = base.get_output_embeddings().weight
    embed_weight = base.get_input_embeddings().weight
    phrases = None
    if heads is None:
        config = MedusaConfig(hidden_size=lm_weight.shape[1], vocab_size=lm_weight.shape[0],
                              base_fingerprint=fingerprint, **shape)
        medusa_heads = MedusaHeads(config, lm_weight, embed_weight)
    elif config is None:  # saved by the reference Medusa code
        medusa_heads = load_reference(heads, lm_weight)
    else:
        medusa_heads = load_heads(heads, lm_weight, config, embed_weight)
        phrases = load_ngrams(heads, config.vocab_size)
    medusa_heads.to(device=lm_weight.device, dtype=lm_weight.dtype)
    if heads is not None:
        dtype = draft_dtype or _draft_dtype(lm_weight)
        medusa_heads.cast(lm_weight.dtype if dtype == INT8 else dtype)
        if dtype == INT8:
            int8_heads(medusa_heads)
        elif lm_weight.device.type == "cpu" and prepack_supported():
            prepack_heads(medusa_heads)
    return medusa_heads, phrases


def _draft_dtype(lm_weight: torch.Tensor) -> torch.dtype:
    """For an fp32 base on a CPU: bf16 where oneDNN has bf16 kernels, else weight-only int8 where this PyTorch has it
    (a quarter of fp32's bytes a product: results/ab/draft_int8); else the base's own dtype. The target verifies
    every guess, so the drafts' dtype moves speed, never the output."""
    if lm_weight.device.type != "cpu" or lm_weight.dtype != torch.float32:
        return lm_weight.dtype
    if bf16_supported():
        return torch.bfloat16
    return INT8 if draft_int8_supported() else lm_weight.dtype


def _merge_adapter(base: PreTrainedModel, heads: Path) -> PreTrainedModel:
    """Heads trained jointly with LoRA (Medusa-2) come with their adapter: merge it into `base` (in place; the
    caller checked that the heads were trained for this base). Generation is then exact for the ADAPTED model."""
    from peft import PeftModel

    if is_prepacked(base):
        raise ValueError(f"{heads} holds a LoRA adapter, which cannot be merged into a base whose linears are already "
                         "prepacked: pass the unpacked base and from_pretrained(..., prepack=True), which merges first")
    return PeftModel.from_pretrained(base, heads / "adapter").merge_and_unload()


def _shipped_heads_for(base: PreTrainedModel, fingerprint: dict) -> tuple[Path | None, MedusaConfig | None]:
    """The shipped heads and their config when they were trained for this base, else (None, None)."""
    try:
        path = default_heads_path()
    except FileNotFoundError:
        return None, None
    config = load_config(path)
    try:
        check_fingerprint(config, base, fingerprint=fingerprint)
    except ValueError:
        return None, None
    return path, config


def exact_attention_kwargs(name: str | os.PathLike, base_kwargs: dict) -> dict:
    """from_pretrained's loading arguments, with the row-exact attention for a bf16 model bound for this CPU (where
    its products are row-invariant) unless the caller chose an attention, or its class computes attention itself
    (Falcon: it takes no attention but its own, and would fail to load with this one)."""
    if (base_kwargs.get("dtype", base_kwargs.get("torch_dtype")) != torch.bfloat16
            or "attn_implementation" in base_kwargs):
        return base_kwargs
    if base_kwargs.get("device_map") not in (None, "cpu") or not rows_invariant(torch.bfloat16):
        return base_kwargs
    if not _takes_attention_interface(name, base_kwargs):
        return base_kwargs
    return {**base_kwargs, "attn_implementation": register_exact_attention()}


def _takes_attention_interface(name: str | os.PathLike, base_kwargs: dict) -> bool:
    """Whether the class that would load `name` runs its attention through transformers' attention interface (its
    config read alone; False where that class cannot be told, as for remote code)."""
    try:
        config = AutoConfig.from_pretrained(source(name), trust_remote_code=base_kwargs.get("trust_remote_code", False))
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except Exception:  # noqa: BLE001: loading itself reports what is wrong with `name`
        return False
    return bool(getattr(model_class, "_supports_attention_backend", False))
