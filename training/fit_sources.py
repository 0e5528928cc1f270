"""fit's inputs: the prompts it distills from (decontaminated against the bench files) and where the answers come
from (this process, a server, or a vLLM started for the phase)."""
from __future__ import annotations

import contextlib
import random
import shlex
from pathlib import Path

from medusa_heads.calibration.measure import second_half
from medusa_heads.corpus import PromptRow, is_eval, read_prompts, subsample
from medusa_heads.default_model import DEFAULT_MODEL, resolve_model
from medusa_heads.prompting import has_chat_template
from medusa_heads.training.remote import Server, ServerError, VllmEngine, vllm_python

SERVER_CHECK_TIMEOUT = 10.0  # seconds the server has to list its models before the model loads
SOURCE_CAPS = {"gsm8k-train": 2000}  # the shipped heads' distill cap (configs/train/smollm2-135m.yaml): GSM8K is
# 7,500 of the 12,126 training prompts


# ---- prompts -------------------------------------------------------------------------------------------------------

def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def bench_prompt_keys(bench_files: list[str]) -> tuple[set[str], set[str]]:
    """The ids and the normalised turn texts of every prompt in the bench files: what training must not see."""
    rows = [r for f in bench_files for r in read_prompts(f)]
    return {r.id for r in rows}, {_norm(t) for r in rows for t in r.turns}


def training_prompts(prompts: list[str], bench_files: list[str], seed: int) -> list[PromptRow]:
    """The prompts of `prompts` files, less every one whose id or any turn's text is in a bench file, shuffled
    (seeded) together."""
    bench_ids, bench_text = bench_prompt_keys(bench_files)
    rows = [r for f in prompts for r in read_prompts(f)
            if r.id not in bench_ids and not any(_norm(t) in bench_text for t in r.turns)]
    random.Random(seed).shuffle(rows)
    return rows


def unseen(rows: list[PromptRow], bench_files: list[str]) -> list[PromptRow]:
    """The rows whose first turn's text is in no bench file (the prompts a model wrote itself)."""
    known = bench_prompt_keys(bench_files)[1]
    return [r for r in rows if _norm(r.turns[0]) not in known]


def take(pool: list[PromptRow], n: int, fraction: float) -> list[PromptRow]:
    """The first n rows of the pool, with at least two held-out ones in each half of calibrate's split (else
    training has nothing to evaluate on, and calibrate nothing to fit on one half and test on the other)."""
    rows = pool[:n]
    for half in (False, True):
        held = sum(is_eval(r.id, fraction) and second_half(r.id) == half for r in rows)
        rows += [r for r in pool[n:] if is_eval(r.id, fraction) and second_half(r.id) == half][: max(0, 2 - held)]
    return rows


def prompt_pool(state, tok, prompts, bench_files) -> tuple[list[str], bool, list[str], list[PromptRow]]:
    """(prompt files, whether the model's own prompts join them, bench files, the pool: decontaminated, capped,
    shuffled, short enough)."""
    files = prompts or ["data/train_prompts.jsonl.gz"]
    chat = prompts is None and has_chat_template(tok)
    if chat and str(state["model"]) == DEFAULT_MODEL:
        files = files + ["data/self_prompts.jsonl.gz"]  # written by this model already (scripts/make_self_prompts.py)
    bench = (bench_files if bench_files is not None
             else sorted(str(p) for p in Path("data").glob("bench_prompts*.jsonl")))
    pool = [r for r in subsample(training_prompts(files, bench, state["seed"]), SOURCE_CAPS, state["seed"])
            if sum(map(len, r.turns)) <= state["rules"]["max_prompt_chars"]]
    return files, chat, bench, pool


# ---- where the answers come from -----------------------------------------------------------------------------------

def answer_source(server: str | None = None, server_model: str | None = None, concurrency: int | None = None,
                  engine: str | None = None, vllm_python: str | None = None,
                  vllm_args: str | list[str] | None = None) -> dict:
    """fit's answer source from its options: {"kind": "transformers"} (this process), {"kind": "server", "url",
    "model", "concurrency"} or {"kind": "vllm", "python", "args", "concurrency"}. ValueError (one line) for options
    that do not go together; nothing is contacted here (check_source does that)."""
    if server and engine:
        raise ValueError("--server and --engine both name where the answers come from: give one")
    if engine not in (None, "vllm"):
        raise ValueError(f"--engine takes vllm, got {engine!r}")
    if server_model and not server:
        raise ValueError("--server-model names the model served at --server: give --server URL too")
    if concurrency is not None and not (server or engine):
        raise ValueError("--concurrency is the number of requests in flight to --server or --engine: give one")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"--concurrency must be positive, got {concurrency}")
    for flag, given in (("--vllm-python", vllm_python), ("--vllm-args", vllm_args)):
        if given and engine != "vllm":
            raise ValueError(f"{flag} is for --engine vllm: give --engine vllm too, or leave it out")
    if server:
        return {"kind": "server", "url": server.rstrip("/").removesuffix("/v1"), "model": server_model,
                "concurrency": concurrency or 16}
    if engine:
        args = shlex.split(vllm_args) if isinstance(vllm_args, str) else list(vllm_args or [])
        return {"kind": "vllm", "python": vllm_python, "args": args, "concurrency": concurrency or 16}
    return {"kind": "transformers"}


def check_source(source: dict) -> dict:
    """Before the model loads: the server answers (its served model's name is filled in), or vLLM's python is found.
    ValueError in one line if not."""
    try:
        if source["kind"] == "server":
            source["model"] = Server(source["url"], source.get("model"), timeout=SERVER_CHECK_TIMEOUT).served_model()
        elif source["kind"] == "vllm":
            source["python"] = vllm_python(source.get("python"))
    except ServerError as e:
        raise ValueError(("--server: " if source["kind"] == "server" else "") + str(e)) from None
    return source


def source_text(source: dict | None) -> str:
    """Where the answers come from, for the plan, the log and the report."""
    kind = (source or {}).get("kind", "transformers")
    if kind == "server":
        return f"the server {source.get('model')!r} at {source['url']}"
    if kind == "vllm":
        return f"vLLM started for the phase ({source.get('python')})"
    return "this process (transformers' generate)"


def source_flag(source: dict) -> str:
    return {"server": f"--server {source.get('url')}", "vllm": "--engine vllm"}.get(source["kind"],
                                                                                   "neither --server nor --engine")


@contextlib.contextmanager
def serving(state: dict, out: Path, log):
    """The answers' server for the phase: the one given, or a vLLM started here and stopped on leaving."""
    source = state["source"]
    if source["kind"] == "server":
        yield Server(source["url"], source.get("model"))
        return
    log(f"fit: starting vLLM ({source['python']}) on {state['model']}; its log: {out / 'vllm.log'}")
    with VllmEngine(str(resolve_model(state["model"])), source["python"], out / "vllm.log", source["args"]) as server:
        source["url"], source["model"] = server.url, server.model
        yield server
