"""The seam between the decode algorithm and whatever runs the target.

The decode loop (inference/decode.py) asks an engine for a Session per call: the target's cache for that call, and
three verbs on it. An engine is transformers (engines/hf.py) or llama.cpp (engines/llamacpp.py); the loop, the plan
and the drafters never know which one runs. A session is a call's own: one engine serves many threads."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from medusa_heads.tree.buffers import TreeBuffers


@dataclass
class TargetOutput:
    logits: torch.Tensor | None  # ([B,] T, V): the target's logits for the token after each input position
    hidden: torch.Tensor | None  # ([B,] T, H): the LM head's input at each position (what the heads read); a
    # prefill may hand over none (llama.cpp: its prompt decoded as its own plain decoding does), and the loop's first
    # step then verifies the root alone
    choices: torch.Tensor | None = None  # ([B,] T): the logits' argmax instead, where only that was asked for

    def row(self, b: int = 0, n: int | None = None) -> "TargetOutput":
        """Row b of a batch's output (its first n positions, with n)."""
        pick = lambda x: None if x is None else x[b, :n]  # noqa: E731
        return TargetOutput(pick(self.logits), pick(self.hidden), pick(self.choices))


class Session(Protocol):
    """One sequence's target for one call: its cache, filled up to `past` tokens."""

    past: int  # tokens in the cache

    def prefill(self, input_ids: torch.Tensor) -> TargetOutput:
        """input_ids: (1, L), the cache empty. Returns the last position's (1, V) logits and (1, H) hidden state
        (or None)."""
        ...

    def verify(self, tokens: torch.Tensor, buffers: TreeBuffers, greedy: bool) -> TargetOutput:
        """tokens: (T,) a tree, root first, shaped by `buffers`: each node sees the cache and its own ancestors, at
        position past + depth. Returns (T, V) logits (or (T,) `choices` where `greedy` and the engine can hand over
        argmaxes alone) and (T, H) hidden states. The tree stays in the cache until commit."""
        ...

    def commit(self, keep: torch.Tensor) -> None:
        """keep: (n,) node indices of the last verified tree, root first, a path: the cache keeps those entries, in
        order, and drops the rest of the tree; past grows by n."""
        ...

    def rollback(self) -> None:
        """Drop the whole of the last verified tree (a timing run's verify, kept by nothing)."""
        ...

    def close(self) -> None:
        """Hand back what the session holds (an engine may pool its contexts)."""
        ...


class BatchRows(Protocol):
    """A batch's target for one call, for the decode loop (inference/decode.run): see inference/batch.py."""

    def prefill(self) -> TargetOutput:
        """(B, 1, V) logits and (B, 1, H) hidden states at each row's last prompt token."""
        ...

    def verify(self, running: list[int], roots: list[torch.Tensor], drafts: list, greedy: bool) -> list:
        """One forward over the running rows' trees: each one's (tree tokens root first, its TargetOutput)."""
        ...

    def commit(self, running: list[int], keeps: list[torch.Tensor]) -> None:
        """Each running row's cache keeps its accepted nodes (root first) and nothing else of its tree."""
        ...


class Engine(Protocol):
    """What runs the target: opens a session per call, and says what the plan must know of it."""

    device: torch.device
    greedy_choices: bool  # a greedy verify may hand over each node's argmax instead of its logits
    row_cap: int | None  # the most tree tokens whose rows keep a one-token step's bits (None: no such limit)

    def session(self, capacity: int) -> Session:
        """A new session whose cache holds about `capacity` tokens (it may grow past them)."""
        ...

    def batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, capacity: int) -> BatchRows:
        """Left-padded (B, L) prompts as one batch; raises (one line, the reason) where the engine runs none."""
        ...

    def kernels(self) -> str:
        """The key its verify's cost is stored under ("prepacked-float32-cpu-avx512", "llamacpp-q8_0-cpu-avx512")."""
        ...

    def find_cost(self, costs: dict) -> str | None:
        """The key in `costs` (stored cost tables by kernel key) whose table sizes this engine's trees; None: none."""
        ...
