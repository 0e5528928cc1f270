"""One model shared by many threads: every call computes exactly what it computes alone."""
from __future__ import annotations

import threading

import pytest
import torch

from medusa_heads import MedusaModel

from conftest import chat_ids, randomize_heads, tiny_model


class Collect:
    """A streamer that keeps what it is given."""

    def __init__(self) -> None:
        self.chunks: list[list[int]] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.chunks.append(value.flatten().tolist())

    def end(self) -> None:
        self.ended = True


def _call(model: MedusaModel, kind: str, seed: int) -> torch.Tensor:
    """One generate call of a given kind; the same (kind, seed) always asks the same thing."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 90, (1, 5 + seed % 7), generator=g)
    if kind == "greedy":
        return model.generate(ids, max_new_tokens=24, prompt_lookup_num_tokens=0)
    if kind == "lookup":
        return model.generate(ids, max_new_tokens=24, prompt_lookup_num_tokens=6)
    if kind == "sample":  # a fixed seed per call: reproducible whatever the other threads do
        return model.generate(ids, max_new_tokens=24, do_sample=True, temperature=0.9, top_p=0.95,
                              prompt_lookup_num_tokens=4, generator=torch.Generator().manual_seed(seed))
    if kind == "batch":
        batch = torch.randint(3, 90, (3, 6), generator=g)
        mask = torch.ones_like(batch)
        mask[1, :2] = 0  # left padding
        batch[1, :2] = 0
        return model.generate(batch, attention_mask=mask, max_new_tokens=16, pad_token_id=0)
    if kind == "stream":
        streamer = Collect()
        out = model.generate(ids, max_new_tokens=20, streamer=streamer, prompt_lookup_num_tokens=5)
        assert streamer.ended and sum(streamer.chunks[1:], []) == out[0, ids.shape[1]:].tolist()
        return out
    if kind == "invalid":  # one thread's bad call raises its own error and disturbs nobody
        with pytest.raises(ValueError, match="input_ids is empty"):
            model.generate(ids[:, :0], max_new_tokens=8)
        with pytest.raises(TypeError, match="does not support"):
            model.generate(ids, max_new_tokens=8, no_such_argument=1)
        return torch.zeros(0)
    raise AssertionError(kind)


KINDS = ["greedy", "lookup", "sample", "batch", "stream", "greedy", "lookup", "invalid"]


def _run_threads(n: int, work) -> list:
    """Run work(i) in n threads started together; returns their results, re-raising the first exception."""
    results, errors = [None] * n, []
    barrier = threading.Barrier(n)

    def run(i: int) -> None:
        try:
            barrier.wait()
            results[i] = work(i)
        except BaseException as e:  # noqa: BLE001 - collected and re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a call never finished"
    if errors:
        raise errors[0]
    return results


def test_eight_threads_on_one_model_compute_what_each_call_computes_alone():
    base = tiny_model("llama", seed=3)
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, condition="path", tree="cpu-16"), std=0.2)
    calls = [[(KINDS[(i + j) % len(KINDS)], 10 * i + j) for j in range(4)] for i in range(8)]  # 8 threads x 4 calls
    alone = {call: _call(model, *call) for thread in calls for call in thread}
    for (kind, seed), out in alone.items():  # the references are themselves exact
        if kind in ("greedy", "lookup"):
            ids = torch.randint(3, 90, (1, 5 + seed % 7), generator=torch.Generator().manual_seed(seed))
            assert torch.equal(out, base.generate(ids, max_new_tokens=24, do_sample=False))

    together = _run_threads(8, lambda i: [_call(model, *call) for call in calls[i]])
    for thread, outs in zip(calls, together):
        for call, out in zip(thread, outs):
            assert torch.equal(out, alone[call]), call


@pytest.mark.real
def test_threads_share_the_real_model_with_the_shipped_heads(real_base):
    base, tok = real_base
    model = MedusaModel.from_pretrained(base, heads="auto")  # prompt lookup on, as shipped
    prompts = ["Translate to French: The cat sleeps on the warm windowsill.",
               "Write a Python function that returns the squares of a list.",
               "What is 17 times 23? Show your working.",
               "Give me three tips for a good night's sleep."]
    ids = [chat_ids(tok, p) for p in prompts]
    alone = [base.generate(x, max_new_tokens=48, do_sample=False) for x in ids]
    together = _run_threads(4, lambda i: model.generate(ids[i], max_new_tokens=48))
    for prompt, out, ref in zip(prompts, together, alone):
        assert torch.equal(out, ref), prompt
