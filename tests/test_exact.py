"""bf16 made exact: with the row-exact attention (inference/exact_attention.py), a tree verify's every row is, bit for
bit, the plain step that would have computed that token, so greedy output equals plain greedy decoding token for
token."""
from __future__ import annotations

import random

import pytest
import torch

from medusa_heads import MedusaModel
from medusa_heads.inference.cache import crop_to, new_cache
from medusa_heads.inference.exact_attention import NAME, rows_invariant, use_exact_attention, uses_exact_attention
from medusa_heads.inference.verify import Target
from medusa_heads.tree.buffers import from_parents

from conftest import randomize_heads, tiny_model

BF16_ROWS = rows_invariant(torch.bfloat16)
needs_invariant = pytest.mark.skipif(not BF16_ROWS, reason="this CPU's bf16 products round a row differently "
                                     "beside other rows (rows_invariant is False): bf16 cannot be exact here")


def bf16_model(arch: str = "llama", attention: str = NAME, seed: int = 0):
    base = tiny_model(arch, seed=seed).to(torch.bfloat16)
    if attention == NAME:
        use_exact_attention(base)
    else:
        base.set_attn_implementation(attention)
    return base


def random_tree(rng: random.Random, size: int) -> tuple[int, ...]:
    return (-1, *(rng.randrange(i) for i in range(1, size)))


def rows_that_differ(base, trees: int = 6, seed: int = 0, vocab: int = 96,
                     contexts: tuple[int, ...] = (1, 15, 16, 17, 31, 33, 63, 64, 65, 100, 127, 129)) -> tuple[int, int]:
    """(tree rows whose logits differ from the plain steps along their path, rows checked), over random trees at
    contexts that straddle the kernels' blocks."""
    target = Target(base)
    rng = random.Random(seed)
    ids = torch.randint(0, vocab, (1, max(contexts)), generator=torch.Generator().manual_seed(seed))
    differ = total = 0
    for past in rng.sample(contexts, trees):
        cache = new_cache(base, past + 32)
        target.prefill(ids[:, :past], cache)
        buffers = from_parents(random_tree(rng, rng.randint(3, 12)))
        tokens = torch.randint(0, vocab, (buffers.size,), generator=torch.Generator().manual_seed(past))
        tree = target.verify(tokens, past, cache, buffers).logits
        crop_to(cache, past)
        for node in range(buffers.size):
            path = [j for j in range(buffers.size) if buffers.mask[node, j]]  # its ancestors and itself, in order
            for d, j in enumerate(path):
                step = target.step(tokens[j : j + 1], past + d, cache).logits
            crop_to(cache, past)
            differ += not torch.equal(tree[node], step[-1])
            total += 1
    return differ, total


@needs_invariant
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_every_tree_row_is_its_plain_step_bit_for_bit(arch):
    differ, total = rows_that_differ(bf16_model(arch))
    assert total > 30 and differ == 0


@needs_invariant
def test_every_tree_row_of_the_real_model_is_its_plain_step_bit_for_bit():
    """SmolLM2 in bf16, prepacked as generate runs it: random trees at contexts from 16 to 1,024 tokens (with SDPA
    101 of 118 such rows leave their plain steps, with eager attention 7: results/exact/rows.md)."""
    from medusa_heads import default_model_path
    from medusa_heads.loading import load_base

    base = load_base(default_model_path(), dtype=torch.bfloat16, attn_implementation=NAME)
    differ, total = rows_that_differ(base, trees=4, seed=1, vocab=20000, contexts=(16, 31, 300, 1024))
    assert total >= 12 and differ == 0


@needs_invariant
def test_it_is_as_accurate_as_eager_attention():
    """A bf16 attention like any other: against the fp32 model, its logits err as little as transformers' eager and
    SDPA attentions in bf16 do."""
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(4))
    ref = tiny_model("llama")(ids).logits.detach()
    errors = {name: float((bf16_model("llama", name)(ids).logits.float() - ref).abs().max().detach())
              for name in (NAME, "eager", "sdpa")}
    assert errors[NAME] < 1.5 * max(errors["eager"], errors["sdpa"]), errors


@needs_invariant
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_greedy_equals_plain_greedy_token_for_token(arch):
    base = bf16_model(arch)
    assert_greedy_is_plain_greedy(base, randomize_heads(MedusaModel.from_pretrained(base, heads=None, tree="cpu-16")))


def assert_greedy_is_plain_greedy(base, model, prompts: int = 6) -> None:
    """The heads' greedy output is `base.generate`'s token for token on random prompts, and some drafts were
    accepted (the trees really were verified)."""
    accepted = 0
    for seed in range(prompts):
        ids = torch.randint(0, 96, (1, 5 + seed), generator=torch.Generator().manual_seed(seed))
        ref = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False)
        res = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, return_dict_in_generate=True)
        assert torch.equal(res.sequences, ref), f"prompt {seed}"
        accepted += res.stats.mean_accepted > 1
    assert accepted >= 1


def test_from_pretrained_gives_a_bf16_base_it_loads_the_exact_attention(tmp_path):
    base = tiny_model("llama")
    base.save_pretrained(tmp_path / "m")
    model = MedusaModel.from_pretrained(tmp_path / "m", heads=None, dtype=torch.bfloat16)
    assert uses_exact_attention(model.base_model) == BF16_ROWS
    chosen = MedusaModel.from_pretrained(tmp_path / "m", heads=None, dtype=torch.bfloat16, attn_implementation="sdpa")
    assert not uses_exact_attention(chosen.base_model)  # the caller's choice stands
    fp32 = MedusaModel.from_pretrained(tmp_path / "m", heads=None)
    assert not uses_exact_attention(fp32.base_model)  # fp32 keeps the stock attention: its products are not row-invariant


def test_attention_sinks_are_refused_in_one_line():
    from medusa_heads.inference.exact_attention import exact_attention

    q = torch.zeros(1, 2, 1, 4)
    with pytest.raises(ValueError, match="attention sinks are not supported"):
        exact_attention(torch.nn.Module(), q, q, q, None, 1.0, s_aux=torch.zeros(2))
