"""Batches: left-padded rows, each accepting its own path, equal transformers' batched generate row for row."""
from __future__ import annotations

import pytest
import torch
from transformers import TextStreamer

from medusa_heads import MedusaModel
from medusa_heads.inference.propose import RowDrafter

from conftest import randomize_heads, tiny_model
from test_sampling import SETTINGS, TREE, VOCAB, exact_joint, p_value

PAD = 0


def padded_batch(lengths: list[int], seed: int = 0, vocab: int = 96) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, width - n :] = torch.randint(1, vocab, (n,), generator=g)
        mask[b, width - n :] = 1
    return ids, mask


class RowOracle(RowDrafter):
    """Drafts each row's true greedy continuation (found by its prefix) at rank 0, for rows in `right`;
    other rows get wrong drafts. Rows thus accept very different numbers of tokens per step."""

    def __init__(self, reference: torch.Tensor, right: set[int], vocab: int = 96) -> None:
        self.reference, self.right, self.vocab = reference, right, vocab

    def draft_row(self, hidden, sequence, buffers):
        n = sequence.shape[0]
        row = next(b for b in range(self.reference.shape[0]) if torch.equal(self.reference[b, :n], sequence))
        ref = torch.cat([self.reference[row], torch.zeros(buffers.size, dtype=torch.long)])
        depth = buffers.depth[1:]
        rank = buffers.draft_index - (depth - 1) * buffers.topk
        truth = ref[n - 1 + depth]
        ok = (rank == 0) & (row in self.right)
        return torch.where(ok, truth, (truth + rank + 1) % self.vocab)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3"])
def test_random_heads_match_batched_greedy(arch):
    base = tiny_model(arch, seed=3)
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, tree="cpu-16"))
    ids, mask = padded_batch([5, 9, 3, 7])
    ref = base.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=30, pad_token_id=PAD, eos_token_id=None)
    assert torch.equal(out, ref)
    for b, n in enumerate([5, 9, 3, 7]):  # and each row is what it would be alone
        alone = base.generate(ids[b : b + 1, -n:], attention_mask=mask[b : b + 1, -n:], max_new_tokens=30, do_sample=False,
                              eos_token_id=None, pad_token_id=PAD)
        assert torch.equal(alone[0, n:], ref[b, ids.shape[1] :])


def test_rows_accept_their_own_paths_and_finish_on_their_own():
    base = tiny_model("llama", seed=4)
    model = MedusaModel.from_pretrained(base, heads=None, tree="cpu-16")
    ids, mask = padded_batch([6, 2, 8], seed=1)
    long = base.generate(ids, attention_mask=mask, max_new_tokens=60, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    new = long[:, ids.shape[1] :]
    eos = int(new[1, 12])  # row 1 ends at its 13th token (or earlier, if that token came before); others may too
    ref = base.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=PAD, eos_token_id=eos)
    res = model.generate(ids, attention_mask=mask, max_new_tokens=40, pad_token_id=PAD, eos_token_id=eos,
                         drafter=RowOracle(long, right={0, 1}), return_dict_in_generate=True)
    assert torch.equal(res.sequences, ref)
    assert (ref[1, ids.shape[1] :] == PAD).any(), "row 1 must finish early and be padded"
    assert res.stats.mean_accepted > 1.5 and max(res.stats.tokens_per_step) > 3  # rows 0 and 1 take long paths
    assert min(res.stats.rows_per_step) < 3  # and some steps run with a row already finished


def test_context_dependent_processors_in_a_batch():
    base = tiny_model("llama", seed=5)
    model = MedusaModel.from_pretrained(base, heads=None, tree="cpu-16")
    ids, mask = padded_batch([4, 7], seed=2)
    settings = dict(max_new_tokens=30, repetition_penalty=1.5, no_repeat_ngram_size=2, pad_token_id=PAD, eos_token_id=None)
    ref = base.generate(ids, attention_mask=mask, do_sample=False, **settings)
    assert torch.equal(model.generate(ids, attention_mask=mask, drafter=RowOracle(ref, right={0, 1}), **settings), ref)


def test_padding_is_inferred_from_pad_token_id_like_transformers():
    base = tiny_model("llama", seed=6)
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, tree="cpu-8"))
    ids, mask = padded_batch([3, 6], seed=3)
    ref = base.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    assert torch.equal(model.generate(ids, max_new_tokens=12, pad_token_id=PAD, eos_token_id=None), ref)


def test_batch_errors_name_the_problem():
    model = MedusaModel.from_pretrained(tiny_model("llama"), heads=None)
    ids, mask = padded_batch([3, 6])
    with pytest.raises(ValueError, match="streamers take one sequence"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=PAD, streamer=TextStreamer(None))
    with pytest.raises(ValueError, match="left-padded"):
        model.generate(ids, attention_mask=mask.flip(1), max_new_tokens=4, pad_token_id=PAD)
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 5\)"):
        model.generate(ids, attention_mask=mask[:, 1:], max_new_tokens=4, pad_token_id=PAD)


def test_batched_sampling_is_exact():
    """The joint law of a padded row's first tokens, sampled in a batch beside another row, is the target's."""
    base = tiny_model("llama", seed=5, vocab_size=VOCAB, initializer_range=0.6)
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, num_heads=3, tree=TREE), std=1.0)
    law = exact_joint(base, torch.tensor([[1, 4, 2]]), **SETTINGS)
    ids, mask = torch.tensor([[PAD, 1, 4, 2], [3, 5, 1, 1]]), torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    g = torch.Generator().manual_seed(99)
    counts, accepted = {}, 0
    for _ in range(2000):
        res = model.generate(ids, attention_mask=mask, max_new_tokens=3, generator=g, pad_token_id=PAD, eos_token_id=None,
                             return_dict_in_generate=True, **SETTINGS)
        key = tuple(res.sequences[0, 4:].tolist())
        counts[key] = counts.get(key, 0) + 1
        accepted += res.stats.steps < 3
    assert accepted > 50
    assert p_value(law, counts) > 1e-3


@pytest.mark.parametrize("condition", ["none", "root", "path"])
def test_drafting_a_batch_equals_drafting_each_row(condition):
    from medusa_heads.inference.propose import HeadsDrafter

    model = randomize_heads(MedusaModel.from_pretrained(tiny_model("llama"), heads=None, condition=condition, tree="cpu-32"))
    drafter, h, roots = HeadsDrafter(model.heads), 0.1 * torch.randn(5, 32), torch.tensor([3, 1, 4, 1, 5])
    batch = drafter.draft_tokens(h, roots, model.tree_buffers)
    rows = torch.stack([drafter.draft(h[b : b + 1], [torch.tensor([7, int(roots[b])])], model.tree_buffers)[0].tokens
                        for b in range(5)])
    assert torch.equal(batch, rows) and batch.shape == (5, model.tree.num_nodes)
