"""The bodies of the medusa-heads commands; medusa_heads.cli holds their arguments.

Each command checks its arguments and files before it loads a model, and says why it stops in one line
(SystemExit("...") here; the library's ValueError / OSError are cut to one line by medusa_heads.cli.main).
Nothing is imported at the top that imports torch: `medusa-heads --help` stays quick."""
from __future__ import annotations

import argparse
import os
import sys
import time
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
    given = [flag for flag, value in (("--temperature", args.temperature), ("--top-p", args.top_p)) if value is not None]
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
        _note(f"untrained heads: {where} zero-initialised heads; tau will be near 1.0; train heads with `medusa-heads train`")
    return model, tok


def _sampling(args: argparse.Namespace) -> dict:
    """generate()'s sampling arguments; seeds torch's generator when sampling."""
    import torch

    if not args.do_sample:
        return {"do_sample": False}
    torch.manual_seed(args.seed)
    return {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p}


def cmd_generate(args: argparse.Namespace) -> None:
    _check_utf8(args.prompt, "--prompt")
    _check_sampling(args)
    from transformers import TextStreamer

    from medusa_heads.prompting import prompt_ids

    model, tok = _load_medusa(args)
    ids = prompt_ids(tok, args.prompt).to(model.base_model.device)
    t = time.perf_counter()
    res = model.generate(ids, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True,
                         streamer=TextStreamer(tok, skip_prompt=True), **_sampling(args))
    dt = time.perf_counter() - t
    print(f"\n[{res.stats.new_tokens} tokens, {res.stats.new_tokens / dt:.1f} tokens/s, tau {res.stats.mean_accepted:.2f}]", file=sys.stderr)


def cmd_chat(args: argparse.Namespace) -> None:
    """Interactive chat with the chat template; replies stream as they are accepted, then tokens/s and tau.
    An empty line, Ctrl-D or Ctrl-C ends it; a line that is not UTF-8 is said and skipped, and the chat goes on."""
    _check_sampling(args)
    from transformers import TextStreamer

    from medusa_heads.prompting import prompt_ids

    model, tok = _load_medusa(args)
    messages: list[dict] = []
    print("medusa-heads chat: empty line, Ctrl-D or Ctrl-C to quit", file=sys.stderr)
    sampling = _sampling(args)
    if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 arrive as lone surrogates, said below, and
        sys.stdin.reconfigure(errors="surrogateescape")  # never as a UnicodeDecodeError that would end the chat
    try:
        while True:
            try:
                line = input("> ").strip()
            except EOFError:
                break
            except UnicodeDecodeError as e:  # a stdin that could not be reconfigured
                _note(f"chat: that line is not valid UTF-8 (byte 0x{e.object[e.start]:02x}); it was skipped: type it again")
                continue
            if not line:
                break
            bad = _not_utf8(line)
            if bad:
                _note(f"chat: that line {bad}; it was skipped: type it again")
                continue
            messages.append({"role": "user", "content": line})
            ids = prompt_ids(tok, messages).to(model.base_model.device)
            t = time.perf_counter()
            res = model.generate(ids, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True,
                                 streamer=TextStreamer(tok, skip_prompt=True, skip_special_tokens=True), **sampling)
            dt = time.perf_counter() - t
            messages.append({"role": "assistant", "content": tok.decode(res.sequences[0, ids.shape[1]:], skip_special_tokens=True)})
            print(f"[{res.stats.new_tokens} tokens, {res.stats.new_tokens / dt:.1f} tokens/s, tau {res.stats.mean_accepted:.2f}]", file=sys.stderr)
    except KeyboardInterrupt:
        print(file=sys.stderr)  # end the line the prompt or the reply left open


DEMO_PROMPTS = [
    "Explain in a few sentences why the sky is blue.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Give me three tips for a job interview.",
]


def cmd_demo(args: argparse.Namespace) -> None:
    """Greedy generation with plain generate and with Medusa, alternating; prints tokens/s, tau and equality.
    With prepacked linears (the default on a CPU) transformers' generate also runs on the stock kernels."""
    import torch
    from tqdm import tqdm

    from medusa_heads.kernels.prepack import is_prepacked, stock_kernels
    from medusa_heads.prompting import prompt_ids

    torch.set_num_threads(args.threads)
    model, tok = _load_medusa(args)
    base = model.base_model
    packed = is_prepacked(base)
    tree = ("chosen at each step" if model.adaptive else "none (plain decoding)" if model.default_tree == "plain"
            else f"fixed, {model.tree.num_nodes} nodes")
    print(f"heads: {'trained' if model.config.extra else 'untrained (zero-initialised)'}; tree: {tree}; "
          f"linears: {'oneDNN prepacked (both methods)' if packed else 'stock kernels'}")

    def hf_stock(ids):
        with stock_kernels(base):
            return base.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)

    ids = prompt_ids(tok, "Hi").to(base.device)
    base.generate(ids, max_new_tokens=4, do_sample=False), model.generate(ids, max_new_tokens=4)  # warm-up
    t = time.perf_counter()
    base.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    per_token = (time.perf_counter() - t) / 8  # plain generate's seconds a token: the estimate below
    methods = ["transformers"] + (["transformers, stock kernels"] if packed else []) + ["medusa-heads"]
    # plain generate at its own pace (the stock kernels ~1.5x slower), medusa at about half of it
    estimate = len(DEMO_PROMPTS) * args.max_new_tokens * per_token * (1 + (1.5 if packed else 0) + 0.5)
    print(f"demo: {len(DEMO_PROMPTS)} prompts x {len(methods)} methods ({'; '.join(methods)}) x up to "
          f"{args.max_new_tokens} new tokens, greedy, {args.threads} threads: about {_duration(estimate)} here "
          "(fewer --max-new-tokens is quicker)", flush=True)
    seconds = dict.fromkeys(["hf", "medusa"] + (["hf_stock"] if packed else []), 0.0)
    n_tok = same = 0
    taus = []
    bar = tqdm(total=len(DEMO_PROMPTS) * len(seconds), desc="demo", unit="run", file=sys.stderr)
    for i, prompt in enumerate(DEMO_PROMPTS):
        ids = prompt_ids(tok, prompt).to(base.device)
        runs = [("hf", lambda: base.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)),
                ("medusa", lambda: model.generate(ids, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True))]
        if packed:
            runs.append(("hf_stock", lambda: hf_stock(ids)))
        out = {}
        for name, fn in runs if i % 2 == 0 else runs[::-1]:  # alternate the order
            bar.set_postfix_str(f"prompt {i + 1}, {name}")
            t = time.perf_counter()
            out[name] = fn()
            seconds[name] += time.perf_counter() - t
            bar.update(1)
        n_tok += out["hf"].shape[1] - ids.shape[1]
        same += int(torch.equal(out["hf"], out["medusa"].sequences))
        taus.append(out["medusa"].stats.mean_accepted)
        bar.write(f"[{i + 1}] {prompt}\n    {tok.decode(out['hf'][0, ids.shape[1]:], skip_special_tokens=True)[:160]!r}...",
                  file=sys.stdout)
    bar.close()
    print(f"\n{'method':<36}{'tokens/s':>10}{'tau':>7}{'speed-up':>10}")
    print(f"{'transformers' + (', prepacked' if packed else '') + ' (baseline)':<36}{n_tok / seconds['hf']:>10.1f}"
          f"{1.0:>7.2f}{1.0:>10.2f}")
    if packed:
        print(f"{'transformers, stock kernels':<36}{n_tok / seconds['hf_stock']:>10.1f}{1.0:>7.2f}{seconds['hf'] / seconds['hf_stock']:>10.2f}")
    print(f"{'medusa-heads' + (', prepacked' if packed else ''):<36}{n_tok / seconds['medusa']:>10.1f}{sum(taus) / len(taus):>7.2f}"
          f"{seconds['hf'] / seconds['medusa']:>10.2f}")
    print("tau: tokens each forward of the model yields (plain generate: 1; medusa: the drafted tokens it accepts + 1); "
          "speed-up: against the baseline row")
    print(f"identical outputs (medusa vs transformers on the same kernels): {same}/{len(DEMO_PROMPTS)}")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def cmd_distill(args: argparse.Namespace) -> None:
    import torch

    from medusa_heads.model import MedusaModel
    from medusa_heads.corpus import as_variant, subsample
    from medusa_heads.training.distill import distill, reusable_answers

    caps = {}
    for c in args.cap:
        source, _, n = c.partition("=")
        if not n.isdigit():
            raise SystemExit(f"--cap expects SOURCE=N, got {c!r}")
        caps[source] = int(n)
    if Path(args.out).is_dir():
        raise SystemExit(f"--out {args.out}: is a directory; give the JSONL file to append conversations to")
    if args.reuse:
        _check_file(args.reuse, "--reuse")
    rows = subsample(_read_prompts(args.prompts), caps, seed=args.seed)[: args.limit]
    if not rows:
        raise SystemExit(f"--cap {' --cap '.join(args.cap)} leaves none of the prompts in {args.prompts}")
    if args.variant:
        single = sum(len(r.turns) == 1 for r in rows)
        if args.temperature <= 0 and single:
            # a greedy variant is new only where a row asks more than its prompt: follow-up turns
            raise SystemExit(f"--variant asks for a further answer to each prompt, but {single} of the {len(rows)} rows "
                             "have a single turn, whose greedy answer would repeat the first: give it a "
                             "--temperature > 0, or rows with follow-up turns")
        rows = as_variant(rows, args.variant)
    if args.features and Path(args.features).is_file():
        raise SystemExit(f"--features {args.features}: is a file; give the folder to keep feature shards in")
    _check_heads(args.heads)
    _check_model(args.model)
    remote = "--server" if args.server else "--engine" if args.engine else None
    if remote and (args.heads or args.reuse):
        raise SystemExit(f"{remote} answers every turn on the server: leave out {'--heads' if args.heads else '--reuse'}")
    if args.server and args.engine:
        raise SystemExit("--server and --engine both name where the answers come from: give one")
    vllm_py = None
    if args.engine:
        from medusa_heads.training.remote import ServerError, vllm_python

        try:
            vllm_py = vllm_python(args.vllm_python)
        except ServerError as e:
            raise SystemExit(str(e)) from None
    _check_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    base, tok = _load_base(args.model, prepack=args.prepack and args.device in (None, "cpu"))
    if args.device:
        base.to(args.device)
    if args.server:
        _distill_from_server(args, base, tok, rows)
        return
    if args.engine:
        import shlex

        from medusa_heads.default_model import resolve_model
        from medusa_heads.training.remote import ServerError, VllmEngine

        log = Path(args.out).with_suffix(".vllm.log")
        print(f"distill: starting vLLM ({vllm_py}) on {args.model}; its log: {log}", file=sys.stderr)
        try:
            with VllmEngine(str(resolve_model(args.model)), vllm_py, log, shlex.split(args.vllm_args or "")) as server:
                args.server, args.server_model = server.url, server.model
                _distill_from_server(args, base, tok, rows)
        except ServerError as e:
            raise SystemExit(f"--engine vllm: {e}") from None
        return
    medusa = MedusaModel.from_pretrained(base, heads=args.heads, allow_base_mismatch=args.allow_base_mismatch) if args.heads else None
    counts = distill(base, tok, rows, args.out, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                     temperature=args.temperature, top_p=args.top_p, medusa=medusa, seed=args.seed,
                     features=args.features, reuse=reusable_answers(args.reuse) if args.reuse else None)
    print(f"distill: {counts}", file=sys.stderr)


def _distill_from_server(args: argparse.Namespace, base, tok, rows) -> None:
    from medusa_heads.corpus import read_conversations
    from medusa_heads.training.features import features_from_conversations
    from medusa_heads.training.remote import Server, ServerError, check_server, distill_from_server

    server = Server(args.server, args.server_model)
    try:
        check_server(server, base, tok, rows, log=lambda m: print(m, file=sys.stderr))
        counts = distill_from_server(server, tok, rows, args.out, max_new_tokens=args.max_new_tokens,
                                     temperature=args.temperature, top_p=args.top_p, concurrency=args.concurrency,
                                     seed=args.seed)
    except ServerError as e:
        raise SystemExit(f"--server: {e}") from None
    print(f"distill: {counts}", file=sys.stderr)
    if counts["failed"] and not counts["written"]:
        raise SystemExit(f"--server: every request failed ({counts['failed']}; the first: {counts['first_error']})")
    if counts["failed"]:
        print(f"distill: {counts['failed']} requests failed (the first: {counts['first_error']}); rerun the same "
              "command to retry them", file=sys.stderr)
    if args.features:
        n = features_from_conversations(base, tok, read_conversations(args.out), args.features)
        print(f"features: added {n} conversations to {args.features}", file=sys.stderr)


def cmd_features(args: argparse.Namespace) -> None:
    import torch

    from medusa_heads.corpus import read_conversations
    from medusa_heads.training.features import features_from_conversations, process_shard

    data = _data_file(args.data, "--data")
    if Path(args.features).exists() and not Path(args.features).is_dir():
        raise SystemExit(f"--features {args.features}: is a file; give the folder of feature shards")
    _check_model(args.model)
    _check_device(args.device)
    conversations = read_conversations(data)
    torch.set_num_threads(args.threads)
    rank, world = process_shard()
    device = args.device
    if device == "cuda" and world > 1:  # one GPU a process, as accelerate launches them
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
    base, tok = _load_base(args.model, dtype=args.dtype, prepack=args.prepack and device in (None, "cpu"))
    if device:
        base.to(device)
    n = features_from_conversations(base, tok, conversations, args.features, batch_tokens=args.batch_tokens,
                                    shard=(rank, world))
    who = f" (process {rank} of {world})" if world > 1 else ""
    print(f"features{who}: added {n} conversations to {args.features}", file=sys.stderr)


def cmd_train(args: argparse.Namespace) -> None:
    import torch

    from medusa_heads.training.recipe import TrainRecipe
    from medusa_heads.training.trainer import train

    if args.config is not None:
        _check_file(args.config, "--config")
    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = list(args.set)
    for key in ("data", "out", "features", "max_steps"):
        if getattr(args, key) is not None:
            overrides.append(f"{key}={getattr(args, key)}")
    recipe = TrainRecipe.load(args.config, overrides)
    # before any work: the data files (NAME.gz where only it exists) and the model's name
    flag = "--data" if args.data is not None else "the recipe's data"
    data = ",".join(_data_file(p.strip(), flag) for p in recipe.data.split(",") if p.strip())
    if data != recipe.data:
        recipe = TrainRecipe.load(args.config, [*overrides, f"data={data}"])
    _check_model(recipe.model, "the recipe's model")
    out = train(recipe, resume=args.resume)
    print(f"heads written to {out}", file=sys.stderr)


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    """"2,4,8" -> (2, 4, 8): increasing integers of 2 or more, or a clear exit naming the flag."""
    try:
        values = tuple(int(v) for v in text.split(",") if v)
    except ValueError:
        values = ()
    if not values or list(values) != sorted(set(values)) or values[0] < 2:
        raise SystemExit(f"{flag} takes increasing batch sizes of 2 or more, e.g. 2,4,8; got {text!r}")
    return values


def cmd_calibrate(args: argparse.Namespace) -> None:
    """Measure on held-out data and this machine, and write into the heads' config (medusa_heads.calibration)."""
    import torch

    from medusa_heads.calibration import PARTS, TIMED_PARTS, Settings, calibrate, cpu_count, held_out_conversations
    from medusa_heads.loading import load_tokenizer
    from medusa_heads.model import MedusaModel
    from medusa_heads.corpus import read_conversations

    parts = [p for p in args.parts.split(",") if p]
    if not parts or set(parts) - set(PARTS):
        raise SystemExit(f"--parts takes a comma-separated list of {', '.join(PARTS)}, got {args.parts!r}")
    _check_heads(args.heads)
    needs_data = bool(set(parts) - {"cost", "batch", "ngrams"})  # timings need no conversations (but a greedy verify's:
    # it runs on the target's own text); the phrasebook reads its own
    data = args.data
    if needs_data or ("ngrams" in parts and not args.ngram_data):
        data = _data_file(args.data, "--data")
    if {"tree", "acceptance"} & set(parts) and not Path(args.features).is_dir():
        raise SystemExit(f"--features {args.features}: no such folder; the tree and acceptance parts read the held-out "
                         f"conversations' features: compute them with `medusa-heads features --data {data} --features "
                         f"{args.features}`")
    _check_model(args.model)
    _check_device(args.device)
    torch.set_num_threads(args.threads)
    timed = [p for p in parts if p in TIMED_PARTS]
    load, cores = os.getloadavg()[0], cpu_count()
    if timed and not args.force_cost and load > cores + 0.5:
        _note(f"the load average is {load:.1f} on {cores} cores: other work is running, and timings ({', '.join(timed)}) "
              "taken now will not be stored unless the load falls (--force-cost stores them anyway)")
    conversations = held_out_conversations(read_conversations(data), args.heads) if needs_data else []
    phrase_data = None
    if "ngrams" in parts:  # the heads' held-out prompts are the phrasebook's too
        files = [_data_file(f, "--ngram-data") for f in args.ngram_data] if args.ngram_data else [data]
        every = [c for f in files for c in read_conversations(f)]
        held = held_out_conversations(every, args.heads)
        ids = {c["id"] for c in held}
        phrase_data = ([c for c in every if c["id"] not in ids], held)
    prepack = args.prepack and args.device in (None, "cpu")
    model = MedusaModel.from_pretrained(args.model, heads=args.heads, device_map=args.device, gguf=_check_gguf(args),
                                        prepack=None if prepack else False, allow_base_mismatch=args.allow_base_mismatch,
                                        **_dtype_kwargs(args.dtype, args.device))
    settings = Settings(max_nodes=args.max_nodes, topk=args.topk, context=args.context, repeats=args.repeats,
                        overhead_ms=args.overhead_ms, accept_topk=args.accept_topk, lookup_tokens=args.lookup_tokens,
                        contexts=tuple(int(c) for c in args.contexts.split(",")),
                        batch_rows=_int_list(args.batch_rows, "--batch-rows"))
    calibrate(model, load_tokenizer(args.model), args.heads, parts, conversations,
              args.features, settings, args.report, phrase_data=phrase_data, force_cost=args.force_cost)


def cmd_bench(args: argparse.Namespace) -> None:
    import torch

    from medusa_heads.bench import check_methods, run_batch_bench, run_bench, write_batch_results, write_results

    _check_sampling(args)
    rows = _read_prompts(args.prompts)[: args.limit]
    out = Path(args.out or time.strftime("runs/bench-%Y%m%d-%H%M%S"))
    if out.exists() and not out.is_dir():
        raise SystemExit(f"--out {out}: is a file; give a folder for the results")
    if args.batch_sizes:
        if args.do_sample:
            raise SystemExit("--batch-sizes measures greedy throughput: leave out --do-sample")
        try:
            sizes = [int(b) for b in args.batch_sizes.split(",")]
        except ValueError:
            raise SystemExit(f"--batch-sizes takes comma-separated positive integers, e.g. 1,4,8; got {args.batch_sizes!r}") from None
        if min(sizes) < 1:
            raise SystemExit(f"--batch-sizes takes positive integers, got {args.batch_sizes!r}")
        if len(rows) < max(sizes):
            raise SystemExit(f"--batch-sizes {args.batch_sizes} needs at least {max(sizes)} prompts, {args.prompts} "
                             f"gives {len(rows)}")
    else:
        try:
            methods = check_methods(args.methods.split(","))
        except ValueError as e:
            raise SystemExit(f"--methods: {e}") from None
        _prepare_llamacpp(methods, args)
    torch.set_num_threads(args.threads)
    model, tok = _load_medusa(args)
    cal = model.config.extra.get("calibration")
    if args.batch_sizes:
        result = run_batch_bench(model, tok, rows, sizes, args.max_new_tokens)
        result["settings"]["model"] = args.model
        write_batch_results(result, out)
    else:
        sampling = dict(temperature=args.temperature, top_p=args.top_p) if args.do_sample else None
        if sampling is not None:
            torch.manual_seed(args.seed)
        result = run_bench(model, tok, rows, methods, args.max_new_tokens, sampling, preset=args.preset,
                           long_tokens=args.long_tokens)
        result["settings"]["model"] = args.model
        if sampling is not None:
            result["settings"]["seed"] = args.seed
        if cal:
            result["predicted"] = {"tau": cal["predicted_tau"], "speedup": cal["predicted_speedup"]}
        write_results(result, out, methods)
    print((out / "results.md").read_text())
    if cal and not args.batch_sizes and "medusa" in methods:
        m = result["overall"]["medusa"]
        print(f"calibrated tree: predicted tau {cal['predicted_tau']:.2f} / speed-up {cal['predicted_speedup']:.2f}; "
              f"measured tau {m['mean_accepted']:.2f} / speed-up {m['speedup_vs_hf']:.2f}")
    print(f"results written to {out}", file=sys.stderr)


def _prepare_llamacpp(methods: list[str], args: argparse.Namespace) -> None:
    """llama.cpp built for this CPU (once) before the model loads, so a failed build costs no load."""
    from medusa_heads import llamacpp

    wanted = [m for m in methods if m in llamacpp.METHODS]
    if not wanted:
        return
    if args.do_sample:
        raise SystemExit("--methods: the llama.cpp methods decode greedily; leave out --do-sample or the llamacpp methods")
    try:
        llamacpp.python_binding()
        if any(llamacpp.plain_reference(m) for m in wanted):
            llamacpp.server_binary()
    except llamacpp.LlamaCppError as e:
        raise SystemExit(f"llamacpp: {e}") from None


def cmd_fit(args: argparse.Namespace) -> None:
    from medusa_heads.training.fit import answer_source, fit, parse_budget, process_start

    budget = parse_budget(args.budget)
    remote = dict(server=args.server, server_model=args.server_model, concurrency=args.concurrency,
                  engine=args.engine, vllm_python=args.vllm_python, vllm_args=args.vllm_args)
    answer_source(**remote)  # options that do not go together: one line before anything else
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise SystemExit(f"--out {args.out}: is a file; give a folder for the heads")
    prompts = [_data_file(f, "--prompts") for f in args.prompts] if args.prompts else None
    for f in prompts or []:
        _read_prompts(f)
    _check_file(args.bench_prompts, "--bench-prompts")
    _check_model(args.model)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    fit(args.model, budget, args.out, seed=args.seed, force_cost=args.force_cost, prompts=prompts,
        bench_prompts=args.bench_prompts, max_answers=args.max_answers or 0, max_steps=args.max_steps or 0,
        stop_after=args.stop_after, started=process_start(), log=lambda m: print(m, file=sys.stderr), **remote)


def cmd_export(args: argparse.Namespace) -> None:
    """Write heads in another layout: --format vllm, for the project's vLLM plugin (any heads); vllm-stock, what
    vLLM 0.32's own Medusa reads (Medusa-1 heads only, no plugin); medusa, the reference layout
    (medusa_lm_head.safetensors + config.json)."""
    import torch

    from medusa_heads.checkpoint import (CONFIG_NAME, REFERENCE_WEIGHTS, VLLM_WEIGHTS, export_reference, export_vllm,
                                         export_vllm_plugin, is_reference_dir, load_config, vllm_exportable)
    from medusa_heads.model import MedusaModel

    _check_heads(args.heads_dir, flag="heads directory")
    layouts = _check_export_target(args.heads_dir, args.out, args.force)
    _check_model(args.model)
    if args.format == "vllm-stock" and not is_reference_dir(args.heads_dir):
        vllm_exportable(load_config(args.heads_dir))  # refuse before loading the model
    model = MedusaModel.from_pretrained(args.model, heads=args.heads_dir, prepack=False, draft_dtype=torch.float32,
                                        allow_base_mismatch=args.allow_base_mismatch)  # the weights as stored, fp32
    if args.format == "vllm":
        out = export_vllm_plugin(model.heads, model.base_model, args.out, base_name=args.model, root=args.root,
                                 draft_dtype={"fp32": "float32", "bf16": "bfloat16", "engine": None}[args.draft_dtype])
    else:
        export = export_vllm if args.format == "vllm-stock" else export_reference
        out = export(model.heads, model.target.lm_head.weight, args.out, base_name=args.model)
    written = {REFERENCE_WEIGHTS if args.format == "medusa" else VLLM_WEIGHTS, CONFIG_NAME}
    for name in sorted(set(layouts) - written):  # --force: the folder ends with one layout, the one just written
        (out / name).unlink(missing_ok=True)
    print(f"exported to {out}" + (f" (replaced {', '.join(sorted(layouts))})" if layouts else ""), file=sys.stderr)


def _check_export_target(heads_dir: str, out: str, force: bool) -> list[str]:
    """Refuse an export folder that is a file, the heads directory itself, or that holds files already (unless
    --force). Returns the heads files of any layout there (--force replaces them all: one layout is left)."""
    from medusa_heads.checkpoint import CONFIG_NAME, NGRAMS_NAME, REFERENCE_WEIGHTS, VLLM_WEIGHTS, WEIGHTS_NAME

    target = Path(out)
    if target.exists() and not target.is_dir():
        raise SystemExit(f"{out}: is a file; give a folder to export the heads to")
    if not target.is_dir() or not any(target.iterdir()):
        return []
    if target.resolve() == Path(heads_dir).resolve():
        raise SystemExit(f"{out}: is the heads directory being exported; give another folder")
    names = sorted(p.name for p in target.iterdir())
    if not force:
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise SystemExit(f"{out}: exists and holds files ({shown}); give a new or empty folder, or pass --force to "
                         "replace the heads there (only one layout is left)")
    return [n for n in names if n in (CONFIG_NAME, WEIGHTS_NAME, NGRAMS_NAME, REFERENCE_WEIGHTS, VLLM_WEIGHTS)]
