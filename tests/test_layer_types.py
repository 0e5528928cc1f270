"""Every layer type a model brings: the model matrix (tests/families.py) past its window, rows, batches and sampling.

Windows are 16 tokens; prompts are three windows long and answers cross the window again, with drafters that are
right (so accepted paths are committed across the window's edge) and random heads (mostly wrong)."""
from __future__ import annotations

import threading

import pytest
import torch

from medusa_heads import MedusaModel
from medusa_heads.inference import layers
from medusa_heads.inference.propose import RowDrafter

from conftest import randomize_heads
from families import FAMILIES, REFUSED, WINDOW, tiny_family
from test_batch import PAD, RowOracle, padded_batch
from test_greedy import OracleDrafter
from test_sampling import SETTINGS, VOCAB, exact_joint, p_value, sample_counts

NEW = 24
PROMPT = 3 * WINDOW
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=PAD)


def medusa(base, tree="cpu-16") -> MedusaModel:
    return randomize_heads(MedusaModel.from_pretrained(base, heads=None, tree=tree))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    base = tiny_family(request.param, seed=3)
    return request.param, base, medusa(base)


def test_rows_match_transformers_past_the_window(family):
    name, base, model = family
    ids = torch.randint(1, 96, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ref = base.generate(ids, attention_mask=mask, max_new_tokens=NEW + 8, **GREEDY)
    for drafter in (None, OracleDrafter(ref, 96)):
        res = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, drafter=drafter, return_dict_in_generate=True,
                             **GREEDY)
        assert torch.equal(res.sequences, ref[:, : PROMPT + NEW]), (name, drafter)
    assert res.stats.steps <= NEW // 2, "the oracle's drafts must be accepted across the window"


def test_batches_match_transformers_past_the_window(family):
    name, base, model = family
    lengths = [PROMPT, 30, 10]  # the short rows cross the window while decoding
    ids, mask = padded_batch(lengths, seed=1)
    ref = base.generate(ids, attention_mask=mask, max_new_tokens=NEW, **GREEDY)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, **GREEDY)
    assert torch.equal(out, ref), name
    oracle = RowOracle(ref, right={0, 2})  # rows accept different lengths: stale slots between their ends
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=NEW, drafter=oracle, **GREEDY), ref), name


def test_sampling_runs_past_the_window(family):
    """The sampling path (warpers, the exact accept rule) over the window's masks: top_k=1 draws the argmax."""
    name, base, model = family
    ids = torch.randint(1, 96, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    ref = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, **GREEDY)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=True, top_k=1,
                         eos_token_id=None, pad_token_id=PAD, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, ref), name


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_families_with_recurrent_or_shared_layers_are_refused_at_load(name):
    base = tiny_family(name)
    with pytest.raises(ValueError, match="is not supported: its|is not supported: some of its") as err:
        MedusaModel.from_pretrained(base, heads=None)
    assert "\n" not in str(err.value)


def test_the_probe_refuses_a_model_whose_window_would_be_ignored(monkeypatch):
    """A layout without the window (the bug this file guards against) fails the load probe, not an answer."""
    full = layers.AttentionLayout((layers.FULL,), (WINDOW,), False)  # the probe still runs past the window
    monkeypatch.setattr("medusa_heads.inference.verify.attention_layout", lambda model: full)
    base = tiny_family("mistral")
    with pytest.raises(ValueError, match="does not apply a custom 4D attention mask"):
        MedusaModel.from_pretrained(base, heads=None)


def test_the_probe_runs_past_the_window(monkeypatch):
    from medusa_heads.inference.verify import Target

    lengths, prefill = [], Target.prefill
    monkeypatch.setattr(Target, "prefill", lambda self, ids, cache: lengths.append(ids.shape[1]) or prefill(self, ids, cache))
    MedusaModel.from_pretrained(tiny_family("gemma2"), heads=None)
    assert lengths == [WINDOW + 2]


class RandomDrafter(RowDrafter):
    """Drafts uniform random tokens of its own generator: never the target's output, often right on a tiny vocabulary."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab, self.generator = vocab, torch.Generator().manual_seed(seed)

    def draft_row(self, hidden, sequence, buffers):
        return torch.randint(0, self.vocab, (buffers.size - 1,), generator=self.generator)


def test_exact_sampling_past_a_sliding_window():
    """The joint law of the first tokens after a prompt three windows long, on sliding and full layers mixed."""
    base = tiny_family("qwen2", seed=5, vocab_size=VOCAB, initializer_range=0.6, sliding_window=4)
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, num_heads=3,
                                                        tree=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]), std=1.0)
    ids = torch.tensor([[1, 4, 2, 3, 5, 0, 4, 1, 3, 2, 5, 4]])
    law = exact_joint(base, ids, **SETTINGS)
    counts, _, accepted = sample_counts(model, ids, 2000, torch.Generator().manual_seed(7), eos_token_id=None,
                                        attention_mask=torch.ones_like(ids), drafter=RandomDrafter(VOCAB),
                                        **SETTINGS)
    assert accepted > 200
    assert p_value(law, counts) > 1e-3


def test_streaming_and_threads_on_a_sliding_model():
    base = tiny_family("gemma3", seed=4)
    model = medusa(base)
    prompts = [torch.randint(1, 96, (1, PROMPT + 7 * i), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    refs = [base.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=NEW, **GREEDY) for p in prompts]
    got = [None] * len(prompts)

    def work(i):
        got[i] = model.generate(prompts[i], attention_mask=torch.ones_like(prompts[i]), max_new_tokens=NEW, **GREEDY)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(g, r) for g, r in zip(got, refs))

    class Collect:
        def __init__(self):
            self.chunks = []

        def put(self, x):
            self.chunks.append(x.flatten())

        def end(self):
            pass

    streamer = Collect()
    model.generate(prompts[0], max_new_tokens=NEW, streamer=streamer, **GREEDY)
    assert torch.equal(torch.cat(streamer.chunks), refs[0][0])
