"""MedusaConfig: what a heads checkpoint is, round-tripped through config.json."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

FORMAT_VERSION = 1
DEFAULT_TREE = "cpu-16"
CONDITIONS = ("none", "root", "path")


@dataclass
class MedusaConfig:
    num_heads: int = 4  # K: head k (1..K) guesses the token k+1 steps after the last accepted one
    num_layers: int = 1  # residual blocks per head
    mlp_size: int = 0  # 0: each block is x + SiLU(W x + b) (Medusa); > 0: x + W2 SiLU(W1 x + b1) + b2, W1 (mlp_size, H)
    hidden_size: int = 0  # the base model's final hidden size (the LM head's input)
    vocab_size: int = 0  # the base model's vocabulary (rows of its LM head)
    own_lm_head: bool = False  # False: heads score through the base's frozen LM head; True: each has its own
    draft_vocab: list[int] | None = None  # token ids the heads may propose (their LM-head rows); None: all
    # What a head sees besides the hidden state: "none" (Medusa), "root" (also the root token, the target's own next
    # token, known before drafting), "path" (the root and the tokens drafted above the node: Hydra-style heads).
    condition: str = "none"
    tree: list[list[int]] | str = DEFAULT_TREE  # preset name from configs/trees/ or rank paths
    # generate()'s default prompt_lookup_num_tokens (one row, or a batch with per-step trees): up to this many
    # tokens copied from the text so far are merged into the tree (0: heads only); an explicit
    # prompt_lookup_num_tokens (0 too) wins
    lookup_tokens: int = 0
    # continuations the per-step tree takes from prompt lookup: what followed the latest occurrences of the matched
    # n-gram, one per distinct next token (1: the latest only, as transformers' prompt lookup)
    lookup_branches: int = 1
    # The per-step tree's measurements (tree/adaptive.py, written by `medusa-heads calibrate`): "acceptance" (head
    # probability -> acceptance, per depth), "lookup" (prompt lookup's acceptance by n-gram and depth), "cost"
    # (verify milliseconds by kernels, context length and tree size). None: a fixed tree only.
    adaptive: dict | None = None
    base_fingerprint: dict | None = None  # {architecture, hidden_size, vocab_size, lm_head_sha256}
    format_version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)  # free-form provenance (training recipe, data, metrics)

    def __post_init__(self) -> None:
        if self.num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {self.num_heads}")
        if self.num_layers < 0:
            raise ValueError(f"num_layers must be >= 0, got {self.num_layers}")
        if self.lookup_tokens < 0:
            raise ValueError(f"lookup_tokens must be >= 0, got {self.lookup_tokens}")
        if self.lookup_branches < 1:
            raise ValueError(f"lookup_branches must be >= 1, got {self.lookup_branches}")
        if self.mlp_size < 0:
            raise ValueError(f"mlp_size must be >= 0, got {self.mlp_size}")
        if self.condition not in CONDITIONS:
            raise ValueError(f"condition must be one of {', '.join(CONDITIONS)}, got {self.condition!r}")
        if self.hidden_size < 1 or self.vocab_size < 1:
            raise ValueError(f"hidden_size and vocab_size must be set, got {self.hidden_size} and {self.vocab_size}")
        if self.format_version > FORMAT_VERSION:
            raise ValueError(
                f"heads were saved with format version {self.format_version}, newer than this medusa-heads "
                f"understands ({FORMAT_VERSION}); upgrade medusa-heads"
            )
        if self.format_version < 1:
            raise ValueError(f"unknown heads format version {self.format_version}")
        if self.draft_vocab is not None:
            ids = self.draft_vocab
            if len(ids) == 0:
                raise ValueError("draft_vocab is empty")
            bad = [i for i in ids if not 0 <= i < self.vocab_size]
            if bad:
                raise ValueError(f"draft_vocab holds id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
            if len(set(ids)) != len(ids):
                raise ValueError("draft_vocab holds duplicate ids")

    def context_slots(self, head: int) -> int:
        """Tokens head `head` (0-based) reads besides the hidden state: root first, then the drafted path."""
        return {"none": 0, "root": 1, "path": head + 1}[self.condition]

    @property
    def context_size(self) -> int:
        """Context tokens the heads read in all: the width of the `context` argument of MedusaHeads."""
        return max(self.context_slots(k) for k in range(self.num_heads))

    @property
    def draft_vocab_size(self) -> int:
        return self.vocab_size if self.draft_vocab is None else len(self.draft_vocab)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MedusaConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown keys in heads config: {', '.join(unknown)}")
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "MedusaConfig":
        try:
            d = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(d)
