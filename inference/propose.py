"""Drafters: one fixed interface that turns the last accepted hidden state into tree tokens."""
from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from einops import rearrange, repeat

from medusa_heads.heads import MedusaHeads
from medusa_heads.tree.buffers import TreeBuffers, with_chain


class Draft(NamedTuple):
    tokens: torch.Tensor  # (N,) tokens for nodes 1..N of `buffers` (node 0, the root, is the target's own token)
    buffers: TreeBuffers  # this step's tree


class Drafter(Protocol):
    """What the decode loop asks at every step, for one sequence or a batch alike (transformers' CandidateGenerator
    has the same two calls: get_candidates, update_candidate_strategy)."""

    def draft(self, hidden: torch.Tensor, sequences: list[torch.Tensor], buffers: TreeBuffers) -> list[Draft]:
        """hidden: (B, H) the LM head's input at each row's last accepted token; sequences: each row's tokens so far,
        its root (the target's next token, not yet verified) last; buffers: the model's configured tree, which a
        drafter may keep, grow or replace. Returns each row's tree for this step."""
        ...

    def update(self, accepted: list[torch.Tensor]) -> None:
        """After the verify: each row's accepted node indices of the tree it drafted, root first."""
        ...


class RowDrafter:
    """A base for a drafter of the configured tree, one row at a time: implement draft_row."""

    def draft_row(self, hidden: torch.Tensor, sequence: torch.Tensor, buffers: TreeBuffers) -> torch.Tensor:
        """hidden: (H,); sequence: (L,) the root last. Returns (N,) tokens for nodes 1..N of `buffers`."""
        raise NotImplementedError

    def draft(self, hidden: torch.Tensor, sequences: list[torch.Tensor], buffers: TreeBuffers) -> list[Draft]:
        return [Draft(self.draft_row(h, seq, buffers), buffers) for h, seq in zip(hidden, sequences)]

    def update(self, accepted: list[torch.Tensor]) -> None:
        pass


class HeadsDrafter:
    """The configured tree: each node takes rank `rank` of head `depth` from the heads' top-k. Unconditioned and
    root-conditioned heads draft the whole tree in one product; path-conditioned heads draft level by level, each
    parent's children from head `depth` given the tokens on the parent's path. Every row of a batch in one pass."""

    def __init__(self, heads: MedusaHeads) -> None:
        self.heads = heads

    def draft(self, hidden: torch.Tensor, sequences: list[torch.Tensor], buffers: TreeBuffers) -> list[Draft]:
        tokens = self.draft_tokens(hidden, torch.stack([s[-1] for s in sequences]), buffers)
        return [Draft(row, buffers) for row in tokens]

    def update(self, accepted: list[torch.Tensor]) -> None:
        pass

    @torch.no_grad()
    def draft_tokens(self, hidden: torch.Tensor, roots: torch.Tensor, buffers: TreeBuffers) -> torch.Tensor:
        """hidden: (B, H); roots: (B,) each row's root token. Returns (B, N): every row's tree in one pass."""
        if self.heads.config.condition != "path":
            top = self.heads.topk(hidden, buffers.topk, context=roots[:, None])  # (K, B, topk)
            return rearrange(top, "k b r -> b (k r)")[:, buffers.draft_index]
        tokens = torch.empty(hidden.shape[0], buffers.size, dtype=torch.long, device=hidden.device)
        tokens[:, 0] = roots
        for d, (chains, nodes, row, rank) in enumerate(buffers.levels):
            h = repeat(hidden, "b h -> b p h", p=chains.shape[0])  # one row per parent of this level
            top = self.heads.head_topk(d, h, buffers.topk, context=tokens[:, chains])  # (B, parents, topk)
            tokens[:, nodes] = top[:, row, rank]
        return tokens[:, 1:]


# Prompt lookup matches the text's last MAX_NGRAM tokens (transformers' max_matching_ngram_size), down to MIN_NGRAM.
MAX_NGRAM, MIN_NGRAM = 3, 2


def lookup_match(sequence: torch.Tensor, lookup_tokens: int, max_ngram: int = MAX_NGRAM,
                 min_ngram: int = MIN_NGRAM) -> tuple[torch.Tensor, int]:
    """Prompt lookup: up to lookup_tokens tokens that followed the latest earlier occurrence of the sequence's last n
    tokens, trying n from max_ngram down to min_ngram; returns (those tokens, n), or (empty, 0) when nothing matches."""
    found, n = lookup_continuations(sequence, lookup_tokens, max_ngram, min_ngram, branches=1)
    return (found[0], n) if found else (sequence[:0], 0)


def lookup_continuations(sequence: torch.Tensor, lookup_tokens: int, max_ngram: int = MAX_NGRAM,
                         min_ngram: int = MIN_NGRAM, branches: int = 1) -> tuple[list[torch.Tensor], int]:
    """Prompt lookup with up to `branches` continuations: the longest n (max_ngram down to min_ngram) whose last n
    tokens occurred earlier, and what followed its occurrences, latest first, one per distinct first token (a later
    occurrence that starts like an earlier-listed one adds nothing a tree can branch on). ([], 0): no match."""
    length = sequence.shape[0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = sequence[:-1].unfold(0, n, 1)  # every n-gram that has a token after it
        hits = (windows == sequence[-n:]).all(dim=1).nonzero().flatten()
        if not hits.numel():
            continue
        if branches == 1:  # transformers' prompt lookup: the latest occurrence only
            start = int(hits[-1]) + n
            return [sequence[start : start + lookup_tokens]], n
        starts = hits.flip(0) + n
        found, firsts = [], set()
        for start, first in zip(starts.tolist(), sequence[starts].tolist()):
            if first not in firsts:
                firsts.add(first)
                found.append(sequence[start : start + lookup_tokens])
                if len(found) == branches:
                    break
        return found, n
    return [], 0


class LookupDrafter:
    """The inner drafter drafts its tree; prompt lookup (`lookup_match`) proposes a continuation copied from the text so
    far, which is merged in: it follows the drafted nodes for as long as it repeats them, and only the rest is hung
    below as a chain, so a step costs extra verify positions only for tokens the heads did not draft. Acceptance
    is unchanged (longest path the target agrees with), so output stays exactly the target's."""

    def __init__(self, inner: Drafter, lookup_tokens: int, max_ngram: int = MAX_NGRAM,
                 min_ngram: int = MIN_NGRAM) -> None:
        if lookup_tokens < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs lookup_tokens >= 1 and 1 <= min_ngram <= max_ngram, got "
                             f"{lookup_tokens}, {min_ngram}, {max_ngram}")
        self.inner, self.lookup_tokens = inner, lookup_tokens
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._base: TreeBuffers | None = None  # this call's configured tree, and its grown copies:
        self._grown: dict[tuple[int, int], TreeBuffers] = {}  # (node, chain length) -> buffers

    def draft(self, hidden: torch.Tensor, sequences: list[torch.Tensor], buffers: TreeBuffers) -> list[Draft]:
        return [self._merge(d, seq) for d, seq in zip(self.inner.draft(hidden, sequences, buffers), sequences)]

    def update(self, accepted: list[torch.Tensor]) -> None:
        self.inner.update(accepted)

    def _merge(self, draft: Draft, sequence: torch.Tensor) -> Draft:
        tokens, buffers = draft
        found, _ = lookup_match(sequence, self.lookup_tokens, self.max_ngram, self.min_ngram)
        if found.numel() == 0:
            return draft
        drafted, cont = [int(sequence[-1])] + tokens.tolist(), found.tolist()
        node, i = 0, 0
        while i < len(cont):  # follow the drafted tree while the continuation repeats it
            child = next((c for c in buffers.children[node] if drafted[c] == cont[i]), None)
            if child is None:
                break
            node, i = child, i + 1
        if i == len(cont):
            return draft
        if buffers is not self._base:
            self._base, self._grown = buffers, {}
        key = (node, len(cont) - i)
        if key not in self._grown:
            self._grown[key] = with_chain(buffers, node, len(cont) - i).to(buffers.mask.device)
        return Draft(torch.cat([tokens, found[i:]]), self._grown[key])
