"""Acceptance rules: which drafted path the target agrees with. Pure tensor functions."""
from __future__ import annotations

from typing import Protocol

import torch
from transformers import LogitsProcessorList

from medusa_heads.tree.buffers import TreeBuffers
from medusa_heads.inference.sampling import draw, sample, target_probs


class AcceptRule(Protocol):
    greedy: bool  # its choice at a node is the target's argmax: the target may hand over argmaxes, not logits

    def first(self, logits: torch.Tensor) -> int:
        """(1, V) prefill logits -> the first new token."""
        ...

    def accept(self, tree_tokens: torch.Tensor, logits: torch.Tensor, buffers: TreeBuffers) -> tuple[torch.Tensor, int]:
        """(T,), (T, V) -> (accepted node indices, root first; the target's own next token)."""
        ...


def longest_path(match: torch.Tensor, buffers: TreeBuffers) -> tuple[int, int]:
    """match: (P, D) bool, match[p, i] = path p's node i+1 is accepted given its parent.
    Returns (path row, accepted drafted nodes on it): the longest run of matches from the root."""
    d = torch.arange(match.shape[1], device=match.device)
    match = match & (d[None] < buffers.path_len[:, None] - 1)  # padding never matches
    run = match.int().cumprod(dim=1).sum(dim=1)  # (P,)
    best = int(run.argmax())
    return best, int(run[best])


def accept_choices(tree_tokens: torch.Tensor, choice: torch.Tensor, buffers: TreeBuffers) -> tuple[torch.Tensor, int]:
    """Greedy and exact sampling: `choice` (T,) is the target's own token at each node (its argmax, or one draw
    from its distribution). Descend while the target's choice is a drafted child; the first miss is the
    target's token. Every emitted token is thus the target's choice given exactly the tokens before it.

    Returns (accepted node indices, root first; the bonus token id)."""
    paths = buffers.paths  # (P, D + 1)
    if paths.shape[1] == 1:  # the root alone: a plain step
        return paths[0], int(choice[0])
    match = tree_tokens[paths[:, 1:]] == choice[paths[:, :-1]]  # (P, D)
    row, n = longest_path(match, buffers)
    nodes = paths[row, : n + 1]
    return nodes, int(choice[nodes[-1]])


def typical_threshold(probs: torch.Tensor, posterior_threshold: float, posterior_alpha: float) -> torch.Tensor:
    """(T, V) -> (T,) Medusa's typical-acceptance threshold min(eps, alpha * exp(-entropy))."""
    entropy = -(probs * torch.log(probs.clamp_min(1e-10))).sum(-1)
    return torch.minimum(torch.full_like(entropy, posterior_threshold), posterior_alpha * torch.exp(-entropy))


def accept_typical(
    tree_tokens: torch.Tensor,
    probs: torch.Tensor,
    buffers: TreeBuffers,
    posterior_threshold: float,
    posterior_alpha: float,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, int]:
    """Medusa's typical acceptance (LOSSY): a child is accepted when the target gives its token a probability
    above typical_threshold at the parent; among accepted paths the longest (then lowest-rank) wins, and the
    bonus token is drawn from the target at the last accepted node. Output no longer follows the target's
    distribution exactly."""
    paths = buffers.paths
    thr = typical_threshold(probs, posterior_threshold, posterior_alpha)  # (T,)
    parent, child = paths[:, :-1], paths[:, 1:]
    match = probs[parent, tree_tokens[child]] > thr[parent]  # (P, D)
    row, n = longest_path(match, buffers)
    nodes = paths[row, : n + 1]
    bonus = torch.multinomial(probs[nodes[-1]], 1, generator=generator)
    return nodes, int(bonus)


class TargetChoice:
    """Greedy (no warpers) or exact sampling: the target's own token at every node, then accept_choices."""

    def __init__(self, warpers: LogitsProcessorList | None = None, generator: torch.Generator | None = None) -> None:
        self.warpers, self.generator = warpers, generator
        self.greedy = warpers is None

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """(T, V) -> (T,)."""
        if self.warpers is None:
            return logits.argmax(dim=-1)
        return draw(logits, self.warpers, self.generator)

    def first(self, logits: torch.Tensor) -> int:
        return int(self.choose(logits)[0])

    def accept(self, tree_tokens: torch.Tensor, logits: torch.Tensor, buffers: TreeBuffers) -> tuple[torch.Tensor, int]:
        if self.warpers is None:
            return accept_choices(tree_tokens, self.choose(logits), buffers)
        return self._walk(tree_tokens, logits, buffers)

    def _walk(self, tree_tokens: torch.Tensor, logits: torch.Tensor, buffers: TreeBuffers) -> tuple[torch.Tensor, int]:
        """Exact sampling, drawing only where the descent goes: the draws at nodes it never reaches could not
        change the outcome, so this is accept_choices' distribution at a fraction of the warping and sampling
        (top-p sorts the whole vocabulary once per node)."""
        tokens = tree_tokens.tolist()
        node, nodes = 0, [0]
        while True:
            draw = int(self.choose(logits[node : node + 1])[0])
            node = next((c for c in buffers.children[node] if tokens[c] == draw), -1)
            if node < 0:
                return torch.tensor(nodes, device=tree_tokens.device), draw
            nodes.append(node)


class TypicalAcceptance:
    """Medusa's typical acceptance: faster, LOSSY. Used only when asked for by name."""

    greedy = False

    def __init__(
        self,
        warpers: LogitsProcessorList,
        posterior_threshold: float,
        posterior_alpha: float,
        generator: torch.Generator | None = None,
    ) -> None:
        self.warpers, self.generator = warpers, generator
        self.posterior_threshold, self.posterior_alpha = posterior_threshold, posterior_alpha

    def first(self, logits: torch.Tensor) -> int:
        return int(sample(target_probs(logits, self.warpers), self.generator)[0])

    def accept(self, tree_tokens: torch.Tensor, logits: torch.Tensor, buffers: TreeBuffers) -> tuple[torch.Tensor, int]:
        probs = target_probs(logits, self.warpers)
        return accept_typical(tree_tokens, probs, buffers, self.posterior_threshold, self.posterior_alpha,
                              self.generator)
