"""Drafters: one fixed interface that turns the last accepted hidden state into tree tokens."""
from __future__ import annotations

from typing import Protocol

import torch

from ..heads import MedusaHeads
from ..tree.buffers import TreeBuffers, with_chain


class Drafter(Protocol):
    def draft(self, hidden: torch.Tensor, sequence: torch.Tensor, buffers: TreeBuffers) -> torch.Tensor:
        """hidden: (H,) the LM head's input at the last accepted token; sequence: (L,) every token so far,
        the root (the target's next token, not yet verified) last. Returns (N,) tokens for nodes 1..N."""
        ...


class GrowingDrafter(Drafter, Protocol):
    """A drafter that may add nodes to the tree for one step (the decode loop asks it with draft_tree)."""

    extra_nodes: int  # most nodes draft_tree adds to the tree it is given

    def draft_tree(self, hidden: torch.Tensor, sequence: torch.Tensor, buffers: TreeBuffers) -> tuple[torch.Tensor, TreeBuffers]:
        """As draft, for the tree of this step: (tokens for nodes 1..N', the buffers of that tree)."""
        ...


class HeadsDrafter:
    """Each node takes rank `rank` of head `depth` from the heads' top-k. Unconditioned and root-conditioned heads
    draft the whole tree in one product; path-conditioned heads draft level by level, each parent's children
    from head `depth` given the tokens on the parent's path."""

    def __init__(self, heads: MedusaHeads) -> None:
        self.heads = heads

    @torch.no_grad()
    def draft(self, hidden: torch.Tensor, sequence: torch.Tensor, buffers: TreeBuffers) -> torch.Tensor:
        return self.draft_batch(hidden[None], sequence[-1:], buffers)[0]

    @torch.no_grad()
    def draft_batch(self, hidden: torch.Tensor, roots: torch.Tensor, buffers: TreeBuffers) -> torch.Tensor:
        """hidden: (B, H); roots: (B,) each row's root token. Returns (B, N): every row's tree in one pass."""
        if self.heads.config.condition != "path":
            top = self.heads.topk(hidden, buffers.topk, context=roots[:, None])  # (K, B, topk)
            return top.transpose(0, 1).reshape(hidden.shape[0], -1)[:, buffers.draft_index]
        tokens = torch.empty(hidden.shape[0], buffers.size, dtype=torch.long, device=hidden.device)
        tokens[:, 0] = roots
        for d, (chains, nodes, row, rank) in enumerate(buffers.levels):
            h = hidden[:, None].expand(-1, chains.shape[0], -1)
            top = self.heads.head_topk(d, h, buffers.topk, context=tokens[:, chains])  # (B, parents, topk)
            tokens[:, nodes] = top[:, row, rank]
        return tokens[:, 1:]


def lookup(sequence: torch.Tensor, max_tokens: int, max_ngram: int = 3, min_ngram: int = 2) -> torch.Tensor:
    """Prompt lookup: up to max_tokens tokens that followed the latest earlier occurrence of the sequence's last n
    tokens, trying n from max_ngram down to min_ngram; empty when nothing matches."""
    length = sequence.shape[0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = sequence[:-1].unfold(0, n, 1)  # every n-gram that has a token after it
        hits = (windows == sequence[-n:]).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return sequence[start : start + max_tokens]
    return sequence[:0]


class LookupDrafter:
    """The heads draft their tree; prompt lookup (`lookup`) proposes a continuation copied from the text so far,
    which is merged in: it follows the drafted nodes for as long as it repeats them, and only the rest is hung
    below as a chain, so a step costs extra verify positions only for tokens the heads did not draft. Acceptance
    is unchanged (longest path the target agrees with), so output stays exactly the target's."""

    def __init__(self, inner: Drafter, max_tokens: int, max_ngram: int = 3, min_ngram: int = 2) -> None:
        if max_tokens < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs max_tokens >= 1 and 1 <= min_ngram <= max_ngram, got "
                             f"{max_tokens}, {min_ngram}, {max_ngram}")
        self.inner, self.extra_nodes = inner, max_tokens
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._base: TreeBuffers | None = None
        self._grown: dict[tuple[int, int], TreeBuffers] = {}  # (node, chain length) -> buffers, for self._base

    def draft(self, hidden: torch.Tensor, sequence: torch.Tensor, buffers: TreeBuffers) -> torch.Tensor:
        return self.inner.draft(hidden, sequence, buffers)

    def draft_tree(self, hidden: torch.Tensor, sequence: torch.Tensor, buffers: TreeBuffers) -> tuple[torch.Tensor, TreeBuffers]:
        tokens = self.inner.draft(hidden, sequence, buffers)
        found = lookup(sequence, self.extra_nodes, self.max_ngram, self.min_ngram)
        if found.numel() == 0:
            return tokens, buffers
        drafted, cont = [int(sequence[-1])] + tokens.tolist(), found.tolist()
        node, i = 0, 0
        while i < len(cont):  # follow the drafted tree while the continuation repeats it
            child = next((c for c in buffers.children[node] if drafted[c] == cont[i]), None)
            if child is None:
                break
            node, i = child, i + 1
        if i == len(cont):
            return tokens, buffers
        if buffers is not self._base:
            self._base, self._grown = buffers, {}
        key = (node, len(cont) - i)
        if key not in self._grown:
            self._grown[key] = with_chain(buffers, node, len(cont) - i).to(buffers.mask.device)
        return torch.cat([tokens, found[i:]]), self._grown[key]
