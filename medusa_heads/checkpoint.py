"""The one save/load path for heads: config.json + heads.safetensors, strict keys and shapes; and the target's
phrasebook beside them where calibrated (ngrams.safetensors, tree/ngrams.py)."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from medusa_heads.config import MedusaConfig
from medusa_heads.heads import MedusaHeads
from medusa_heads.tree.ngrams import NgramStore

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "heads.safetensors"
NGRAMS_NAME = "ngrams.safetensors"


def base_fingerprint(base: PreTrainedModel) -> dict:
    """What heads must match: architecture, sizes, and a hash of the LM head (taken in bf16, so an fp32
    and a bf16 load of the same weights agree)."""
    weight = base.get_output_embeddings().weight.detach()
    digest = hashlib.sha256(weight.to(device="cpu", dtype=torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return {
        "architecture": type(base).__name__,
        "hidden_size": weight.shape[1],
        "vocab_size": weight.shape[0],
        "lm_head_sha256": digest.hexdigest(),
    }


def check_fingerprint(config: MedusaConfig, base: PreTrainedModel, allow_mismatch: bool = False,
                      fingerprint: dict | None = None) -> None:
    """Refuse heads trained for another base (sizes always; architecture and LM-head hash unless allowed).
    fingerprint: base_fingerprint(base), if the caller has it already (it hashes the whole LM head)."""
    weight = base.get_output_embeddings().weight
    if (config.vocab_size, config.hidden_size) != tuple(weight.shape):
        raise ValueError(
            f"heads expect vocab_size={config.vocab_size}, hidden_size={config.hidden_size}, but the base model's "
            f"LM head is {tuple(weight.shape)} (vocab_size, hidden_size)"
        )
    if config.base_fingerprint is None or allow_mismatch:
        return
    have = fingerprint or base_fingerprint(base)
    for key in ("architecture", "lm_head_sha256"):
        want = config.base_fingerprint.get(key)
        if want != have[key]:
            raise ValueError(
                f"these heads were trained for another base model ({key}: heads {_shown(want)}, base {_shown(have[key])}); "
                "pass allow_base_mismatch=True (--allow-base-mismatch) to use them anyway"
            )


def _shown(value) -> str:
    """A fingerprint value for a message: a hash by its first 12 hex digits, anything else as repr."""
    return f"{value[:12]}..." if isinstance(value, str) and len(value) == 64 else repr(value)


_UMASK = os.umask(0)  # read once (os.umask can only read it by setting it)...
os.umask(_UMASK)  # ...and put back


def follow_umask(path: str | os.PathLike) -> None:
    """Give `path` the mode a plain open() or mkdir() would (0666 / 0777 less the umask), and everything under it
    if it is a folder: safetensors' save_file writes 0600 and mkdtemp makes 0700, which other users of a shared
    cache or run folder could not read."""
    path = Path(path)
    paths = [path, *path.rglob("*")] if path.is_dir() else [path]
    for p in paths:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~_UMASK)


def _atomic_write(path: Path, write) -> None:
    """write(tmp) then rename over `path`; the file gets the mode a plain open() would (0666 less the umask),
    not mkstemp's 0600."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_heads(directory: str | os.PathLike, heads: MedusaHeads, config: MedusaConfig | None = None) -> Path:
    """Write config.json and heads.safetensors (each atomically). The shared base LM head is never saved."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = config or heads.config
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in heads.state_dict().items()}
    _atomic_write(out / WEIGHTS_NAME, lambda p: save_file(tensors, p, metadata={"format": "medusa-heads"}))
    _atomic_write(out / CONFIG_NAME, config.save)
    return out


def save_config(directory: str | os.PathLike, config: MedusaConfig) -> None:
    """Rewrite a heads directory's config.json atomically (e.g. after calibration chose its tree)."""
    _atomic_write(Path(directory) / CONFIG_NAME, config.save)


def save_ngrams(directory: str | os.PathLike, store: NgramStore) -> Path:
    """Write the n-gram store beside the heads (atomically)."""
    path = Path(directory) / NGRAMS_NAME
    tensors = {k: v.contiguous() for k, v in store.tensors().items()}
    _atomic_write(path, lambda p: save_file(tensors, p, metadata={"format": "medusa-heads-ngrams", **store.metadata()}))
    return path


def load_ngrams(directory: str | os.PathLike, vocab_size: int | None = None) -> NgramStore | None:
    """The n-gram store beside the heads, or None where there is none. Loads safetensors only; a store made for
    another vocabulary is refused."""
    path = Path(directory) / NGRAMS_NAME
    if not path.is_file():
        return None
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    try:
        store = NgramStore.from_tensors(tensors, metadata)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if vocab_size is not None and store.vocab_size != vocab_size:
        raise ValueError(f"{path}: n-gram store for a vocabulary of {store.vocab_size}, the heads have {vocab_size}")
    return store


CUT_SHORT = "an interrupted download or copy: copy the file again"


def safetensors_header(path: str | os.PathLike) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name: (dtype, shape)} from a safetensors file's header, read without its tensors; a ValueError of one line
    for a file that is cut short (the data its header names is not all there) or is not safetensors."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else None
        if n is None or n > size - 8:
            raise ValueError(f"{path}: cut short ({size:,} bytes, fewer than its header alone); {CUT_SHORT}")
        try:
            header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            tensors = {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items()}
            end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError):
            raise ValueError(f"{path}: not a safetensors file (its header does not parse); {CUT_SHORT}") from None
    if size < 8 + n + end:
        raise ValueError(f"{path}: cut short ({size:,} of its {8 + n + end:,} bytes); {CUT_SHORT}")
    return tensors


def _expected_tensors(config: MedusaConfig) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors heads with this config save (built on the meta device: no memory)."""
    with torch.device("meta"):
        lm = torch.empty(config.vocab_size, config.hidden_size)
        heads = MedusaHeads(config, lm, lm if config.context_size else None)
    return {k: tuple(v.shape) for k, v in heads.state_dict().items()}


def _count(names, prefix: str, level: int = 0) -> int:
    """How many heads (level 0) or blocks of head 0 (level 1) tensor names under `prefix` ("blocks.") hold."""
    seen = set()
    for name in names:
        parts = name.split(".")
        if name.startswith(prefix) and len(parts) > 1 + level and parts[1 + level].isdigit() and (level == 0 or parts[1] == "0"):
            seen.add(int(parts[1 + level]))
    return max(seen) + 1 if seen else 0


def check_heads_files(directory: str | os.PathLike) -> None:
    """Check a heads directory without loading its weights: every safetensors file whole, and the weights' names
    and shapes those the config implies. A ValueError of one line says what differs ("config.json says 7 heads,
    heads.safetensors holds 4") and what to do."""
    d = Path(directory)
    for name in (WEIGHTS_NAME, REFERENCE_WEIGHTS, NGRAMS_NAME):
        if (d / name).is_file():
            safetensors_header(d / name)
    if is_reference_dir(d):
        try:
            ref = json.loads((d / CONFIG_NAME).read_text())
        except ValueError as e:
            raise ValueError(f"{d / CONFIG_NAME}: not valid JSON ({e})") from None
        if not isinstance(ref, dict):
            raise ValueError(f"{d / CONFIG_NAME}: not a heads config (a JSON object)")
        held = safetensors_header(d / REFERENCE_WEIGHTS)
        k, layers = ref.get("medusa_num_heads"), ref.get("medusa_num_layers")
        have_k = 1 + max((int(n.split(".")[0]) for n in held if n.split(".")[0].isdigit()), default=-1)
        if isinstance(k, int) and k != have_k:
            raise ValueError(f"{d}: {CONFIG_NAME} says medusa_num_heads {k}, {REFERENCE_WEIGHTS} holds {have_k} heads; "
                             f"set medusa_num_heads to {have_k} (or copy both files again from one export)")
        if isinstance(layers, int) and layers >= 0:
            have_layers = len({n.split(".")[1] for n in held if n.startswith("0.") and n.endswith(".linear.weight")})
            if have_layers != layers:
                raise ValueError(f"{d}: {CONFIG_NAME} says medusa_num_layers {layers}, {REFERENCE_WEIGHTS} holds "
                                 f"{have_layers} per head; set it to {have_layers} (or copy both files again)")
        return
    try:
        config = load_config(d)
    except (TypeError, AttributeError) as e:  # a value of the wrong type ("num_heads": "7"), not a JSON object
        raise ValueError(f"{d / CONFIG_NAME}: not a valid heads config ({e})") from None
    except ValueError as e:
        raise ValueError(str(e) if str(d) in str(e) else f"{d / CONFIG_NAME}: {e}") from None
    held = {k: shape for k, (_, shape) in safetensors_header(d / WEIGHTS_NAME).items()}
    want = _expected_tensors(config)
    if held == want:
        return
    fix = "the config was edited, or the two files come from different runs"
    for prefix in ("blocks.", "lm_heads.", "token_proj."):
        if any(k.startswith(prefix) for k in want) and _count(held, prefix) != _count(want, prefix) and _count(held, prefix):
            n = _count(held, prefix)
            raise ValueError(f"{d}: {CONFIG_NAME} says {config.num_heads} heads (num_heads), {WEIGHTS_NAME} holds {n} "
                             f"({fix}); set num_heads to {n}, or copy both files again")
    if _count(held, "blocks.", 1) != _count(want, "blocks.", 1) and any(k.startswith("blocks.") for k in held):
        n = _count(held, "blocks.", 1)
        raise ValueError(f"{d}: {CONFIG_NAME} says {config.num_layers} blocks per head (num_layers), {WEIGHTS_NAME} "
                         f"holds {n} ({fix}); set num_layers to {n}, or copy both files again")
    missing, unexpected = sorted(set(want) - set(held)), sorted(set(held) - set(want))
    if missing or unexpected:
        what = ", ".join(x for x in (f"{len(missing)} tensors missing (e.g. {missing[0]})" if missing else "",
                                      f"{len(unexpected)} not in these heads (e.g. {unexpected[0]})" if unexpected else "") if x)
        raise ValueError(f"{d}: {WEIGHTS_NAME} does not hold the heads {CONFIG_NAME} describes: {what} ({fix}); "
                         "copy both files again from one run")
    key = next(k for k in want if held[k] != want[k])
    raise ValueError(f"{d}: {WEIGHTS_NAME} holds {key} of shape {held[key]}, {CONFIG_NAME} implies {want[key]} "
                     f"(hidden_size {config.hidden_size}, mlp_size {config.mlp_size}, draft vocabulary "
                     f"{config.draft_vocab_size}; {fix}); copy both files again from one run")


def load_config(directory: str | os.PathLike) -> MedusaConfig:
    d = Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(f"heads directory {d} does not exist")
    if not (d / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"heads directory {d} has no {CONFIG_NAME}")
    return MedusaConfig.load(d / CONFIG_NAME)


def load_heads(directory: str | os.PathLike, lm_head_weight: torch.Tensor, config: MedusaConfig | None = None,
               embed_weight: torch.Tensor | None = None) -> MedusaHeads:
    """Build heads from a directory, with strict key and shape checks. Loads safetensors only.
    `embed_weight`: the base's input embeddings, needed by token-conditioned heads."""
    d = Path(directory)
    config = config or load_config(d)
    if not (d / WEIGHTS_NAME).is_file():
        raise FileNotFoundError(f"heads directory {d} has no {WEIGHTS_NAME}")
    heads = MedusaHeads(config, lm_head_weight, embed_weight)
    state = load_file(d / WEIGHTS_NAME)
    expected = heads.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{d / WEIGHTS_NAME}: missing keys {missing}, unexpected keys {unexpected}")
    for key, tensor in state.items():
        if tensor.shape != expected[key].shape:
            raise ValueError(
                f"{d / WEIGHTS_NAME}: {key} has shape {tuple(tensor.shape)}, the config implies {tuple(expected[key].shape)}"
            )
    heads.load_state_dict(state, strict=True)
    return heads


# ---- the reference Medusa layout (FasterDecoding/Medusa; also read by vLLM) ---------------------------------------
# config.json: {"medusa_num_heads": K, "medusa_num_layers": L, ...}; medusa_lm_head.safetensors holds the state dict
# of its ModuleList of K nn.Sequential(ResBlock x L, Linear(H, V, bias=False)):
#   "{k}.{j}.linear.weight" (H, H), "{k}.{j}.linear.bias" (H,), "{k}.{L}.weight" (V, H)
REFERENCE_WEIGHTS = "medusa_lm_head.safetensors"


def is_reference_dir(directory: str | os.PathLike) -> bool:
    d = Path(directory)
    return (d / REFERENCE_WEIGHTS).is_file() and not (d / WEIGHTS_NAME).is_file()


def load_reference(directory: str | os.PathLike, lm_head_weight: torch.Tensor) -> MedusaHeads:
    """Heads saved by the reference code. Heads whose LM heads all equal the base's load as shared-LM-head heads."""
    d = Path(directory)
    if not (d / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"heads directory {d} has no {CONFIG_NAME}")
    ref = json.loads((d / CONFIG_NAME).read_text())
    for key in ("medusa_num_heads", "medusa_num_layers"):
        if not isinstance(ref.get(key), int):
            raise ValueError(f"{d / CONFIG_NAME}: {key} is missing or not an integer")
    k_heads, layers = ref["medusa_num_heads"], ref["medusa_num_layers"]
    state = load_file(d / REFERENCE_WEIGHTS)
    v, h = lm_head_weight.shape
    expected = {f"{k}.{layers}.weight": (v, h) for k in range(k_heads)}
    for k in range(k_heads):
        for j in range(layers):
            expected[f"{k}.{j}.linear.weight"], expected[f"{k}.{j}.linear.bias"] = (h, h), (h,)
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{d / REFERENCE_WEIGHTS}: missing keys {missing}, unexpected keys {unexpected}")
    for key, shape in expected.items():
        if tuple(state[key].shape) != shape:
            raise ValueError(f"{d / REFERENCE_WEIGHTS}: {key} has shape {tuple(state[key].shape)}, the base model implies {shape}")
    base_w = lm_head_weight.detach().to("cpu")
    shared = all(torch.equal(state[f"{k}.{layers}.weight"].to(base_w.dtype), base_w) for k in range(k_heads))
    config = MedusaConfig(num_heads=k_heads, num_layers=layers, hidden_size=h, vocab_size=v, own_lm_head=not shared,
                          extra={"imported_from": "reference medusa"})
    heads = MedusaHeads(config, lm_head_weight)
    ours = {}
    for k in range(k_heads):
        for j in range(layers):
            for p in ("weight", "bias"):
                ours[f"blocks.{k}.{j}.linear.{p}"] = state[f"{k}.{j}.linear.{p}"]
        if not shared:
            ours[f"lm_heads.{k}.weight"] = state[f"{k}.{layers}.weight"]
    heads.load_state_dict(ours, strict=True)
    return heads


def export_reference(heads: MedusaHeads, lm_head_weight: torch.Tensor, out: str | os.PathLike, base_name: str = "") -> Path:
    """Write the reference layout. Every head gets a full-vocabulary LM head (the base's when shared), so a draft
    vocabulary is not kept; heads with their own LM head over a draft vocabulary cannot be exported."""
    cfg = heads.config
    if cfg.condition != "none":
        raise ValueError(f'heads with condition="{cfg.condition}" read token embeddings, which the reference Medusa layout has no place for')
    if cfg.mlp_size:
        raise ValueError(f"heads with mlp_size={cfg.mlp_size} have two-layer blocks; the reference Medusa layout holds one square linear per block")
    if cfg.own_lm_head and cfg.draft_vocab is not None:
        raise ValueError("heads with their own LM heads over a draft vocabulary have no full-vocabulary LM head to export")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for k in range(cfg.num_heads):
        for j in range(cfg.num_layers):
            block = heads.blocks[k][j].linear
            state[f"{k}.{j}.linear.weight"], state[f"{k}.{j}.linear.bias"] = block.weight, block.bias
        lm = heads.lm_heads[k].weight if cfg.own_lm_head else lm_head_weight
        state[f"{k}.{cfg.num_layers}.weight"] = lm
    state = {key: t.detach().to("cpu").contiguous().clone() for key, t in state.items()}
    _atomic_write(out / REFERENCE_WEIGHTS, lambda p: save_file(state, p))
    ref = {"medusa_num_heads": cfg.num_heads, "medusa_num_layers": cfg.num_layers, "base_model_name_or_path": base_name,
           "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size}
    _atomic_write(out / CONFIG_NAME, lambda p: Path(p).write_text(json.dumps(ref, indent=1) + "\n"))
    return out


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
        raise ValueError(f'heads with condition="{config.condition}" read the tokens above each node, but vLLM\'s Medusa '
                         f"reads the hidden state only; {train}")
    if config.mlp_size:
        raise ValueError(f"heads with mlp_size={config.mlp_size} have H -> {config.mlp_size} -> H blocks, but vLLM's Medusa "
                         f"runs square blocks x + SiLU(W x + b) only; {train}")
    if config.own_lm_head and config.draft_vocab is not None:
        raise ValueError("heads with their own LM heads over a draft vocabulary: vLLM 0.32 truncates only a shared LM head "
                         "(original_lm_head); train heads that share the base LM head (own_lm_head: false)")


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
    k_heads, layers, h, v = (config[key] for key in ("medusa_num_heads", "medusa_num_layers", "hidden_size", "vocab_size"))
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
            raise ValueError(f"{d / VLLM_WEIGHTS}: {key} has shape {tuple(state[key].shape)}, the config implies {shape}")
    if rows < v:
        if not shared:
            raise ValueError(f"{d / CONFIG_NAME}: a token_map needs original_lm_head (vLLM 0.32 truncates a shared LM head only)")
        tmap = state["token_map"]
        if tmap.dtype != torch.long:
            raise ValueError(f"{d / VLLM_WEIGHTS}: token_map must be int64 token ids, got {tmap.dtype}")
        if len(set(tmap.tolist())) != rows or int(tmap.min()) < 0 or int(tmap.max()) >= v:
            raise ValueError(f"{d / VLLM_WEIGHTS}: token_map must hold {rows} distinct token ids in [0, {v})")
        if lm_head_weight is not None:
            want = lm_head_weight.detach().to("cpu")[tmap].to(state["lm_head.weight"].dtype)
            if not torch.equal(state["lm_head.weight"], want):
                raise ValueError(f"{d / VLLM_WEIGHTS}: lm_head.weight rows are not the base LM head's rows at token_map")
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
        raise ValueError(f"heads expect an LM head of ({cfg.vocab_size}, {cfg.hidden_size}), the base's is {tuple(lm.shape)}")
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
