"""A long greedy generation (1,100 tokens after the prompt: past the cost model's 1K context row) on the real model with the shipped
heads stays identical to base.generate."""
from __future__ import annotations

import pytest
import torch

from medusa_heads import MedusaModel

from conftest import chat_ids


NEW = 1100  # base.generate's 1,100 steps are most of this test's time


@pytest.mark.slow
def test_a_long_greedy_generation_equals_base_generate(real_base):
    base, tok = real_base
    ids = chat_ids(tok, "Write a very long story about a lighthouse keeper and the sea, with many chapters.")
    ref = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    model = MedusaModel.from_pretrained(base)  # the shipped heads and their calibrated tree
    # The chat prompt holds <|im_end|>, SmolLM2's pad token: with eos_token_id=None, transformers' generate (and ours,
    # which follows it) would infer padding there unless given the mask.
    res = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, eos_token_id=None, return_dict_in_generate=True)
    assert ref.shape[1] == ids.shape[1] + NEW
    assert torch.equal(res.sequences, ref)
    assert res.stats.mean_accepted > 1.2  # the heads do draft accepted tokens along the way
