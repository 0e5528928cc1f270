"""The one save/load path for heads: config.json + heads.safetensors, strict keys and shapes; and the target's
phrasebook beside them where calibrated (ngrams.safetensors, tree/ngrams.py). The reference Medusa layout is read
and written here too; the exports for vLLM (its own Medusa, and the project's plugin) are in vllm_export.py."""
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
    digest = hashlib.sha256(
        weight.to(device="cpu", dtype=torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
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
                f"these heads were trained for another base model ({key}: heads {_shown(want)}, "
                f"base {_shown(have[key])}); "
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
        if (name.startswith(prefix) and len(parts) > 1 + level and parts[1 + level].isdigit()
                and (level == 0 or parts[1] == "0")):
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
        if (any(k.startswith(prefix) for k in want) and _count(held, prefix) != _count(want, prefix)
                and _count(held, prefix)):
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
                                      f"{len(unexpected)} not in these heads (e.g. {unexpected[0]})" if unexpected
                                      else "") if x)
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
                f"{d / WEIGHTS_NAME}: {key} has shape {tuple(tensor.shape)}, "
                f"the config implies {tuple(expected[key].shape)}"
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
            raise ValueError(f"{d / REFERENCE_WEIGHTS}: {key} has shape {tuple(state[key].shape)}, "
                             f"the base model implies {shape}")
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


def export_reference(heads: MedusaHeads, lm_head_weight: torch.Tensor, out: str | os.PathLike,
                     base_name: str = "") -> Path:
    """Write the reference layout. Every head gets a full-vocabulary LM head (the base's when shared), so a draft
    vocabulary is not kept; heads with their own LM head over a draft vocabulary cannot be exported."""
    cfg = heads.config
    if cfg.condition != "none":
        raise ValueError(f'heads with condition="{cfg.condition}" read token embeddings, which the reference Medusa '
                         "layout has no place for")
    if cfg.mlp_size:
        raise ValueError(f"heads with mlp_size={cfg.mlp_size} have two-layer blocks; the reference Medusa layout holds "
                         "one square linear per block")
    if cfg.own_lm_head and cfg.draft_vocab is not None:
        raise ValueError("heads with their own LM heads over a draft vocabulary have no full-vocabulary LM head "
                         "to export")
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


# the exports for vLLM, under the names they have always had here; they write through _atomic_write above
from medusa_heads.checkpoint.vllm_export import (  # noqa: E402, F401
    PLUGIN_ARCHITECTURE, PLUGIN_FORMAT, SERVING_RECIPE, VLLM_WEIGHTS, check_vllm_export, export_vllm,
    export_vllm_plugin, vllm_exportable,
)
