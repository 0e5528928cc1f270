"""llama.cpp beside us in the bench, the engine CPU users already run.

Built once for the CPU at hand from llama-cpp-python's sdist (llama.cpp vendored in it): the Python binding for plain
decoding in this process, and llama.cpp's own server for its n-gram self-speculation (which only its tools expose).
The GGUF files are made from the model the bench runs with llama.cpp's own converter (F32) and quantizer (BF16,
Q8_0), cached by the model's files. Everything lives under cache_dir()/llama.cpp; nothing here is needed elsewhere.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

from medusa_heads.default_model import cache_dir
from medusa_heads.machine import cpu_flags
from medusa_heads.local_server import LocalServer, free_port

VERSION = "0.3.36"  # llama-cpp-python, the llama.cpp it vendors included; what the bench is pinned to
WEIGHTS = ("f32", "bf16", "q8_0", "q4_1", "q4_k_m")
QUANTIZED = {"bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0", "q4_1": "MOSTLY_Q4_1", "q4_k_m": "MOSTLY_Q4_K_M"}
# llama.cpp's n-gram self-speculation modes (common/speculative.cpp), each with the settings its server gets:
# llama.cpp's defaults look up 12-token n-grams (made for edits of long documents), which never match in a chat
# answer, so the map modes look up 3 tokens and draft up to 10, like transformers' prompt lookup.
NGRAM_MODES = {
    "ngram-simple": ["--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "10"],
    "ngram-map-k": ["--spec-ngram-map-k-size-n", "3", "--spec-ngram-map-k-size-m", "10"],
    "ngram-map-k4v": ["--spec-ngram-map-k4v-size-n", "3", "--spec-ngram-map-k4v-size-m", "10"],
    "ngram-mod": [],
    "ngram-cache": [],
}
NGRAM_WEIGHTS = ("f32", "bf16", "q8_0")  # the weights "llamacpp" stands for
# plain decoding at each weight type; n-gram self-speculation (F32: "llamacpp-ngram-simple"; other weights:
# "llamacpp-q8_0-ngram-simple"); and the heads on llama.cpp ("medusa-llamacpp-q8_0", engines/llamacpp.py)
METHODS = (tuple(f"llamacpp-{w}" for w in WEIGHTS) + tuple(f"llamacpp-{m}" for m in NGRAM_MODES)
           + tuple(f"llamacpp-{w}-{m}" for w in WEIGHTS[1:] for m in NGRAM_MODES)
           + tuple(f"medusa-llamacpp-{w}" for w in WEIGHTS))
# as llama.cpp decodes on a CPU by default; it changes bits, so the heads and their reference agree
FLASH_ATTENTION = True
BUILD_MINUTES = 9  # both builds on two cores, about


class LlamaCppError(RuntimeError):
    """llama.cpp could not be built, converted to or run here: one line with the cause and the log to read."""


def home() -> Path:
    return cache_dir() / "llama.cpp"


def expand(methods: list[str]) -> list[str]:
    """"llamacpp" stands for llama.cpp's plain decoding at F32, BF16 and Q8_0 and its F32 n-gram modes;
    "llamacpp-ngram" for the n-gram modes; "medusa-llamacpp" for the heads on llama.cpp at every weight type."""
    out = []
    for m in methods:
        if m == "llamacpp":
            out += [f"llamacpp-{w}" for w in NGRAM_WEIGHTS] + [f"llamacpp-{n}" for n in NGRAM_MODES]
        elif m == "llamacpp-ngram":
            out += [f"llamacpp-{n}" for n in NGRAM_MODES]
        elif m == "medusa-llamacpp":
            out += [f"medusa-llamacpp-{w}" for w in WEIGHTS]
        else:
            out.append(m)
    return out


def split_method(method: str) -> tuple[str, str | None, bool]:
    """A llama.cpp method -> (its weights, its n-gram mode or None, whether the heads draft for it)."""
    heads = method.startswith("medusa-llamacpp-")
    kind = method.removeprefix("medusa-llamacpp-" if heads else "llamacpp-")
    if kind in NGRAM_MODES:
        return "f32", kind, False
    weights, _, mode = kind.partition("-")
    return weights, mode or None, heads


def plain_reference(method: str) -> str | None:
    """The plain llama.cpp decoding a speculative llama.cpp method must reproduce token for token (its own weights'):
    an n-gram mode's, or the heads' on llama.cpp."""
    if method not in METHODS:
        return None
    weights, mode, heads = split_method(method)
    return f"llamacpp-{weights}" if mode or heads else None


# --- the build -----------------------------------------------------------------------------------------------------

def cmake_args(flags: set[str] | None = None) -> list[str]:
    """ggml's CPU options for this CPU, named rather than -march=native: a native build on some of these VMs dies
    with an illegal instruction in the AMX Q8_0 kernels, so AMX stays off."""
    flags = cpu_flags() if flags is None else flags
    on = {"GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_FMA": "fma", "GGML_F16C": "f16c", "GGML_BMI2": "bmi2",
          "GGML_AVX_VNNI": "avx_vnni", "GGML_AVX512": "avx512f", "GGML_AVX512_VBMI": "avx512vbmi",
          "GGML_AVX512_VNNI": "avx512_vnni", "GGML_AVX512_BF16": "avx512_bf16"}
    args = ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
            "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAVA_BUILD=OFF"]
    return args + [f"-D{opt}={'ON' if flag in flags else 'OFF'}" for opt, flag in on.items()]


def _run(cmd: list[str], log: Path, what: str, env: dict | None = None, cwd: Path | None = None) -> None:
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    if proc.returncode != 0:
        tail = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        cause = next((ln for ln in reversed(tail) if "error" in ln.lower()), tail[-1] if tail else "no output")
        raise LlamaCppError(f"{what} failed ({cause[:200]}); the whole log: {log}")


def sdist() -> Path:
    """llama-cpp-python's sdist, downloaded once from the package index and unpacked: its vendored llama.cpp is
    the server's source and the converter's."""
    root = home()
    src = root / f"llama_cpp_python-{VERSION}"
    if (src / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").is_file():
        return src
    root.mkdir(parents=True, exist_ok=True)
    archive = root / f"llama_cpp_python-{VERSION}.tar.gz"
    if not archive.is_file():
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(root),
              f"llama-cpp-python=={VERSION}"], root / "download.log", "downloading llama-cpp-python's sdist")
    tmp = root / f".unpack-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")
    shutil.rmtree(src, ignore_errors=True)
    (tmp / src.name).rename(src)  # whole or not at all: an interrupted unpack leaves only .unpack-*
    shutil.rmtree(tmp, ignore_errors=True)
    return src


def python_binding():
    """The llama_cpp module, installed at VERSION and built for this CPU first if it is not."""
    try:
        import llama_cpp

        if llama_cpp.__version__ == VERSION:
            return llama_cpp
        reason = f"llama-cpp-python {llama_cpp.__version__} is installed, the bench is pinned to {VERSION}"
    except ImportError:
        reason = "llama-cpp-python is not installed"
    src = sdist()
    print(f"llamacpp: {reason}; building it for this CPU (about 5 min on two cores, once)", file=sys.stderr)
    env = dict(os.environ, CMAKE_ARGS=" ".join(cmake_args()), CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--force-reinstall", str(home() / f"{src.name}.tar.gz")],
         home() / "pip-install.log", "building llama-cpp-python", env=env)
    _run([sys.executable, "-m", "pip", "install", "diskcache", "jinja2", "numpy", "typing-extensions"],
         home() / "pip-deps.log", "installing llama-cpp-python's dependencies")
    import importlib

    importlib.invalidate_caches()
    import llama_cpp

    return llama_cpp


def _converter_deps() -> None:
    """What llama.cpp's converter imports besides torch, transformers and numpy (its own gguf package is vendored
    beside it): sentencepiece, which it tries first for every Llama-style vocabulary."""
    import importlib.util

    if importlib.util.find_spec("sentencepiece") is None:
        _run([sys.executable, "-m", "pip", "install", "sentencepiece>=0.1.98,<0.3.0"], home() / "pip-converter.log",
             "installing the converter's sentencepiece")


def server_binary() -> Path:
    """llama.cpp's server, built once from the same vendored source with the same options."""
    binary = home() / "build" / "bin" / "llama-server"
    if binary.is_file():
        return binary
    src = sdist() / "vendor" / "llama.cpp"
    build = home() / "build"
    print("llamacpp: building llama.cpp's server for its n-gram self-speculation (about 4 min on two cores, once)",
          file=sys.stderr)
    _run(["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja" if shutil.which("ninja") else "Unix Makefiles",
          "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
          "-DBUILD_SHARED_LIBS=OFF", *cmake_args()], home() / "server-configure.log", "configuring llama.cpp's server")
    _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)],
         home() / "server-build.log", "building llama.cpp's server")
    return binary


# --- the weights ---------------------------------------------------------------------------------------------------

def _model_key(folder: Path) -> str:
    h = hashlib.sha256(VERSION.encode())
    for f in sorted(folder.iterdir()):
        if f.is_file() and (f.suffix in (".json", ".safetensors", ".model", ".txt")):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def model_folder(base, tokenizer) -> Path:
    """A transformers folder holding the model the bench runs: its own, or (a model built in memory) a copy saved
    once to the cache."""
    folder = Path(str(getattr(base, "name_or_path", "") or ""))
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    digest = hashlib.sha256()
    for name, p in sorted(base.state_dict().items()):
        digest.update(name.encode())
        digest.update(p.detach().float().cpu().numpy().tobytes()[:4096])
    folder = home() / "models" / digest.hexdigest()[:16]
    if not (folder / "config.json").is_file():
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        base.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    return folder


def gguf(folder: Path, weights: str) -> Path:
    """The model in `folder` as a GGUF file of `weights` (f32 by llama.cpp's converter; bf16 and q8_0 by its
    quantizer from the F32 file), made once and cached by the folder's files."""
    if weights not in WEIGHTS:
        raise ValueError(f"llama.cpp weights {weights!r}: use one of {', '.join(WEIGHTS)}")
    out_dir = home() / "gguf" / _model_key(folder)
    out = out_dir / f"{weights}.gguf"
    if out.is_file():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "source.json").write_text(json.dumps({"model": str(folder), "llama_cpp_python": VERSION}))
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    if weights == "f32":
        converter = sdist() / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
        _converter_deps()
        print(f"llamacpp: converting {folder} to GGUF F32 with llama.cpp's converter", file=sys.stderr)
        _run([sys.executable, str(converter), str(folder), "--outtype", "f32", "--outfile", str(tmp)],
             out_dir / "convert.log", f"llama.cpp's converter on {folder}")
    else:
        llama_cpp = python_binding()
        f32 = gguf(folder, "f32")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{QUANTIZED[weights]}")
        params.nthread = os.cpu_count() or 2
        print(f"llamacpp: quantizing to {weights.upper()} with llama.cpp's quantizer", file=sys.stderr)
        if llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(), params) != 0:
            tmp.unlink(missing_ok=True)
            raise LlamaCppError(f"llama.cpp's quantizer could not make {weights.upper()} from {f32}")
    tmp.rename(out)
    return out


def file_weights(path: Path) -> str:
    """A GGUF file's weight type as WEIGHTS names it ("q4_k_m"), from its general.file_type; its name otherwise."""
    import gguf as gguf_py

    field = gguf_py.GGUFReader(path).get_field("general.file_type")
    if field is None:
        return "unknown"
    name = gguf_py.LlamaFileType(int(field.contents())).name  # "MOSTLY_Q4_K_M", "ALL_F32"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_").lower()


# --- decoding ------------------------------------------------------------------------------------------------------

class Plain:
    """llama.cpp's plain greedy decoding, in this process, through llama-cpp-python."""

    def __init__(self, path: Path, threads: int, n_ctx: int = 4096) -> None:
        llama_cpp = python_binding()
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   n_batch=512, flash_attn=FLASH_ATTENTION, verbose=False)
        self.eog = lambda t: bool(llama_cpp.llama_vocab_is_eog(self.llm._model.vocab, t))

    def generate(self, ids: list[int], max_new_tokens: int, ignore_eos: bool = False) -> tuple[list[int], int]:
        """(new token ids, the stop token included as transformers counts it; target forwards)."""
        self.llm.reset()  # the whole prompt each time, like every other method: no prefix kept from the last call
        out = []
        for tok in self.llm.generate(ids, top_k=1, temp=0.0, reset=True):
            out.append(tok)
            if (self.eog(tok) and not ignore_eos) or len(out) >= max_new_tokens:
                break
        return out, len(out)

    def close(self) -> None:
        self.llm.close()


class Server:
    """llama.cpp's server with one n-gram self-speculation mode, F32 weights, greedy; one request at a time."""

    def __init__(self, path: Path, mode: str, threads: int, n_ctx: int = 4096, eos: list[int] = ()) -> None:
        binary = server_binary()
        self.eos = list(eos)
        self.port = free_port()
        self.log = home() / f"server-{mode}.log"
        cmd = [str(binary), "-m", str(path), "--host", "127.0.0.1", "--port", str(self.port), "-c", str(n_ctx),
               "-t", str(threads), "-tb", str(threads), "-np", "1", "--no-webui",
               "--flash-attn", "on" if FLASH_ATTENTION else "off", "--spec-type", mode,
               *NGRAM_MODES[mode]]
        self._server = LocalServer(cmd, self.port, self.log, f"llama.cpp's server ({mode})", LlamaCppError)
        self._server.start(timeout=120)

    def generate(self, ids: list[int], max_new_tokens: int, ignore_eos: bool = False) -> tuple[list[int], int]:
        """(new token ids, target forwards: one per accepted-or-rejected verify, from the server's draft counts)."""
        body = json.dumps({"prompt": ids, "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1,
                           "cache_prompt": False, "return_tokens": True, "samplers": ["top_k"],
                           "ignore_eos": ignore_eos}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            res = json.loads(r.read())
        tokens = list(res.get("tokens") or [])
        if res.get("stop_type") == "eos" and self.eos and (not tokens or tokens[-1] not in self.eos):
            tokens.append(self.eos[0])  # the server leaves the stop token out; transformers counts it
        accepted = res.get("timings", {}).get("draft_n_accepted", 0) or 0
        return tokens, max(len(tokens) - accepted, 1)

    def close(self) -> None:
        self._server.stop(grace=10)
