"""Every layer type a model brings: the model matrix (tests/families.py) past its window, rows, batches and sampling.

Windows are 16 tokens; prompts are three windows long and answers cross the window again, with drafters that are
right (so accepted paths are committed across the window's edge) and random heads (mostly wrong). Each windowed
family's control shows that its window changes its output (a window transformers ignored would leave nothing to
test), and the sampling law past a window is tested against the law without it."""
from __future__ import annotations

import copy
import threading

import pytest
import torch

from medusa_heads import MedusaModel
from medusa_heads.kernels import layers
from medusa_heads.inference.propose import RowDrafter

from conftest import randomize_heads
from families import FAMILIES, REFUSED, WINDOW, tiny_family
from test_batch import PAD, RowOracle, padded_batch
from test_greedy import OracleDrafter
from test_sampling import VOCAB, p_value

NEW = 24
PROMPT = 3 * WINDOW
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=PAD)
WINDOW_KEYS = ("sliding_window", "attention_chunk_size")
WINDOWED = sorted(name for name, (_, extra) in FAMILIES.items() if any(key in extra for key in WINDOW_KEYS))


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
    """The sampling path (warpers, the exact accept rule) over the window's masks: every token drawn among the top 3
    sampled from is among the target's own top 3 at its place, with the window (which the control below shows moves
    the top tokens), and the answer is not the greedy one."""
    name, base, model = family
    ids = torch.randint(1, 96, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    greedy = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, **GREEDY)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=True, top_k=3,
                         temperature=1.5, eos_token_id=None, pad_token_id=PAD, generator=torch.Generator().manual_seed(0))
    assert out.shape == greedy.shape and not torch.equal(out, greedy), name
    with torch.no_grad():
        logits = base(out[:, :-1], attention_mask=torch.ones_like(out[:, :-1])).logits[0, PROMPT - 1 :]
    drawn = logits.gather(-1, out[0, PROMPT:, None])[:, 0]
    third = logits.topk(3, dim=-1).values[:, -1]
    assert bool((drawn >= third - 1e-4).all()), (name, (drawn < third - 1e-4).nonzero().flatten().tolist())


def widened(base):
    """The same weights with every window as long as the model's positions: the model its window was meant to change."""
    config = copy.deepcopy(base.config)
    for key in WINDOW_KEYS:
        if getattr(config, key, None) is not None:
            setattr(config, key, config.max_position_embeddings)
    wide = type(base)(config).eval()
    wide.load_state_dict(base.state_dict())
    return wide


@pytest.mark.parametrize("name", WINDOWED)
def test_the_window_changes_the_output(name):
    """The control of this file's tests, per windowed family: past the window, the top tokens the tests compare are
    not the ones of the same weights without it; within it, the logits are."""
    base = tiny_family(name, seed=3)
    ids = torch.randint(1, 96, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        windowed, wide = base(ids).logits[0], widened(base)(ids).logits[0]
    torch.testing.assert_close(windowed[:WINDOW], wide[:WINDOW], rtol=1e-5, atol=1e-5)
    assert not torch.equal(windowed[WINDOW:].argmax(-1), wide[WINDOW:].argmax(-1)), name


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_families_with_recurrent_or_shared_layers_are_refused_at_load(name):
    base = tiny_family(name)
    with pytest.raises(ValueError, match="is not supported: its|is not supported: some of its") as err:
        MedusaModel.from_pretrained(base, heads=None)
    assert "\n" not in str(err.value)


def test_the_probe_refuses_a_model_whose_window_would_be_ignored(monkeypatch):
    """A layout without the window (the bug this file guards against) fails the load probe, not an answer."""
    full = layers.AttentionLayout((layers.FULL,), (WINDOW,), False)  # the probe still runs past the window
    monkeypatch.setattr("medusa_heads.engines.hf.attention_layout", lambda model: full)
    base = tiny_family("mistral")
    with pytest.raises(ValueError, match="does not apply a custom 4D attention mask"):
        MedusaModel.from_pretrained(base, heads=None)


def test_the_probe_runs_past_the_window(monkeypatch):
    from medusa_heads.engines.hf import Target

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


SAMPLING = dict(do_sample=True, temperature=0.9, top_k=4, top_p=0.95)
DRAWN = 3  # tokens drawn per sample: their joint law over VOCAB ** DRAWN sequences is enumerated


def joint_law(base, ids: torch.Tensor) -> dict[tuple[int, ...], float]:
    """P(the first DRAWN tokens after ids) under SAMPLING, with transformers' own processors and warpers: every
    prefix of one length in one forward."""
    from transformers import GenerationConfig

    from medusa_heads.inference.sampling import build_processors, build_warpers

    config = GenerationConfig(**{**GenerationConfig._get_default_generation_params(), **SAMPLING})
    processors, warpers = build_processors(config, ids.shape[1]), build_warpers(config)
    law: dict[tuple[int, ...], float] = {(): 1.0}
    for i in range(DRAWN):
        prefixes = list(law)
        drawn = torch.tensor(prefixes, dtype=torch.long).view(len(prefixes), i)
        x = torch.cat([ids.expand(len(prefixes), -1), drawn], dim=1)
        with torch.no_grad():
            logits = base(x).logits[:, -1]
        p = torch.softmax(warpers(x, processors(x, logits)), dim=-1)
        law = {(*prefix, t): law[prefix] * float(p[r, t]) for r, prefix in enumerate(prefixes) for t in range(VOCAB)}
    assert abs(sum(law.values()) - 1) < 1e-4
    return law


@pytest.mark.parametrize("layout, family, window", [
    ("sliding and full", "qwen2", {"sliding_window": 4}),
    ("sliding", "mistral", {"sliding_window": 4}),
    ("chunked", "llama4", {"attention_chunk_size": 4}),
], ids=["sliding-and-full", "sliding", "chunked"])
def test_exact_sampling_past_the_window(layout, family, window):
    """The joint law of the first tokens after a prompt three windows long, sampled (temperature, top-k, top-p) in
    batches of 250 rows with random drafts: the target's law, by a chi-square test; the law of the same weights
    without the window, which a sampler that ignored it would follow, is rejected by the same test on the same draws."""
    base = tiny_family(family, seed=5, vocab_size=VOCAB, initializer_range=0.3, **window)
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, num_heads=3,
                                                        tree=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]), std=1.0)
    ids = torch.tensor([[1, 4, 2, 3, 5, 0, 4, 1, 3, 2, 5, 4]])
    rows, generator = 250, torch.Generator().manual_seed(7)
    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    for _ in range(8):
        res = model.generate(ids.expand(rows, -1), attention_mask=torch.ones(rows, ids.shape[1], dtype=torch.long),
                             max_new_tokens=DRAWN, generator=generator, eos_token_id=None, pad_token_id=PAD,
                             drafter=RandomDrafter(VOCAB), return_dict_in_generate=True, **SAMPLING)
        for sample in res.sequences[:, ids.shape[1] :].tolist():
            counts[tuple(sample)] = counts.get(tuple(sample), 0) + 1
        accepted += res.stats.new_tokens - sum(res.stats.rows_per_step)  # drafted tokens accepted
    assert sum(counts.values()) == 8 * rows and accepted > 8 * rows * DRAWN // 20
    law = joint_law(base, ids)
    assert sum(p * 8 * rows >= 5 for p in law.values()) >= 10, "a law spread enough to test"
    assert p_value(law, counts) > 1e-3, layout
    assert p_value(joint_law(widened(base), ids), counts) < 1e-6, layout


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
