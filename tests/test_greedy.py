"""Greedy output equals base.generate(do_sample=False), token for token."""
from __future__ import annotations

import pytest
import torch

from transformers import LogitsProcessorList, SuppressTokensLogitsProcessor

from medusa_heads import MedusaModel
from medusa_heads.inference.propose import RowDrafter
from medusa_heads.engines.hf import Target

from conftest import ARCHS, assert_diverges_only_at_a_near_tie, chat_ids, randomize_heads, tiny_model


class OracleDrafter(RowDrafter):
    """Proposes the true greedy continuation at rank 0 and a wrong token at other ranks."""

    def __init__(self, reference: torch.Tensor, vocab: int) -> None:
        self.reference, self.vocab = reference[0], vocab

    def draft_row(self, hidden, sequence, buffers):
        n = sequence.shape[0]  # the root sits at n - 1, so a depth-d node is the token at n - 1 + d
        ref = torch.cat([self.reference, torch.zeros(buffers.size, dtype=torch.long)])
        depth = buffers.depth[1:]
        rank = (buffers.draft_index - (depth - 1) * buffers.topk)
        truth = ref[n - 1 + depth]
        return torch.where(rank == 0, truth, (truth + rank) % self.vocab)


class WrongDrafter(OracleDrafter):
    """Never right: every draft differs from the greedy continuation."""

    def draft_row(self, hidden, sequence, buffers):
        return (super().draft_row(hidden, sequence, buffers) + 1 + torch.arange(buffers.size - 1)) % self.vocab


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_random_heads_match_greedy(arch):
    base = tiny_model(arch)
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, tree="cpu-16"))
    for seed in range(3):
        ids = torch.randint(0, 96, (1, 5 + 3 * seed), generator=torch.Generator().manual_seed(seed))
        # An explicit mask: else transformers infers padding wherever the prompt holds pad_token_id.
        ref = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40)
        assert torch.equal(out, ref), f"{arch}, prompt {seed}"


@pytest.mark.parametrize("tree", ["chain-4", "cpu-16", "cpu-32"])
def test_oracle_drafter_accepts_everything(tree):
    base = tiny_model("llama", seed=3)
    model = MedusaModel.from_pretrained(base, heads=None, tree=tree)
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    depth = model.tree.depth
    budget = 1 + 9 * (depth + 1)
    ref = base.generate(ids, max_new_tokens=budget + depth + 1, do_sample=False)
    res = model.generate(ids, max_new_tokens=budget, drafter=OracleDrafter(ref, 96), return_dict_in_generate=True)
    assert torch.equal(res.sequences, ref[:, : ids.shape[1] + budget])
    assert res.stats.tokens_per_step == [1] + [depth + 1] * 9  # every draft accepted: tau = depth + 1 per verify


def test_wrong_drafter_yields_one_token_per_step():
    base = tiny_model("llama", seed=4)
    model = MedusaModel.from_pretrained(base, heads=None, tree="cpu-16")
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(1))
    ref = base.generate(ids, max_new_tokens=60, do_sample=False)
    res = model.generate(ids, max_new_tokens=30, drafter=WrongDrafter(ref, 96), return_dict_in_generate=True)
    assert torch.equal(res.sequences, ref[:, : ids.shape[1] + 30])
    assert res.stats.tokens_per_step == [1] * 30


def test_budget_and_eos_inside_an_accepted_chunk():
    base = tiny_model("llama", seed=3)
    model = MedusaModel.from_pretrained(base, heads=None, tree="chain-4")
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    ref = base.generate(ids, max_new_tokens=40, do_sample=False)
    oracle = OracleDrafter(ref, 96)
    for budget in (1, 2, 7, 13):  # budgets that end inside a 5-token chunk
        res = model.generate(ids, max_new_tokens=budget, drafter=oracle, return_dict_in_generate=True)
        assert torch.equal(res.sequences, ref[:, : ids.shape[1] + budget])
        assert res.stats.new_tokens == budget
    eos = int(ref[0, ids.shape[1] + 8])  # a token in the middle of an accepted chunk
    want = base.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=eos)
    got = model.generate(ids, max_new_tokens=40, drafter=oracle, eos_token_id=eos)
    assert torch.equal(got, want) and int(got[0, -1]) == eos


def test_probe_refuses_a_model_that_ignores_the_4d_mask():
    base = tiny_model("llama")
    forward = base.forward

    def mask_dropping_forward(*args, attention_mask=None, **kwargs):
        return forward(*args, **kwargs)  # drops the tree mask: every node would see every other node

    base.forward = mask_dropping_forward
    with pytest.raises(ValueError, match="custom 4D attention mask"):
        MedusaModel.from_pretrained(base, heads=None)


def test_flash_attention_is_refused():
    base = tiny_model("llama")
    base.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="flash_attention_2"):
        Target(base) and MedusaModel.from_pretrained(base, heads=None)


PROMPTS = [
    "What is the capital of France, and what is it famous for?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Give me three tips for staying focused while studying.",
    "Explain the difference between weather and climate.",
    "Translate to French: The library opens at nine in the morning.",
]


@pytest.mark.real
def test_real_model_matches_greedy(real_base):
    base, tok = real_base
    model = MedusaModel.from_pretrained(base, heads="auto", tree="cpu-16")
    for prompt in PROMPTS:
        ids = chat_ids(tok, prompt)
        ref = base.generate(ids, max_new_tokens=128, do_sample=False)
        out = model.generate(ids, max_new_tokens=128)
        assert torch.equal(out, ref), prompt


@pytest.mark.parametrize(
    "settings",
    [
        dict(repetition_penalty=1.5),
        dict(no_repeat_ngram_size=2),
        dict(bad_words_ids=[[5], [7, 8]]),
        dict(min_new_tokens=12, eos_token_id=3),
        dict(repetition_penalty=1.3, no_repeat_ngram_size=3, min_new_tokens=5, eos_token_id=[3, 9]),
        dict(logits_processor=LogitsProcessorList([SuppressTokensLogitsProcessor([4, 6, 11])])),
    ],
)
def test_context_dependent_processors_match_greedy(settings):
    base = tiny_model("llama", seed=6)
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, tree="cpu-16"))
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(4))
    ref = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False, **settings)
    oracle = OracleDrafter(ref, 96)  # drafts the processed greedy path, so processed nodes get accepted
    for drafter in (None, oracle):
        res = model.generate(ids, max_new_tokens=40, drafter=drafter, return_dict_in_generate=True, **settings)
        assert torch.equal(res.sequences, ref), (settings, drafter)
    assert max(res.stats.tokens_per_step) > 1


def test_stopping_criteria_stop_where_transformers_stops():
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopAfterToken(StoppingCriteria):
        def __init__(self, token: int) -> None:
            self.token = token

        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == self.token

    base = tiny_model("llama", seed=3)
    model = MedusaModel.from_pretrained(base, heads=None, tree="chain-4")
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    full = base.generate(ids, max_new_tokens=40, do_sample=False)
    stop_at = int(full[0, ids.shape[1] + 9])  # inside an accepted chunk
    crit = StoppingCriteriaList([StopAfterToken(stop_at)])
    want = base.generate(ids, max_new_tokens=40, do_sample=False, stopping_criteria=crit)
    got = model.generate(ids, max_new_tokens=40, drafter=OracleDrafter(full, 96), stopping_criteria=crit)
    assert torch.equal(got, want) and int(got[0, -1]) == stop_at


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_matches_greedy(arch, dtype):
    base = tiny_model(arch).to(dtype)
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, tree="cpu-8"))
    assert model.heads.blocks[0][0].linear.weight.dtype == dtype
    exact = 0
    for seed in range(4):
        ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(seed))
        ref = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False)
        out = model.generate(ids, max_new_tokens=30)
        exact += assert_diverges_only_at_a_near_tie(base, out, ref, arch, seed)  # a 9-token tree rounds otherwise
    assert exact >= 2


@pytest.mark.parametrize("condition,mlp_size", [("root", 0), ("path", 0), ("path", 48)])
def test_token_conditioned_heads_match_greedy(condition, mlp_size):
    base = tiny_model("llama", seed=6)
    model = randomize_heads(MedusaModel.from_pretrained(base, heads=None, condition=condition, mlp_size=mlp_size, tree="cpu-16"))
    for seed in range(3):
        ids = torch.randint(0, 96, (1, 4 + 2 * seed), generator=torch.Generator().manual_seed(seed))
        ref = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
        assert torch.equal(model.generate(ids, max_new_tokens=40), ref), f"{condition}, prompt {seed}"


def test_path_conditioned_drafts_follow_each_nodes_own_path():
    """Level-by-level drafting equals the definition: node (r1..rd) is rank rd of head d given root and its path."""
    from medusa_heads.inference.propose import HeadsDrafter

    model = randomize_heads(MedusaModel.from_pretrained(tiny_model("llama"), heads=None, condition="path", tree="cpu-32"))
    h, seq = 0.1 * torch.randn(32), torch.tensor([3, 1, 4, 1, 5])  # small h: the context tokens matter
    drafted = HeadsDrafter(model.heads).draft(h[None], [seq], model.tree_buffers)[0].tokens
    token = {(): int(seq[-1])}
    for path in model.tree.paths:  # parents come first
        context = torch.tensor([token[path[:j]] for j in range(len(path))])
        token[path] = int(model.heads.head_topk(len(path) - 1, h, path[-1] + 1, context)[path[-1]])
    assert drafted.tolist() == [token[p] for p in model.tree.paths]
    cousins = {token[p] for p in model.tree.paths if len(p) == 2 and p[1] == 0}  # head 2's best under each parent
    assert len(cousins) > 1, "random path-conditioned heads should draft different children under different parents"
