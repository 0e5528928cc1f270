"""The greedy verify's argmax through a bf16 screen of the LM head (medusa_heads/kernels/screen.py): always the model's own."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import randomize_heads, tiny_model
from medusa_heads import MedusaModel
from medusa_heads.kernels.prepack import bf16_supported
from medusa_heads.kernels.screen import ArgmaxScreen
from medusa_heads.engines.hf import Target

needs_bf16 = pytest.mark.skipif(not bf16_supported(), reason="the screen runs only on CPUs with oneDNN bf16 kernels")


class CountingHead(nn.Linear):
    """An LM head that counts the rows it scores for the screen (its fallback)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias=False)
        self.weight.data.copy_(weight)
        self.rows = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows += x.shape[0]
        return super().forward(x)


def hard_vocabulary(seed: int = 0, vocab: int = 600, width: int = 96, pairs: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, hidden): in hidden row p, tokens 2p and 2p + 1 lead every other token by ~10 with logits near 0.05,
    where bf16 rounds finely, and differ by an fp32 gap of ~3e-3 that bf16's rounding of the inputs reverses in some
    rows (2p + 1 is 2p plus noise of 3e-4; fp32 rescoring settles them), or by ~1e-7, below fp32's error bound (one
    entry scaled by 1 + 1e-6; the model's own head settles those), or not at all (an exact duplicate: argmax's
    lowest id). Then a few ordinary rows."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, width, generator=g) * 0.1
    w[:, :pairs] = -1.0  # dims 0..pairs-1 select a pair; the rest carry the scores
    h = torch.zeros(pairs, width)
    for p in range(pairs):
        r = torch.randn(width - pairs, generator=g)
        h[p, p], h[p, pairs:] = 10.0, r
        a = 2 * p
        w[a, p] = w[a + 1, p] = 0.0
        rest = w[a, pairs:] - (w[a, pairs:] @ r) / (r @ r) * r + 0.05 * r / (r @ r)  # a scores exactly ~0.05
        w[a, pairs:] = w[a + 1, pairs:] = rest
        if p % 5 == 3:
            w[a + 1, pairs + int(rest.abs().argmax())] *= 1.0 + 1e-6
        elif p != pairs - 1:  # the last pair stays an exact tie
            w[a + 1, pairs:] += torch.randn(width - pairs, generator=g) * 3e-4
    return w, torch.cat([h, torch.randn(8, width, generator=g) * 3.0])


@needs_bf16
def test_screen_gives_the_models_argmax_at_near_ties_and_ties():
    w, h = hard_vocabulary()
    head = CountingHead(w)
    screen = ArgmaxScreen(head.weight, head)
    want = torch.stack([head(h[r : r + 1]).argmax(-1)[0] for r in range(h.shape[0])])  # one row at a time, as generate
    head.rows = 0
    got = screen(h)
    assert torch.equal(got, want)
    # bf16 scores alone put the wrong twin strictly first in some rows: the fp32 rescoring decided them, and the
    # exact tie and the 1e-6 twins fell back to the model's head
    s = (h.to(torch.bfloat16) @ w.to(torch.bfloat16).T).float()
    assert int((s.gather(1, s.argmax(-1, keepdim=True))[:, 0] > s.gather(1, want[:, None])[:, 0]).sum()) >= 2
    assert 4 <= head.rows < h.shape[0]
    assert int(want[19]) == 38  # the tie: the lowest id, as argmax breaks it


@needs_bf16
def test_screen_looks_past_its_top_scores_when_more_tokens_tie():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(3000, 64, generator=g) * 0.1
    w[1000:1050] = w[7]  # 51 tokens tie, more than the screen examines one by one
    head = CountingHead(w)
    h = torch.stack([w[7] / w[7].norm() * 30.0, torch.randn(64, generator=g) * 3.0])
    assert ArgmaxScreen(head.weight, head)(h)[0] == 7  # the lowest id of the tie, as argmax breaks it
    w[7] = 0.0  # now the tie starts at 1000, past whatever order topk gave the tied scores in
    head = CountingHead(w)
    assert ArgmaxScreen(head.weight, head)(h)[0] == 1000


@needs_bf16
def test_screen_never_calls_the_head_on_clear_rows_and_survives_non_finite_input():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(4000, 64, generator=g) * 0.1
    head = CountingHead(w)
    screen = ArgmaxScreen(head.weight, head)
    h = torch.randn(32, 64, generator=g) * 5.0
    assert torch.equal(screen(h), torch.stack([head(h[r : r + 1]).argmax(-1)[0] for r in range(32)]))
    head.rows = 0
    bad = h.clone()
    bad[3, 0] = torch.inf
    assert torch.equal(screen(bad), head(bad).argmax(-1))  # no bound to prove with: the model's own logits


@needs_bf16
def test_screen_serves_plain_fp32_models_only():
    assert Target(tiny_model("llama")).screen.get() is not None
    assert Target(tiny_model("gemma2")).screen.get() is None  # caps its logits: not its LM head's output
    assert Target(tiny_model("llama").to(torch.bfloat16)).screen.get() is None  # nothing to save


@needs_bf16
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_decoding_through_the_screen_matches_generate(arch, monkeypatch):
    calls = []
    original = ArgmaxScreen.__call__
    monkeypatch.setattr(ArgmaxScreen, "__call__", lambda self, h: calls.append(h.shape[0]) or original(self, h))
    base = tiny_model(arch, initializer_range=0.02)  # flat logits: near-ties everywhere
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, num_heads=3, tree="cpu-16"))
    for seed in range(3):
        ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(seed))
        out = model.generate(ids, max_new_tokens=24)
        ref = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
        assert torch.equal(out, ref), (arch, seed)
    assert calls  # the verifies went through the screen
    batch = torch.randint(0, 96, (3, 7), generator=torch.Generator().manual_seed(9))
    out = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=16, pad_token_id=0)
    ref = base.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)


@needs_bf16
def test_screen_on_the_real_models_hidden_states(real_base):
    base, _ = real_base
    target = Target(base)
    screen = target.screen.get()
    assert screen is not None
    ids = torch.arange(1000, 1160)[None]
    with torch.no_grad():
        hidden = target.screen.decoder(input_ids=ids).last_hidden_state[0]
        want = torch.stack([base.lm_head(hidden[r : r + 1]).argmax(-1)[0] for r in range(hidden.shape[0])])
    assert torch.equal(screen(hidden), want)
