"""The cache keeps exactly the accepted path; stats add up."""
from __future__ import annotations

import pytest
import torch

from medusa_heads import MedusaModel
from medusa_heads.inference.accept import TargetChoice
from medusa_heads.engines.hf import Session, Target
from medusa_heads.engines.hf_cache import new_cache
from medusa_heads.inference.decode import decode
from medusa_heads.inference.plan import DecodePlan
from medusa_heads.inference.propose import HeadsDrafter

from conftest import randomize_heads, tiny_model
from test_greedy import OracleDrafter


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
@pytest.mark.parametrize("budget", [1, 5, 23])
@pytest.mark.parametrize("oracle", [False, True])
@pytest.mark.parametrize("capacity", [None, 64])
def test_cache_equals_a_plain_prefill_of_the_accepted_tokens(arch, budget, oracle, capacity):
    base = tiny_model(arch, seed=2)
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, tree="cpu-16"))
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(3))
    drafter = OracleDrafter(base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=60, do_sample=False), 96) if oracle else HeadsDrafter(model.heads)
    opened = []

    class Recorded(Target):  # the engine, with the one session decode opens kept to look at its cache afterwards
        def session(self, _capacity):
            opened.append(Session(self, new_cache(base, capacity)))
            return opened[-1]

    plan = DecodePlan(drafter, model.tree_buffers, TargetChoice(), None, greedy=False, tree="fixed",
                      max_size=model.tree_buffers.size)
    seq, stats = decode(Recorded(base), plan, ids, budget, set())
    cache = opened[0].cache
    past = cache.get_seq_length()
    assert past == opened[0].past
    # every token but the next root is cached (at EOS or the budget the last emitted token may be cached too)
    assert past in (seq.shape[1] - 1, seq.shape[1])
    assert all(layer.keys.shape[-2] == past for layer in cache.layers)
    ref = new_cache(base)
    with torch.no_grad():
        base(seq[:, :past], cache=ref, use_cache=True)
    for got, want in zip(cache.layers, ref.layers):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=0)


def test_stats_add_up():
    base = tiny_model("llama", seed=3)
    model = MedusaModel.from_pretrained(base, heads=None, tree="cpu-16")
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    ref = base.generate(ids, max_new_tokens=80, do_sample=False)
    for drafter in (None, OracleDrafter(ref, 96)):
        res = model.generate(ids, max_new_tokens=37, drafter=drafter, return_dict_in_generate=True)
        s = res.stats
        assert s.new_tokens == sum(s.tokens_per_step) == res.sequences.shape[1] - ids.shape[1] == 37
        assert sum(s.accept_histogram) == s.steps == len(s.tokens_per_step)
        assert s.mean_accepted == pytest.approx(37 / s.steps)
        assert all(1 <= n <= model.tree.depth + 1 for n in s.tokens_per_step)
        assert set(s.seconds) == {"prefill", "propose", "verify", "accept", "commit"}
    assert s.accept_histogram[-1] > 0 and s.mean_accepted > 3  # the oracle run


def test_streamer_gets_the_prompt_then_each_accepted_chunk():
    class Recorder:
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.flatten().tolist())

        def end(self):
            self.ended = True

    base = tiny_model("llama", seed=3)
    model = MedusaModel.from_pretrained(base, heads=None, tree="chain-4")
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    oracle = OracleDrafter(base.generate(ids, max_new_tokens=40, do_sample=False), 96)
    rec = Recorder()
    res = model.generate(ids, max_new_tokens=23, drafter=oracle, streamer=rec, return_dict_in_generate=True)
    assert rec.ended and rec.chunks[0] == ids[0].tolist()
    assert [len(c) for c in rec.chunks[1:]] == res.stats.tokens_per_step  # one put per accepted chunk
    assert sum(rec.chunks[1:], []) == res.sequences[0, 7:].tolist()


@pytest.mark.parametrize("keep", [[0], [0, 1, 2], [0, 2, 5], [0, 1, 4, 6], [0, 3]])
def test_keep_accepted_keeps_exactly_those_entries_in_order(keep):
    from medusa_heads.engines.hf_cache import keep_accepted

    base = tiny_model("llama", seed=1)
    cache = new_cache(base, 32)
    with torch.no_grad():
        base(torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(0)), cache=cache, use_cache=True)
    past = 4  # a 7-token tree was appended after 4 cached entries
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    keep_accepted(cache, past, torch.tensor(keep))
    rows = list(range(past)) + [past + i for i in keep]
    for layer, (k, v) in zip(cache.layers, before):
        assert torch.equal(layer.keys, k[:, :, rows]) and torch.equal(layer.values, v[:, :, rows])


def test_keep_accepted_rows_packs_each_rows_entries_at_its_own_end():
    from medusa_heads.engines.hf_cache import keep_accepted_rows

    base = tiny_model("llama", seed=1)
    cache = new_cache(base, 32)
    with torch.no_grad():
        base(torch.randint(0, 96, (3, 12), generator=torch.Generator().manual_seed(0)), cache=cache, use_cache=True)
    past = 7  # a 5-token tree per row was appended after 7 slots; row 0's entries end at 7, row 1's at 5, row 2's at 3
    ends = torch.tensor([7, 5, 3])
    keep = torch.tensor([[0, 2, 2], [0, 1, 4], [0, 0, 0]])  # row 0 keeps 2 (padded by repeating), row 1 3, row 2 none
    counts = torch.tensor([2, 3, 0])
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    assert keep_accepted_rows(cache, past, keep, counts, ends) == 9
    for layer, (k, v) in zip(cache.layers, before):
        assert layer.keys.shape[2] == 9
        for b in range(3):
            e, n = int(ends[b]), int(counts[b])
            rows = list(range(e)) + [past + int(i) for i in keep[b, :n]]
            assert torch.equal(layer.keys[b, :, : e + n], k[b, :, rows])
            assert torch.equal(layer.values[b, :, : e + n], v[b, :, rows])
