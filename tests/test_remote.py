"""Distillation through a serving engine: an OpenAI-compatible server stands in (a tiny model behind http.server);
its greedy answers are the target's own, byte for byte what `distill` writes; the server is checked first; a run
that loses requests keeps the rest and a rerun completes it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from medusa_heads.corpus import PromptRow, read_conversations
from medusa_heads.training.distill import distill
from medusa_heads.training.remote import Server, ServerError, check_server, distill_from_server

from conftest import tiny_model, tiny_model_with_tokenizer

ROWS = [PromptRow("a", ["Hello there"], "s"), PromptRow("b", ["Count to five", "and back"], "s"),
        PromptRow("c", ["Name a colour"], "s"), PromptRow("d", ["Why is the sky blue?"], "s")]


class FakeEngine:
    """An OpenAI-compatible completions server over a transformers model (greedy or sampled), with /v1/models and
    vLLM's /tokenize; `fail` (ids) answers HTTP 500 for prompts whose text contains them; `shift_tokens` gives
    another tokenizer's ids."""

    def __init__(self, model, tokenizer, fail: tuple[str, ...] = (), shift_tokens: bool = False, tokenize: bool = True,
                 port: int = 0):
        self.model, self.tok, self.fail, self.shift, self.has_tokenize = model, tokenizer, fail, shift_tokens, tokenize
        self.requests = 0
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    return self._send(200, {"data": [{"id": "tiny"}]})
                if self.path == "/health":
                    return self._send(200, {})
                self._send(404, {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize" and engine.has_tokenize and "prompt" in body:
                    ids = engine.tok(body["prompt"], add_special_tokens=False)["input_ids"]
                    return self._send(200, {"tokens": [t + 1 for t in ids] if engine.shift else ids})
                if self.path != "/v1/completions":
                    return self._send(404, {})
                engine.requests += 1
                ids = body["prompt"]
                if any(f in engine.tok.decode(ids) for f in engine.fail):
                    return self._send(500, {"error": "engine failure"})
                x = torch.tensor([ids])
                kw = dict(do_sample=False) if body["temperature"] == 0 else dict(do_sample=True, temperature=body["temperature"])
                with torch.no_grad():
                    out = engine.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=body["max_tokens"], **kw)
                new = out[0, len(ids):].tolist()
                eos = engine.tok.eos_token_id
                n = next((i + 1 for i, t in enumerate(new) if t == eos), len(new))
                self._send(200, {"choices": [{"text": engine.tok.decode(new[:n], skip_special_tokens=True),
                                              "finish_reason": "stop" if n < len(new) or (new and new[-1] == eos) else "length"}]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


@pytest.fixture
def target(tmp_path):
    tok, base = tiny_model_with_tokenizer(tmp_path / "model")
    return tok, base


def test_the_servers_greedy_answers_are_what_distill_writes(target, tmp_path):
    tok, base = target
    engine = FakeEngine(base, tok)
    try:
        counts = distill_from_server(Server(engine.url), tok, ROWS, tmp_path / "server.jsonl", max_new_tokens=12,
                                     concurrency=3)
    finally:
        engine.close()
    distill(base, tok, ROWS, tmp_path / "local.jsonl", max_new_tokens=12, batch_size=1)
    assert counts["written"] == 4 and counts["failed"] == 0
    by_id = lambda f: {c["id"]: c["messages"] for c in read_conversations(tmp_path / f)}  # noqa: E731
    assert by_id("server.jsonl") == by_id("local.jsonl")  # content, turns and "finished", both turns of b
    assert len(by_id("server.jsonl")["b"]) == 4


def test_lost_requests_keep_the_rest_and_a_rerun_completes_the_run(target, tmp_path):
    tok, base = target
    out = tmp_path / "d.jsonl"
    engine = FakeEngine(base, tok, fail=("Count to five",))
    try:
        first = distill_from_server(Server(engine.url), tok, ROWS, out, max_new_tokens=8, concurrency=2)
    finally:
        engine.close()
    assert first["written"] == 3 and first["failed"] == 1 and first["first_error"].startswith("b: HTTP 500")
    engine = FakeEngine(base, tok)
    try:
        again = distill_from_server(Server(engine.url), tok, ROWS, out, max_new_tokens=8, concurrency=2)
        assert engine.requests == 2  # b's two turns only
    finally:
        engine.close()
    assert again["done_before"] == 3 and again["written"] == 1
    assert sorted(c["id"] for c in read_conversations(out)) == ["a", "b", "c", "d"]


def test_the_server_is_checked_against_the_target_before_any_answer(target):
    tok, base = target
    logs = []
    engine = FakeEngine(base, tok)
    try:
        report = check_server(Server(engine.url + "/v1"), base, tok, ROWS, log=logs.append)
    finally:
        engine.close()
    assert report == {"model": "tiny", "tokenizer": "same", "greedy_checked": 4, "greedy_differ": 0}
    assert logs == ["server check: 'tiny' at " + engine.url + "; tokenizer same; 0 of 4 greedy answers (32 tokens) "
                    "differ from the target's own"]
    other = FakeEngine(base, tok, shift_tokens=True)
    try:
        with pytest.raises(ServerError, match="another tokenizer than the target's"):
            check_server(Server(other.url), base, tok, ROWS, log=logs.append)
    finally:
        other.close()
    wrong = FakeEngine(tiny_model("llama", seed=9, vocab_size=len(tok)), tok, tokenize=False)
    try:
        with pytest.raises(ServerError, match="none of 4 greedy answers") as e:
            check_server(Server(wrong.url), base, tok, ROWS, log=logs.append)
        assert "\n" not in str(e.value)
    finally:
        wrong.close()


def test_a_server_that_is_not_there_is_one_line():
    with pytest.raises(ServerError, match=r"^http://127.0.0.1:9/v1/models: .*is an OpenAI-compatible server running"):
        Server("http://127.0.0.1:9", timeout=2).served_model()


def test_the_command_line_distills_through_a_server_then_computes_features(target, tmp_path, capsys):
    from medusa_heads.cli import main
    from medusa_heads.shards import feature_ids

    tok, base = target
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": r.id, "turns": r.turns}) + "\n" for r in ROWS))
    engine = FakeEngine(base, tok)
    try:
        main(["distill", "--model", str(tmp_path / "model"), "--prompts", str(tmp_path / "p.jsonl"), "--out",
              str(tmp_path / "d.jsonl"), "--server", engine.url, "--max-new-tokens", "8", "--features",
              str(tmp_path / "f"), "--no-prepack"])
    finally:
        engine.close()
    err = capsys.readouterr().err
    assert "server check: 'tiny'" in err and "'written': 4" in err
    assert len(read_conversations(tmp_path / "d.jsonl")) == 4 and feature_ids(tmp_path / "f") >= {"a", "b", "c", "d"}
    with pytest.raises(SystemExit, match="leave out --heads"):
        main(["distill", "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "e.jsonl"), "--server",
              engine.url, "--heads", "medusa_heads/default_heads"])


FAKE_VLLM = """#!/bin/sh
# stands in for a vLLM environment's python: `-m vllm.entrypoints.openai.api_server --model DIR --port P ...`
exec {python} {tests}/test_remote.py "$@"
"""


def test_engine_vllm_starts_a_server_for_the_run_and_stops_it(target, tmp_path, capsys):
    import os
    import sys
    from pathlib import Path

    from medusa_heads.cli import main

    tok, base = target
    fake = tmp_path / "python"
    fake.write_text(FAKE_VLLM.format(python=sys.executable, tests=Path(__file__).parent))
    fake.chmod(0o755)
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": r.id, "turns": r.turns}) + "\n" for r in ROWS))
    main(["distill", "--model", str(tmp_path / "model"), "--prompts", str(tmp_path / "p.jsonl"), "--out",
          str(tmp_path / "d.jsonl"), "--engine", "vllm", "--vllm-python", str(fake), "--max-new-tokens", "8",
          "--no-prepack"])
    err = capsys.readouterr().err
    assert "distill: starting vLLM" in err and "server check: 'target'" in err and "'written': 4" in err
    log = (tmp_path / "d.vllm.log").read_text()
    assert "--served-model-name target" in log  # the command vLLM was given
    distill(base, tok, ROWS, tmp_path / "local.jsonl", max_new_tokens=8, batch_size=1)
    by_id = lambda f: {c["id"]: c["messages"] for c in read_conversations(tmp_path / f)}  # noqa: E731
    assert by_id("d.jsonl") == by_id("local.jsonl")
    pid = int(log.split("pid ", 1)[1].split()[0])
    with pytest.raises(ProcessLookupError):  # stopped when the run ended
        for _ in range(50):
            os.kill(pid, 0)
            import time

            time.sleep(0.1)
    with pytest.raises(SystemExit, match="--vllm-python /nonexistent: no such interpreter$"):
        main(["distill", "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "e.jsonl"), "--engine",
              "vllm", "--vllm-python", "/nonexistent"])


if __name__ == "__main__":  # the stand-in vLLM server (FAKE_VLLM)
    import argparse
    import os
    import sys
    import time

    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("-m")
    ap.add_argument("--model")
    ap.add_argument("--port", type=int)
    known, _ = ap.parse_known_args()
    print(f"pid {os.getpid()} argv {' '.join(sys.argv[1:])}", flush=True)
    FakeEngine(AutoModelForCausalLM.from_pretrained(known.model), AutoTokenizer.from_pretrained(known.model),
               port=known.port)
    while True:
        time.sleep(1)


def test_a_server_started_for_a_run_dies_with_the_run_even_by_kill_9(tmp_path):
    """LocalServer (vLLM's engine, llama.cpp's server): a run killed outright leaves no server behind."""
    import signal
    import textwrap
    import time

    server = tmp_path / "health.py"
    server.write_text(textwrap.dedent('''
        import sys
        from http.server import BaseHTTPRequestHandler, HTTPServer
        class H(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    '''))
    run = tmp_path / "run.py"
    run.write_text(textwrap.dedent(f'''
        import sys, time
        from medusa_heads.local_server import LocalServer, free_port
        port = free_port()
        s = LocalServer([sys.executable, {str(server)!r}, str(port)], port, {str(tmp_path / "log")!r}, "stand-in", RuntimeError)
        s.start(timeout=30)
        print(s.proc.pid, flush=True)
        time.sleep(60)
    '''))
    parent = subprocess.Popen([sys.executable, str(run)], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        if open(f"/proc/{child}/stat").read().split()[2] == "Z":  # exited, not yet reaped
            break
        time.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the server outlived the run that started it")
