"""What a bench method names and how it runs: transformers' own decoding (hf, hf-stock, pld), the heads (medusa and
its variants, optionally with prompt lookup), llama.cpp's decoding and n-gram self-speculation, and the heads on
llama.cpp (medusa_heads/llamacpp.py: METHODS)."""
from __future__ import annotations

import torch

from medusa_heads import llamacpp
from medusa_heads.engines.llamacpp import LlamaCppEngine
from medusa_heads.kernels.prepack import stock_kernels
from medusa_heads.llamacpp import METHODS as LLAMACPP_METHODS, split_method
from medusa_heads.prompting import eos_ids
from medusa_heads.tree import list_presets

PLD_TOKENS = 10  # prompt lookup's continuation length: method "pld" and a bare "+pld"
PLAIN_METHODS = ("hf", "hf-stock", "pld")
MEDUSA_METHODS = ("medusa", "medusa-static", "medusa-preset")  # and medusa:PRESET; each may end in +pld / +pldN


def parse_method(method: str) -> tuple[str, int | None]:
    """A bench method -> (its name before any "+pld", prompt-lookup tokens: None = the heads' own lookup_tokens);
    ValueError naming the valid methods for anything else."""
    name, plus, lookup = method.partition("+pld")
    medusa = name in MEDUSA_METHODS or (name.startswith("medusa:") and name.split(":", 1)[1] in list_presets())
    if method in PLAIN_METHODS or (medusa and not plus):
        return method, None
    if medusa and (lookup == "" or lookup.isdigit()):
        return name, PLD_TOKENS if lookup == "" else int(lookup)
    raise ValueError(f"unknown bench method {method!r}; methods: {', '.join(PLAIN_METHODS + MEDUSA_METHODS)}, "
                     f"medusa:PRESET (PRESET: {', '.join(list_presets())}), a medusa method + '+pldN' "
                     f"(prompt lookup of N tokens; '+pld0': heads only), llamacpp (all of: "
                     f"{', '.join(LLAMACPP_METHODS)})")


def check_methods(methods: list[str]) -> list[str]:
    """The methods to run, checked, without repeats, hf (the reference) first; "llamacpp" stands for every
    llama.cpp method (medusa_heads/llamacpp.py), "llamacpp-ngram" for its n-gram modes."""
    methods = llamacpp.expand([m.strip() for m in methods if m.strip()])
    for m in methods:
        if m not in llamacpp.METHODS:
            parse_method(m)
    return list(dict.fromkeys(["hf", *methods]))


def method_label(method: str, heads_lookup: int, phrasebook: bool = False) -> str:
    """What a method runs, for tables and charts: e.g. "medusa (heads + lookup 10)", "medusa+pld0 (heads only)";
    phrasebook: the heads' phrasebook drafts in the per-step tree ("heads + phrasebook + lookup 10")."""
    if method in LLAMACPP_METHODS:
        weights, mode, heads = split_method(method)
        if heads:
            return f"heads on llama.cpp {weights.upper()}"
        return f"llama.cpp {weights.upper()}" + (f" + {mode} self-speculation" if mode else "")
    name, lookup = parse_method(method)
    if name == "hf":
        return "hf"
    if name == "hf-stock":
        return "hf-stock (stock kernels)"
    if name == "pld":
        return f"pld (lookup {PLD_TOKENS})"
    lookup = heads_lookup if lookup is None else lookup
    heads = "heads + phrasebook" if phrasebook and name == "medusa" else "heads"
    return f"{method} ({heads + ' only' if lookup == 0 else f'{heads} + lookup {lookup}'})"


class MethodRunner:
    """Runs a bench method's generate on prompt ids, returning (sequences, stats: None but for the heads). engines:
    the llama.cpp methods' (llamacpp_engines), loaded; a llama.cpp method's target forwards are its own count at its
    last call (no hook sees them). close() closes the engines."""

    def __init__(self, model, engines: dict, max_new_tokens: int, preset: str) -> None:
        self.model, self.base, self.max_new_tokens = model, model.base_model, max_new_tokens
        self.trees = {"medusa": None, "medusa-static": model.tree, "medusa-preset": preset}  # None: the model's default
        self.engines = engines
        self.llama_forwards: dict[str, int] = {}
        # the heads on llama.cpp
        self.on_llama = {m: model.on_engine(e) for m, e in self.engines.items() if split_method(m)[2]}

    def __call__(self, method: str, ids: torch.Tensor, max_new_tokens: int | None = None, **gen):
        max_new_tokens = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if method in self.engines:
            return self._on_llamacpp(method, ids, max_new_tokens, **gen)
        base, mask = self.base, torch.ones_like(ids)
        if method == "hf":
            return base.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, **gen), None
        if method == "hf-stock":  # transformers' generate on PyTorch's stock kernels (differs from hf if prepacked)
            with stock_kernels(base):
                return base.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, **gen), None
        if method == "pld":
            return base.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 prompt_lookup_num_tokens=PLD_TOKENS, **gen), None
        name, lookup = parse_method(method)
        extra = {} if lookup is None else dict(prompt_lookup_num_tokens=lookup)
        res = self.model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                  tree=self.trees[name] if name in self.trees else name.split(":", 1)[1],
                                  return_dict_in_generate=True, **gen, **extra)
        return res.sequences, res.stats

    def _on_llamacpp(self, method: str, ids: torch.Tensor, max_new_tokens: int, **gen):
        if method in self.on_llama:
            res = self.on_llama[method].generate(ids, attention_mask=torch.ones_like(ids),
                                                 max_new_tokens=max_new_tokens, return_dict_in_generate=True, **gen)
            self.llama_forwards[method] = res.stats.steps
            return res.sequences, res.stats
        new, self.llama_forwards[method] = self.engines[method].generate(ids[0].tolist(), max_new_tokens,
                                                                         ignore_eos="eos_token_id" in gen)
        return torch.cat([ids, torch.tensor([new], dtype=ids.dtype, device=ids.device)], dim=1), None

    def forwards(self, method: str, counted: int) -> int:
        """A call's target forwards: llama.cpp's own count for its methods, else `counted` (the decoder's hook)."""
        return self.llama_forwards[method] if method in self.engines else counted

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()


def llamacpp_engines(base, tokenizer, methods: list[str], sampling: dict | None, n_tokens: int,
                     files: dict | None = None) -> dict:
    """The llama.cpp methods' engines, built (once per machine) and loaded before any timing. files: {weights: a
    GGUF file of the model} to run for those weights (the user's own file), instead of one made from its folder."""
    wanted = [m for m in methods if m in LLAMACPP_METHODS]
    if not wanted:
        return {}
    if sampling is not None:
        raise ValueError("the llama.cpp methods decode greedily: leave out --do-sample or the llamacpp methods")
    files = files or {}
    made = {split_method(m)[0] for m in wanted} - set(files)
    folder = llamacpp.model_folder(base, tokenizer) if made else None
    threads = torch.get_num_threads()
    n_ctx = 4096 + n_tokens
    eos = eos_ids(getattr(base, "generation_config", None), base.config)
    engines = {}
    try:
        for m in wanted:
            weights, mode, heads = split_method(m)
            path = files[weights] if weights in files else llamacpp.gguf(folder, weights)
            if heads:
                engines[m] = LlamaCppEngine(path, weights, threads, n_ctx)
            elif mode:
                engines[m] = llamacpp.Server(path, mode, threads, n_ctx, eos)
            else:
                engines[m] = llamacpp.Plain(path, threads, n_ctx)
    except BaseException:
        for engine in engines.values():
            engine.close()
        raise
    return engines
