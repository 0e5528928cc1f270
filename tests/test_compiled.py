"""The compiled target (inference/compiled.py): a torch.compile graph over a static cache, trees padded to buckets,
giving the same greedy output as transformers' generate and a verify equal to the eager one's."""
from __future__ import annotations

import threading

import pytest
import torch

from medusa_heads import MedusaModel
from medusa_heads.inference.cache import keep_accepted
from medusa_heads.inference.compiled import BUCKETS, CompiledTarget, bucket, cache_length
from medusa_heads.inference.prepack import prepack_linears, prepack_supported
from medusa_heads.inference.verify import Target
from medusa_heads.tree.buffers import TreeBuffers, from_parents

from conftest import randomize_heads, tiny_model
from test_greedy import OracleDrafter

pytestmark = pytest.mark.skipif(not hasattr(torch, "compile"), reason="this PyTorch has no torch.compile")


def test_buckets_and_cache_lengths():
    assert [bucket(t) for t in (1, 2, 4, 5, 8, 9, 16, 17, 32)] == [1, 4, 4, 8, 8, 16, 16, 32, 32]
    with pytest.raises(ValueError, match="larger than the largest compiled bucket"):
        bucket(BUCKETS[-1] + 1)
    assert [cache_length(n) for n in (1, 512, 513, 1500, 5000)] == [512, 512, 1024, 2048, 8192]


@pytest.mark.parametrize("prepack", [False, True])
def test_compiled_greedy_equals_generate(prepack):
    if prepack and not prepack_supported():
        pytest.skip("this PyTorch build has no oneDNN packed linear")
    base = tiny_model("llama", seed=3)
    ref_base = tiny_model("llama", seed=3)
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, tree="cpu-16", prepack=prepack,
                                                        compile=True))
    assert isinstance(model.target, CompiledTarget)
    for seed in range(2):
        ids = torch.randint(0, 96, (1, 5 + 7 * seed), generator=torch.Generator().manual_seed(seed))
        ref = ref_base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
        res = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, return_dict_in_generate=True)
        assert torch.equal(res.sequences, ref), f"prompt {seed}"
        # the oracle: every draft right, so whole paths are kept and moved in the static cache
        res = model.generate(ids, max_new_tokens=40, drafter=OracleDrafter(ref, 96), return_dict_in_generate=True)
        assert torch.equal(res.sequences, ref[:, : res.sequences.shape[1]])
        assert max(res.stats.tokens_per_step) > 2
    assert {b for b, _ in model.target.compiled} <= set(BUCKETS)


def _random_tree(size: int, seed: int) -> TreeBuffers:
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, size)]
    return from_parents(tuple(parents), torch.device("cpu"))


def test_compiled_verify_equals_eager_and_keeps_the_same_entries():
    base = tiny_model("llama", seed=4)
    prepack_linears(base)
    eager, compiled = Target(base), CompiledTarget(base)
    ids = torch.randint(0, 96, (1, 37), generator=torch.Generator().manual_seed(0))
    e_cache, c_cache = eager.new_cache(100), compiled.new_cache(100)
    torch.testing.assert_close(compiled.prefill(ids, c_cache).logits, eager.prefill(ids, e_cache).logits,
                               atol=1e-5, rtol=0)
    past = ids.shape[1]
    for step, size in enumerate((6, 3, 11)):  # padded to buckets 8, 4 and 16
        buffers = _random_tree(size, step)
        tokens = torch.randint(0, 96, (size,), generator=torch.Generator().manual_seed(10 + step))
        want = eager.verify(tokens, past, e_cache, buffers)
        got = compiled.verify(tokens, past, c_cache, buffers)
        torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(got.hidden, want.hidden, atol=1e-5, rtol=0)
        leaf = int(buffers.depth.argmax())
        keep = torch.tensor(sorted({leaf, *[int(i) for i in buffers.mask[leaf].nonzero()[:, 0]]}))
        keep_accepted(e_cache, past, keep)
        compiled.keep_accepted(c_cache, past, keep)
        past += keep.shape[0]
        for e, c in zip(e_cache.layers, c_cache.layers):
            torch.testing.assert_close(c.keys[:, :, :past], e.keys, atol=1e-5, rtol=0)
            torch.testing.assert_close(c.values[:, :, :past], e.values, atol=1e-5, rtol=0)
            assert int(c.cumulative_length) == past
    torch.testing.assert_close(compiled.step(torch.tensor([5]), past, c_cache).logits,
                               eager.step(torch.tensor([5]), past, e_cache).logits, atol=1e-5, rtol=0)


def test_compiled_serves_threads_with_their_own_caches():
    base = tiny_model("llama", seed=5)
    ref_base = tiny_model("llama", seed=5)
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, tree="cpu-16", compile=True))
    prompts = [torch.randint(0, 96, (1, 6 + 5 * i), generator=torch.Generator().manual_seed(20 + i)) for i in range(3)]
    refs = [ref_base.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=30, do_sample=False) for p in prompts]
    model.generate(prompts[0], max_new_tokens=30)  # the graphs, made before the threads start
    outs = [None] * len(prompts)

    def work(i):
        outs[i] = model.generate(prompts[i], max_new_tokens=30)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert torch.equal(out, ref), f"thread {i}"


def test_compile_refuses_what_it_cannot_serve():
    with pytest.raises(ValueError, match="compile: .*full attention only"):
        MedusaModel.from_pretrained(tiny_model("mistral", sliding_window=8), heads=None, compile=True)
    base = tiny_model("llama")
    base.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="compile: the compiled target runs SDPA or eager attention"):
        CompiledTarget(base)
