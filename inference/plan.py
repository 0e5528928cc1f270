"""A decoding plan: everything one generate call decides before its first forward, in one place.

`make_plan` turns (the model, its heads' config, the call's arguments) into a DecodePlan: the drafter (new for the
call: a per-step drafter learns from the call's own acceptance), the tree handed to it, the accept rule, the call's
logits processors and whether the target may hand over argmaxes instead of logits. The decode loop reads only the
plan, so nothing about a call lives on the model and calls with different trees can run side by side."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
from transformers import GenerationConfig, LogitsProcessorList

from medusa_heads.inference.accept import TargetChoice, TypicalAcceptance
from medusa_heads.inference.decode import AcceptRule
from medusa_heads.inference.propose import MAX_NGRAM, MIN_NGRAM, Draft, Drafter, HeadsDrafter, LookupDrafter
from medusa_heads.inference.sampling import build_processors, build_warpers
from medusa_heads.tree import TreeSpec, load_tree
from medusa_heads.tree.buffers import TreeBuffers, build_buffers, from_parents

if TYPE_CHECKING:
    from medusa_heads.model import MedusaModel

ADAPTIVE = "adaptive"  # tree=: a tree chosen at every step from the heads' confidence and the verify's cost
PLAIN = "plain"  # tree=: no drafting, one token a forward (with prompt_lookup_num_tokens: prompt lookup alone)
TreeArg = str | Sequence[Sequence[int]] | TreeSpec


@dataclass(frozen=True)
class DecodePlan:
    drafter: Drafter  # this call's own
    buffers: TreeBuffers  # the tree handed to the drafter at each step (a per-step drafter replaces it)
    rule: AcceptRule
    processors: LogitsProcessorList | None  # context-dependent processors, run at each node on its own path
    greedy: bool  # the target may hand over each node's argmax instead of its logits (inference/screen.py)
    tree: str  # what the call drafts: "adaptive", "plain" or "fixed, N nodes"
    max_size: int  # the most tree tokens (root included) a step may verify: the cache is sized for it


def check_tree(tree: TreeArg, num_heads: int, draft_vocab_size: int) -> str | TreeSpec:
    """"adaptive", "plain", or the TreeSpec of a preset name, rank paths or a spec, checked against the heads."""
    if isinstance(tree, str) and tree in (ADAPTIVE, PLAIN):
        return tree
    spec = load_tree(tree)
    spec.check_heads(num_heads)
    if spec.topk > draft_vocab_size:
        raise ValueError(f"the tree reads rank {spec.topk - 1} but the heads score only {draft_vocab_size} tokens")
    return spec


class PlainDrafter:
    """Drafts nothing: every step verifies the root alone."""

    def draft(self, hidden: torch.Tensor, sequences: list[torch.Tensor], buffers: TreeBuffers) -> list[Draft]:
        return [Draft(sequences[0].new_zeros(0), buffers) for _ in sequences]

    def update(self, accepted: list[torch.Tensor]) -> None:
        pass


def make_plan(model: "MedusaModel", gc: GenerationConfig, *, rows: int, prompt_len: int, tree: TreeArg | None = None,
              acceptance: str = "exact", posterior_threshold: float = 0.09, posterior_alpha: float = 0.3,
              logits_processor: LogitsProcessorList | None = None, drafter: Drafter | None = None,
              generator: torch.Generator | None = None) -> DecodePlan:
    """The plan of one generate call of `rows` rows under settings `gc`. tree: None for the model's default
    (model.default_tree: "adaptive" where the heads were calibrated for these kernels, else their fixed tree),
    "adaptive", "plain", a preset name, rank paths or a TreeSpec. A per-step tree needs heads calibrated for the
    kernels that run (and, for a batch, for batches of them); where the default is "adaptive" and they are not, the
    call drafts the heads' fixed tree. `drafter`: a user's own drafter of the fixed tree."""
    if acceptance == "exact":
        rule = TargetChoice(build_warpers(gc) if gc.do_sample else None, generator)
    elif acceptance == "typical":
        if not gc.do_sample:
            raise ValueError('acceptance="typical" needs do_sample=True (greedy decoding is already exact)')
        rule = TypicalAcceptance(build_warpers(gc), posterior_threshold, posterior_alpha, generator)
    else:
        raise ValueError(f'acceptance must be "exact" or "typical", got {acceptance!r}')
    processors = build_processors(gc, prompt_len, logits_processor)
    greedy = rule.greedy and not processors and model.target.screen.get() is not None

    asked = tree is not None
    tree = model.default_tree if tree is None else check_tree(tree, model.config.num_heads, model.config.draft_vocab_size)
    cost = model.cost_model() if tree == ADAPTIVE else None
    if tree == ADAPTIVE and asked and drafter is None and (cost is None or (rows > 1 and not cost.batched)):
        from medusa_heads.tree.adaptive import kernels_key
        from medusa_heads.inference.prepack import is_prepacked
        what = "batches on these kernels" if cost is not None else "these kernels"
        raise ValueError(f'tree="adaptive" needs the heads calibrated for {what} '
                         f'({kernels_key(model.base_model, is_prepacked(model.base_model))}): run medusa-heads calibrate')
    adaptive = tree == ADAPTIVE and drafter is None and cost is not None and (rows == 1 or cost.batched)
    if tree == ADAPTIVE and not adaptive:
        tree = model.tree  # the heads' fixed tree

    lookup = gc.prompt_lookup_num_tokens
    if lookup is None and tree != PLAIN and (rows == 1 or adaptive):
        lookup = model.config.lookup_tokens
    ngram = gc.max_matching_ngram_size or MAX_NGRAM
    device = model.base_model.device
    if adaptive:  # this step's tree from the heads' confidence, lookup and phrasebook merged in
        drafter = model.adaptive_drafter(lookup or 0, ngram, rows=rows, greedy=greedy)
        return DecodePlan(drafter, from_parents((-1,), device), rule, processors, greedy, ADAPTIVE, cost.max_size)
    if tree == PLAIN:
        if drafter is not None:
            raise ValueError('tree="plain" drafts nothing, so the drafter= given would not run: pass one of them')
        buffers, drafter, label = from_parents((-1,), device), PlainDrafter(), PLAIN
    else:
        buffers, label = tree_buffers(tree, device), f"fixed, {tree.num_nodes} nodes"
        drafter = drafter or HeadsDrafter(model.heads)
    if lookup:  # the tree plus a continuation copied from the text so far, grown row by row
        drafter = LookupDrafter(drafter, lookup, max_ngram=ngram, min_ngram=min(MIN_NGRAM, ngram))
    return DecodePlan(drafter, buffers, rule, processors, greedy, label, buffers.size + (lookup or 0))


_buffers: dict[tuple, TreeBuffers] = {}


def tree_buffers(spec: TreeSpec, device: torch.device | str) -> TreeBuffers:
    """build_buffers(spec) on `device`, kept by the spec's paths (immutable: shared by calls and threads)."""
    key = (tuple(spec.paths), str(device))
    found = _buffers.get(key)
    if found is None:
        found = _buffers.setdefault(key, build_buffers(spec).to(device)) if len(_buffers) < 256 else build_buffers(spec).to(device)
    return found
