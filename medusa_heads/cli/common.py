"""What the medusa-heads commands share: their checks of arguments and files, and the loading of a model.

Each command checks its arguments and files before it loads a model, and says why it stops in one line
(SystemExit("...") here; the library's ValueError / OSError are cut to one line by medusa_heads.cli.main).
Nothing is imported at the top that imports torch: `medusa-heads --help` stays quick."""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path


DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
DEFAULT_TEMPERATURE = 0.7  # every command that samples
DEFAULT_TOP_P = 0.9


def _note(message: str) -> None:
    print(f"medusa-heads: {message}", file=sys.stderr)


def _check_model(name: str, flag: str = "--model") -> None:
    """Refuse a --model that names a local directory which is not there, or a name that is neither embedded nor
    local while the hub cannot be reached (an id the hub may hold is left to the hub)."""
    from medusa_heads.default_model import check_model_name

    try:
        check_model_name(name)
    except FileNotFoundError as e:
        raise SystemExit(f"{flag} {e}") from None


def _check_device(device: str | None) -> None:
    """Refuse a --device this machine (or this PyTorch build) does not have, before any model loads."""
    if device is None:
        return
    import torch

    try:
        d = torch.device(device)
    except (RuntimeError, ValueError):
        raise SystemExit(f"--device {device}: not a device name; give cpu, cuda or cuda:N (or leave out --device for "
                         "the CPU)") from None
    if d.type == "cpu":
        return
    if d.type == "cuda":
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            raise SystemExit(f"--device {device}: this PyTorch ({torch.__version__}) is a CPU-only build; leave out "
                             "--device to run on the CPU, or install a CUDA build of torch")
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {device}: no CUDA GPU is visible (torch.cuda.is_available() is False: check "
                             "the driver and CUDA_VISIBLE_DEVICES); leave out --device to run on the CPU")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise SystemExit(f"--device {device}: there are {torch.cuda.device_count()} CUDA devices (cuda:0 to "
                             f"cuda:{torch.cuda.device_count() - 1})")
        return
    backend = getattr(torch, d.type, None) if d.type != "mps" else getattr(torch.backends, "mps", None)
    if backend is None or not getattr(backend, "is_available", lambda: False)():
        raise SystemExit(f"--device {device}: this machine or PyTorch build has no {d.type} device; leave out "
                         "--device to run on the CPU")


def _check_utf8(text: str, what: str) -> None:
    """Refuse text that arrived as bytes which are not UTF-8 (Python keeps them as lone surrogates, which no
    tokenizer takes), naming the first bad byte."""
    message = _not_utf8(text)
    if message:
        raise SystemExit(f"{what} {message}; pass UTF-8 text (convert it, e.g. with iconv -f latin1 -t utf-8)")


def _not_utf8(text: str) -> str | None:
    """"is not valid UTF-8 (byte 0xff at character 3)" for text holding undecodable bytes, else None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        byte = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        return f"is not valid UTF-8 ({byte} at character {e.start + 1})"
    return None


def _check_sampling(args: argparse.Namespace) -> None:
    """--temperature / --top-p shape sampling only: without --do-sample they would be ignored, so they are refused.
    With --do-sample, what is not given takes its default."""
    given = [flag for flag, value in (("--temperature", args.temperature), ("--top-p", args.top_p))
             if value is not None]
    if given and not args.do_sample:
        raise SystemExit(f"{' and '.join(given)} set{'s' if len(given) == 1 else ''} sampling, but decoding is greedy "
                         f"without --do-sample; add --do-sample, or leave out {' and '.join(given)}")
    if args.temperature is None:
        args.temperature = DEFAULT_TEMPERATURE
    if args.top_p is None:
        args.top_p = DEFAULT_TOP_P


def _data_file(path: str, flag: str) -> str:
    """A data file that must exist; where only PATH.gz does (what the repo ships), that one, said once."""
    if not Path(path).exists() and not path.endswith(".gz") and Path(path + ".gz").is_file():
        _note(f"{flag} {path} does not exist; reading {path}.gz beside it")
        return path + ".gz"
    _check_file(path, flag)
    return path


def _check_heads(path: str | None, flag: str = "--heads") -> None:
    """Refuse a heads directory that is missing or holds no heads, before any model loads."""
    if path is None:
        return
    from medusa_heads.checkpoint import CONFIG_NAME, REFERENCE_WEIGHTS, WEIGHTS_NAME

    d = Path(path)
    train = f"train heads with `medusa-heads train --out {path}`"
    if not d.is_dir():
        shipped = ", or leave out --heads for the shipped ones" if flag == "--heads" else ""
        raise SystemExit(f"{flag} {path}: no such directory; {train}{shipped}")
    if not (d / CONFIG_NAME).is_file() or not ((d / WEIGHTS_NAME).is_file() or (d / REFERENCE_WEIGHTS).is_file()):
        raise SystemExit(f"{flag} {path}: holds no heads ({CONFIG_NAME} + {WEIGHTS_NAME}, or the reference "
                         f"{REFERENCE_WEIGHTS}); {train}")
    from medusa_heads.checkpoint import check_heads_files

    try:  # the files' headers against the config: a truncated download, an edited config
        check_heads_files(d)
    except ValueError as e:
        raise SystemExit(f"{flag} {e}") from None


def _check_file(path: str, flag: str) -> None:
    if not Path(path).is_file():
        raise SystemExit(f"{flag} {path}: no such file" if not Path(path).exists() else f"{flag} {path}: not a file")


def _read_prompts(path: str):
    """The prompt rows of --prompts; refuses a missing or empty file (a malformed line: ValueError naming file:line)."""
    from medusa_heads.corpus import read_prompts

    path = _data_file(path, "--prompts")
    rows = read_prompts(path)
    if not rows:
        raise SystemExit(f'--prompts {path}: no prompts in it; write one JSON object per line, {{"prompt": "..."}} '
                         f'or {{"turns": ["...", "..."]}}')
    return rows


def _load_tokenizer(name: str):
    """The tokenizer, loaded before the model (it is quick and fails quickly); says once if prompts are plain text."""
    from medusa_heads.loading import load_tokenizer
    from medusa_heads.prompting import has_chat_template

    tok = load_tokenizer(name)
    if not has_chat_template(tok):
        _note(f"{name}'s tokenizer has no chat template: prompts are plain text (turns joined by blank lines)")
    return tok


def _load_base(name: str, dtype: str = "fp32", prepack: bool = True):
    """The model (CPU) and its tokenizer; with `prepack`, its linears run through oneDNN where this CPU can."""
    import torch

    from medusa_heads.loading import load_base

    _check_model(name)
    tok = _load_tokenizer(name)
    return load_base(name, dtype=getattr(torch, DTYPES[dtype]), prepack=None if prepack else False), tok


def _dtype_kwargs(name: str, device: str | None) -> dict:
    """from_pretrained's arguments for --dtype: a torch dtype, or int8 (quantize, CPU only: one line otherwise)."""
    import torch

    if name != "int8":
        return {"dtype": getattr(torch, DTYPES[name])}
    if device not in (None, "cpu"):
        raise SystemExit(f"--dtype int8 runs on a CPU (oneDNN's int8 linears); on --device {device} use bf16")
    return {"quantize": "int8"}


def _check_gguf(args: argparse.Namespace) -> str | None:
    """--gguf, checked before anything loads: a GGUF file or a weight type, on a CPU, in llama.cpp's own weights."""
    gguf = getattr(args, "gguf", None)
    if gguf is None:
        return None
    from medusa_heads.llamacpp import WEIGHTS

    if gguf.lower() not in WEIGHTS and not (gguf.endswith(".gguf") and Path(gguf).is_file()):
        raise SystemExit(f"--gguf {gguf}: neither a GGUF file nor a weight type ({', '.join(WEIGHTS)})")
    if args.dtype != "fp32" or args.device not in (None, "cpu"):
        raise SystemExit("--gguf runs llama.cpp on the CPU in the file's own weights: leave out --dtype and --device")
    return gguf


def _load_medusa(args: argparse.Namespace):
    """Base model, tokenizer and MedusaModel for the generating commands (--model, --heads, --tree); says when the
    heads are untrained."""
    _check_model(args.model)
    _check_heads(args.heads)
    _check_device(args.device)
    dtype = _dtype_kwargs(args.dtype, args.device)  # --dtype int8 off a CPU: one line before anything loads
    gguf = _check_gguf(args)

    from medusa_heads.model import MedusaModel

    tok = _load_tokenizer(args.model)
    # from_pretrained prepacks (where this CPU can) after merging a Medusa-2 adapter into the base, heads too
    with warnings.catch_warnings():  # untrained heads: the one line below says it the command's way
        warnings.filterwarnings("ignore", "no shipped heads were trained", UserWarning)
        model = MedusaModel.from_pretrained(args.model, heads=args.heads or "auto", tree=getattr(args, "tree", None),
                                            allow_base_mismatch=args.allow_base_mismatch, gguf=gguf,
                                            device_map=args.device, prepack=None if args.prepack else False, **dtype)
    if not model.config.extra:  # trained heads record their recipe and training; new heads record nothing
        where = f"{args.heads} holds" if args.heads else f"no shipped heads fit {args.model}, so it runs with"
        _note(f"untrained heads: {where} zero-initialised heads; tau will be near 1.0; "
              "train heads with `medusa-heads train`")
    return model, tok


def _sampling(args: argparse.Namespace) -> dict:
    """generate()'s sampling arguments; seeds torch's generator when sampling."""
    import torch

    if not args.do_sample:
        return {"do_sample": False}
    torch.manual_seed(args.seed)
    return {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p}
