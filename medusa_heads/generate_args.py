"""What MedusaModel.generate accepts, read as transformers reads it: the settings (a GenerationConfig updated by the
call's arguments, transformers' defaults for what is unset, a refusal for what generate cannot honour), how many new
tokens, and the prompt (its shape, its attention mask, whether it is a batch)."""
from __future__ import annotations

import copy
import warnings

import torch
from transformers import GenerationConfig, PreTrainedModel

from medusa_heads import prompting

# GenerationConfig fields generate() honours; any other field set away from its default raises.
_SUPPORTED = {
    "max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p",
    "eos_token_id", "pad_token_id", "bos_token_id", "use_cache", "return_dict_in_generate",
    "repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "min_new_tokens",
    "prompt_lookup_num_tokens", "max_matching_ngram_size",
}
_IGNORED = {"transformers_version", "_from_model_config", "_commit_hash", "generation_kwargs", "cache_implementation"}


def generation_config_for(base_model: PreTrainedModel, generation_config: GenerationConfig | None = None,
                          **kwargs) -> GenerationConfig:
    """The settings generate() would run with for these arguments: the base model's generation config (or the one
    given) updated by kwargs, transformers' defaults for what is unset. Raises for what generate() cannot honour."""
    gc = copy.deepcopy(generation_config or base_model.generation_config)
    unused = gc.update(**kwargs)
    if unused:
        raise TypeError(f"generate() got arguments it does not support: {', '.join(sorted(unused))}")
    # Fields still unset take transformers' own global defaults (max_length=20, top_k=50, ...), as in its generate.
    defaults = GenerationConfig._get_default_generation_params()
    for key, value in defaults.items():
        if getattr(gc, key, None) is None:
            setattr(gc, key, value)
    default = {**GenerationConfig().to_dict(), **defaults}
    for key, value in gc.to_dict().items():
        if key in _SUPPORTED or key in _IGNORED or key not in default:
            continue
        if value != default[key] and not (_unset(value) and _unset(default[key])):
            raise ValueError(f"generate() does not support {key}={value!r} "
                             f"(medusa-heads supports: {', '.join(sorted(_SUPPORTED))})")
    return gc


def _unset(value) -> bool:
    return value is None or value is False or value == 0 or value == {} or value == []


def max_new_tokens(base_model: PreTrainedModel, input_ids: torch.Tensor, gc: GenerationConfig,
                   generation_config: GenerationConfig | None, kwargs: dict) -> int:
    """New tokens to generate, as transformers counts them from max_new_tokens or max_length (gc: the call's settings,
    generation_config and kwargs: as the call gave them)."""
    prompt = input_ids.shape[1]
    context = getattr(base_model.config, "max_position_embeddings", None)
    if gc.max_new_tokens is not None:
        max_new = gc.max_new_tokens
    elif kwargs.get("max_length") is None and getattr(generation_config, "max_length", None) is None \
            and base_model.generation_config.max_length is None:  # no length set anywhere: as transformers,
        max_new = gc.max_length  # its default max_length (20) counts new tokens, within the model's context
        if context is not None:
            max_new = min(max_new, context - prompt)
        warnings.warn(f"Using the model-agnostic default `max_length` (={prompt + max_new}) to control "
                      "the generation length. We recommend setting `max_new_tokens` to control the maximum length "
                      "of the generation.", UserWarning, stacklevel=3)
    else:
        max_new = gc.max_length - prompt
    if max_new < 1 and gc.max_new_tokens is not None:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new}")
    if max_new < 1:
        raise ValueError(f"the prompt has {prompt} tokens and max_length is {gc.max_length}: nothing is "
                         f"left to generate; set max_new_tokens instead")
    if context is not None and prompt > context:
        raise ValueError(f"the prompt has {prompt} tokens, more than the model's context of {context} "
                         f"(max_position_embeddings); shorten it")
    return max_new


def check_prompt(input_ids, attention_mask: torch.Tensor | None, gc: GenerationConfig,
                 streamer) -> tuple[torch.Tensor | None, bool]:
    """(the attention mask, inferred as transformers does where none is given; whether this is a batch)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a (batch, length) tensor, "
                         f"got {getattr(input_ids, 'shape', type(input_ids))}")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: give at least one prompt token")
    if attention_mask is None:  # padding is wherever pad_token_id sits, if it is not EOS
        pad = gc.pad_token_id
        if pad is not None and pad not in prompting.eos_ids(gc.eos_token_id) and bool((input_ids == pad).any()):
            attention_mask = (input_ids != pad).long()
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}")
    batched = input_ids.shape[0] > 1 or (attention_mask is not None and not bool(attention_mask.all()))
    if batched and streamer is not None:
        raise ValueError("streamers take one sequence: batched generation (or a padded prompt) cannot stream")
    return attention_mask, batched
