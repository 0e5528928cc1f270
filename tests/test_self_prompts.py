"""Prompts the model writes itself (Magpie's method): what is kept, what is refused, resuming, the batch bound."""
import gzip
import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from medusa_heads import default_model_path
from medusa_heads.training.self_prompts import user_turn_opening, write_self_prompts

BENCH = "please write a short story about a small robot who learns to paint the sea at night"  # 17 words


class Scripted:
    """Stands in for a model: batch i's rows continue the opening with the texts of script[i] (None: no end of turn)."""

    def __init__(self, tok, script):
        self.tok, self.script, self.calls = tok, script, []
        self.device = torch.device("cpu")
        self.generation_config = SimpleNamespace(eos_token_id=tok.eos_token_id)

    def generate(self, ids, max_new_tokens, **kw):
        texts = self.script[len(self.calls) % len(self.script)]
        self.calls.append(torch.initial_seed())
        rows = []
        for t in texts:
            cont = self.tok(t, add_special_tokens=False).input_ids if t is not None else [5] * max_new_tokens
            cont = (cont + ([self.tok.eos_token_id] if t is not None else []))[:max_new_tokens]
            rows.append(cont + [self.tok.eos_token_id] * (max_new_tokens - len(cont)))
        return torch.cat([ids[: len(rows)], torch.tensor(rows)], dim=1)


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(default_model_path())


def test_kept_and_refused(tmp_path, tok):
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"prompt": BENCH}) + "\n")
    model = Scripted(tok, [[
        "How do I boil an egg so the yolk stays soft?",
        "how do I  boil an egg so the yolk stays SOFT?",  # the same, normalised
        "Hi there",  # under 4 words
        None,  # the turn did not end
        "user: what is the time in Paris now?",  # a role marker
        "Could you " + BENCH + " please",  # shares 13 words with the bench
        "What are three good names for a grey cat?",
    ]])
    rows = write_self_prompts(model, tok, tmp_path / "p.jsonl.gz", 10, exclude=[str(bench)], batch_size=7,
                              max_batches=1, progress=False)
    assert [r.turns[0] for r in rows] == ["How do I boil an egg so the yolk stays soft?",
                                          "What are three good names for a grey cat?"]
    assert all(r.id.startswith("self:") and r.source == "self-magpie" for r in rows)
    with gzip.open(tmp_path / "p.jsonl.gz", "rt") as f:
        assert [json.loads(line)["prompt"] for line in f] == [r.turns[0] for r in rows]


def test_resumes_where_it_stopped_and_stops_at_max_batches(tmp_path, tok):
    script = [["Tell me a fact about the moon, please."], ["Why do leaves change colour in autumn?"],
              ["Name a river that flows through Egypt."]]
    out = tmp_path / "p.jsonl.gz"
    first = Scripted(tok, script)
    assert len(write_self_prompts(first, tok, out, 3, batch_size=1, seed=7, max_batches=1, progress=False)) == 1
    again = Scripted(tok, script[1:])  # a rerun samples batch 1 next, with seed 7 + 1
    rows = write_self_prompts(again, tok, out, 3, batch_size=1, seed=7, progress=False)
    assert [r.turns[0] for r in rows] == [s[0] for s in script] and again.calls == [8, 9]
    assert len(write_self_prompts(again, tok, out, 3, batch_size=1, seed=7, progress=False)) == 3  # done: no call
    assert len(again.calls) == 2


def test_a_tokenizer_without_a_chat_template_is_refused(tok):
    plain = AutoTokenizer.from_pretrained(default_model_path())
    plain.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        user_turn_opening(plain)
    assert user_turn_opening(tok).endswith("user\n")
