"""Self-distillation through a serving engine: the answers come from any OpenAI-compatible completions endpoint that
serves the target (vLLM, SGLang, llama.cpp's server, ...), many requests in flight; the hidden states come after,
from `features` (training/features.py), in batches.

Prompts go as token ids (the very ids `distill` would feed the target: its chat template, or the tokenizer's special
tokens for plain text), so the engine's own templating and BOS handling cannot change them. Before any answer is
kept the server is checked against the target: the same tokenizer (where the server has a /tokenize endpoint) and
a few greedy answers compared with the target's own, the count of those that differ reported. Append-only and
resumable like `distill`: each conversation is written when its last turn is answered.
"""
from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from medusa_heads.corpus import PromptRow, append_conversations, read_conversations
from medusa_heads.local_server import LocalServer, free_port
from medusa_heads.prompting import has_chat_template, prompt_text


class ServerError(RuntimeError):
    """The server cannot be used: one line with the cause and what to do."""


@dataclass
class Server:
    url: str  # e.g. http://localhost:8000 (a trailing /v1 is allowed)
    model: str | None = None  # the served model's name; None: the first of /v1/models
    timeout: float = 600.0

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/").removesuffix("/v1")

    def _request(self, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.timeout) as r:
            return json.loads(r.read())

    def served_model(self) -> str:
        if self.model is None:
            try:
                models = self._request("/v1/models").get("data") or []
            except (OSError, ValueError) as e:
                raise ServerError(f"{self.url}/v1/models: {_reason(e)}; is an OpenAI-compatible server running "
                                  "there? (e.g. `vllm serve MODEL`, `llama-server -m MODEL.gguf`)") from None
            if not models:
                raise ServerError(f"{self.url}/v1/models lists no model; name the served one with --server-model")
            self.model = models[0]["id"]
        return self.model

    def complete(self, ids: list[int], max_tokens: int, temperature: float, top_p: float,
                 seed: int) -> tuple[str, bool]:
        """(the answer's text, whether it ended by itself rather than at max_tokens)."""
        body = {"model": self.served_model(), "prompt": ids, "max_tokens": max_tokens, "temperature": temperature,
                "top_p": top_p, "seed": seed, "stream": False}
        res = self._request("/v1/completions", body)
        choice = res["choices"][0]
        return choice["text"], choice.get("finish_reason") != "length"

    def tokenize(self, text: str) -> list[int] | None:
        """The server's token ids for `text` without special tokens, where it has a /tokenize endpoint (vLLM,
        SGLang and llama.cpp do, each its own way); None where it has none."""
        for body in ({"model": self.served_model(), "prompt": text, "add_special_tokens": False},  # vLLM, SGLang
                     {"content": text, "add_special": False}):  # llama.cpp
            try:
                res = self._request("/tokenize", body)
            except (OSError, ValueError):
                continue
            tokens = res.get("tokens")
            if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
                return tokens
        return None


def _reason(e: BaseException) -> str:
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} {e.reason}"
    if isinstance(e, urllib.error.URLError):
        return str(e.reason)
    return str(e) or type(e).__name__


PROBE = "Speculative decoding checks a tree of guesses in one pass: 12 + 30 = 42, naïve café, 東京."


def prompt_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The ids `distill` feeds the target for a reply to `messages`."""
    return tokenizer(prompt_text(tokenizer, messages), add_special_tokens=not has_chat_template(tokenizer))["input_ids"]


def check_server(server: Server, model, tokenizer, rows: list[PromptRow], n: int = 4, max_tokens: int = 32,
                 log=print) -> dict:
    """The server against the target: the same tokenizer (ServerError if not), and the greedy answers to the first
    turns of `n` rows equal to the target's own (max_tokens each; ServerError if none is: another model). Returns
    {"model", "tokenizer": "same" | "not checked (...)", "greedy_checked", "greedy_differ"}."""
    import torch

    served = server.served_model()
    theirs, ours = server.tokenize(PROBE), tokenizer(PROBE, add_special_tokens=False)["input_ids"]
    if theirs is not None and theirs != ours:
        raise ServerError(f"{server.url} serves {served!r} with another tokenizer than the target's ({len(theirs)} "
                          f"tokens against {len(ours)} for the same text): serve the target itself")
    tok_state = "same" if theirs is not None else "not checked (the server has no /tokenize endpoint)"
    differ = []
    checked = rows[:n]
    for row in checked:
        ids = prompt_token_ids(tokenizer, [{"role": "user", "content": row.turns[0]}])
        text, _ = server.complete(ids, max_tokens, 0.0, 1.0, 0)
        with torch.no_grad():
            x = torch.tensor([ids], device=model.device)
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False)
        mine = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
        if text.strip() != mine.strip():
            differ.append(row.id)
    if checked and len(differ) == len(checked):
        raise ServerError(f"none of {len(checked)} greedy answers from {server.url} ({served!r}) equals the "
                          f"target's own: it serves another model, or samples when asked for temperature 0")
    log(f"server check: {served!r} at {server.url}; tokenizer {tok_state}; {len(differ)} of {len(checked)} greedy "
        f"answers ({max_tokens} tokens) differ from the target's own"
        + (f" ({', '.join(differ)}: engines in lower precision part at near-ties; kept)" if differ else ""))
    return {"model": served, "tokenizer": tok_state, "greedy_checked": len(checked), "greedy_differ": len(differ)}


def distill_from_server(server: Server, tokenizer, rows: list[PromptRow], out: str | os.PathLike, *,
                        max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                        max_prompt_tokens: int = 1024, concurrency: int = 16, seed: int = 0,
                        progress: bool = True, stop=None) -> dict:
    """Answer every row not yet in `out` through `server`, `concurrency` requests in flight, and append one
    conversation per row as its last turn is answered (turns of a row in order). Returns counts like `distill`:
    done before, written now, skipped (prompt too long), failed (requests that raised; a rerun retries them).
    stop: called with the counts so far as each row is done; once it returns True the rows not yet sent are left
    (a rerun asks them), those in flight are still written, and counts["stopped"] is True."""
    from tqdm import tqdm

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {r["id"] for r in read_conversations(out, repair=True)}
    todo = [r for r in rows if r.id not in done]
    counts = {"done_before": len(done), "written": 0, "skipped_too_long": 0, "failed": 0, "stopped": False}
    lock = threading.Lock()
    errors: list[str] = []

    def answer(row: PromptRow) -> dict | None:
        conv = []
        for turn in row.turns:
            conv.append({"role": "user", "content": turn})
            ids = prompt_token_ids(tokenizer, conv)
            if len(ids) > max_prompt_tokens:
                with lock:
                    counts["skipped_too_long"] += 1
                return None
            text, finished = server.complete(ids, max_new_tokens, temperature, top_p,
                                             seed + zlib.crc32(f"{row.id}#{len(conv)}".encode()))
            conv.append({"role": "assistant", "content": text, "finished": finished})
        return {"id": row.id, "source": row.source, "messages": conv}

    bar = tqdm(total=len(todo), desc="distill (server)", unit="prompt", disable=not progress)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = {pool.submit(answer, r): r for r in todo}
        for f in as_completed(futures):
            if f.cancelled():  # left by `stop`
                continue
            try:
                conv = f.result()
            except Exception as e:  # noqa: BLE001 - one failed request must not lose the others' answers
                counts["failed"] += 1
                errors.append(f"{futures[f].id}: {_reason(e)}")
                conv = None
            if conv is not None:
                with lock:
                    append_conversations(out, [conv])
                    counts["written"] += 1
            bar.update(1)
            if stop is not None and not counts["stopped"] and stop(counts):
                counts["stopped"] = True
                for other in futures:
                    other.cancel()  # those not yet running; the ones in flight finish and are written
    bar.close()
    counts["seconds"] = round(time.perf_counter() - t0, 1)
    if errors:
        counts["first_error"] = errors[0]
    return counts


VLLM_PYTHON_ENV = "MEDUSA_HEADS_VLLM_PYTHON"


def vllm_python(given: str | None = None) -> str:
    """The interpreter of an environment with vLLM: `given`, else $MEDUSA_HEADS_VLLM_PYTHON, else .venv-vllm's
    (`make vllm-setup`), else this one if it imports vllm. ServerError naming what to do if none has it."""
    import importlib.util
    import sys

    for candidate in (given, os.environ.get(VLLM_PYTHON_ENV), ".venv-vllm/bin/python"):
        if candidate:
            if not Path(candidate).is_file():
                if candidate == given:
                    raise ServerError(f"--vllm-python {given}: no such interpreter")
                continue
            return candidate
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise ServerError("--engine vllm: no vLLM here; install it in an environment of its own (vLLM pins its own "
                      "transformers; `make vllm-setup` makes .venv-vllm) or name its python with --vllm-python")


class VllmEngine:
    """vLLM's OpenAI-compatible server over the target, in a process of its own from the vLLM environment, started
    here and stopped on exit (`with VllmEngine(...) as server:`); its log goes to `log`."""

    def __init__(self, model_dir: str, python: str, log: Path, args: list[str] = (), timeout: float = 900.0) -> None:
        self.port = free_port()
        self.cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host",
                    "127.0.0.1", "--port", str(self.port), "--served-model-name", "target", "--seed", "0", *args]
        self.log, self.timeout = Path(log), timeout
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        self._server = LocalServer(self.cmd, self.port, self.log, "vLLM", ServerError, env=env)

    def __enter__(self) -> Server:
        self._server.start(self.timeout)
        return Server(self._server.url, "target")

    def __exit__(self, *exc) -> None:
        self._server.stop()
