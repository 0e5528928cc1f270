"""A decoding plan: everything one generate call decides before its first forward, in one place.

`make_plan` turns (the model's Drafting, the engine, the call's arguments) into a DecodePlan: the drafter (new for the
call: a per-step drafter learns from the call's own acceptance), the tree handed to it, the accept rule, the call's
logits processors and whether the target may hand over argmaxes instead of logits. The decode loop reads only the
plan, so nothing about a call lives on the model and calls with different trees can run side by side."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import GenerationConfig, LogitsProcessorList

from medusa_heads.engines.base import Engine
from medusa_heads.heads import MedusaHeads
from medusa_heads.inference.accept import AcceptRule, TargetChoice, TypicalAcceptance
from medusa_heads.inference.adaptive import AdaptiveDrafter, DraftObserver
from medusa_heads.inference.propose import MAX_NGRAM, MIN_NGRAM, Draft, Drafter, HeadsDrafter, LookupDrafter
from medusa_heads.inference.sampling import build_processors, build_warpers
from medusa_heads.tree import TreeSpec, load_tree
from medusa_heads.tree.adaptive import Acceptance, CostModel, LookupAcceptance, PhraseAcceptance
from medusa_heads.tree.buffers import TreeBuffers, build_buffers, from_parents
from medusa_heads.tree.ngrams import NgramStore

ADAPTIVE = "adaptive"  # tree=: a tree chosen at every step from the heads' confidence and the verify's cost
PLAIN = "plain"  # tree=: no drafting, one token a forward (with prompt_lookup_num_tokens: prompt lookup alone)
TreeArg = str | Sequence[Sequence[int]] | TreeSpec


@dataclass(frozen=True)
class DecodePlan:
    drafter: Drafter  # this call's own
    buffers: TreeBuffers  # the tree handed to the drafter at each step (a per-step drafter replaces it)
    rule: AcceptRule
    processors: LogitsProcessorList | None  # context-dependent processors, run at each node on its own path
    greedy: bool  # the target may hand over each node's argmax instead of its logits (medusa_heads/kernels/screen.py)
    tree: str  # what the call drafts: "adaptive", "plain" or "fixed, N nodes"
    max_size: int  # the most tree tokens (root included) a step may verify: the cache is sized for it


@dataclass(frozen=True)
class Drafting:
    """What a plan needs of a model's heads on the engine that runs them, built at load per kernel key
    (MedusaModel.drafting): the trees, and the per-step tree's parts where the heads were calibrated for the kernels."""

    heads: MedusaHeads
    tree: TreeSpec  # the heads' fixed tree: what a call drafts when no per-step tree can be
    default: str | TreeSpec  # what a call that names no tree drafts: "adaptive", "plain" or a fixed tree
    kernels: str  # the engine's cost key ("prepacked-float32-cpu-avx512"), named where it was not calibrated
    lookup_tokens: int  # prompt lookup's tokens where a call sets none
    lookup_branches: int  # prompt-lookup continuations a per-step tree may hold
    acceptance: Acceptance | None = None  # the per-step tree's parts (None: not calibrated for these kernels)
    lookup: LookupAcceptance | None = None
    cost: CostModel | None = None
    phrases: NgramStore | None = None  # the phrasebook, where its acceptance was calibrated
    phrase_acceptance: PhraseAcceptance | None = None

    def adaptive_drafter(self, lookup: int, ngram: int = MAX_NGRAM, rows: int = 1, greedy: bool = False,
                         observer: DraftObserver | None = None) -> AdaptiveDrafter:
        """The per-step drafter of one call (it learns from the call's own acceptance) of `rows` rows, with `lookup`
        prompt-lookup tokens; `greedy`: its verifies hand over argmaxes, so steps are sized by the greedy cost."""
        if self.cost is None or self.acceptance is None:
            raise ValueError(f"a per-step tree needs the heads calibrated for these kernels ({self.kernels}): "
                             "run medusa-heads calibrate")
        table = self.lookup
        return AdaptiveDrafter(self.heads, self.acceptance, self.cost.for_greedy() if greedy else self.cost, table,
                               lookup, max_ngram=ngram, min_ngram=min(ngram, table.ngrams[0]) if table else 1,
                               lookup_branches=self.lookup_branches, phrases=self.phrases,
                               phrase_acceptance=self.phrase_acceptance, rows=rows, observer=observer)


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


def make_plan(drafting: Drafting, engine: Engine, gc: GenerationConfig, *, rows: int, prompt_len: int,
              tree: TreeArg | None = None, acceptance: str = "exact", posterior_threshold: float = 0.09,
              posterior_alpha: float = 0.3, logits_processor: LogitsProcessorList | None = None,
              drafter: Drafter | None = None, generator: torch.Generator | None = None) -> DecodePlan:
    """The plan of one generate call of `rows` rows under settings `gc`. tree: None for drafting.default
    ("adaptive" where the heads were calibrated for these kernels, else their fixed tree), "adaptive", "plain", a
    preset name, rank paths or a TreeSpec. A per-step tree needs heads calibrated for the kernels that run (and, for
    a batch, for batches of them); where the default is "adaptive" and they are not, the call drafts the heads'
    fixed tree. `drafter`: a user's own drafter of the fixed tree."""
    rule = accept_rule(gc, acceptance, posterior_threshold, posterior_alpha, generator)
    processors = build_processors(gc, prompt_len, logits_processor)
    greedy = rule.greedy and not processors and engine.greedy_choices

    heads = drafting.heads.config
    asked = tree is not None
    tree = drafting.default if tree is None else check_tree(tree, heads.num_heads, heads.draft_vocab_size)
    cost = drafting.cost if tree == ADAPTIVE else None
    if tree == ADAPTIVE and asked and drafter is None and (cost is None or (rows > 1 and not cost.batched)):
        what = "batches on these kernels" if cost is not None else "these kernels"
        raise ValueError(f'tree="adaptive" needs the heads calibrated for {what} ({drafting.kernels}): '
                         "run medusa-heads calibrate")
    adaptive = tree == ADAPTIVE and drafter is None and cost is not None and (rows == 1 or cost.batched)
    if tree == ADAPTIVE and not adaptive:
        tree = drafting.tree

    lookup = gc.prompt_lookup_num_tokens
    if lookup is None and tree != PLAIN and (rows == 1 or adaptive):
        lookup = drafting.lookup_tokens
    ngram = gc.max_matching_ngram_size or MAX_NGRAM
    device = engine.device
    if adaptive:  # this step's tree from the heads' confidence, lookup and phrasebook merged in
        drafter = drafting.adaptive_drafter(lookup or 0, ngram, rows=rows, greedy=greedy)
        return DecodePlan(drafter, from_parents((-1,), device), rule, processors, greedy, ADAPTIVE, cost.max_size)
    if tree == PLAIN:
        if drafter is not None:
            raise ValueError('tree="plain" drafts nothing, so the drafter= given would not run: pass one of them')
        buffers, drafter, label = from_parents((-1,), device), PlainDrafter(), PLAIN
    else:
        buffers, label = tree_buffers(tree, device), f"fixed, {tree.num_nodes} nodes"
        drafter = drafter or HeadsDrafter(drafting.heads)
    if lookup:  # the tree plus a continuation copied from the text so far, grown row by row
        drafter = LookupDrafter(drafter, lookup, max_ngram=ngram, min_ngram=min(MIN_NGRAM, ngram))
    return DecodePlan(drafter, buffers, rule, processors, greedy, label, buffers.size + (lookup or 0))


def accept_rule(gc: GenerationConfig, acceptance: str, posterior_threshold: float, posterior_alpha: float,
                generator: torch.Generator | None) -> AcceptRule:
    """Exact acceptance (greedy, or sampling from the processed distribution), or Medusa's lossy typical one."""
    if acceptance == "exact":
        return TargetChoice(build_warpers(gc) if gc.do_sample else None, generator)
    if acceptance == "typical":
        if not gc.do_sample:
            raise ValueError('acceptance="typical" needs do_sample=True (greedy decoding is already exact)')
        return TypicalAcceptance(build_warpers(gc), posterior_threshold, posterior_alpha, generator)
    raise ValueError(f'acceptance must be "exact" or "typical", got {acceptance!r}')


_buffers: dict[tuple, TreeBuffers] = {}


def tree_buffers(spec: TreeSpec, device: torch.device | str) -> TreeBuffers:
    """build_buffers(spec) on `device`, kept by the spec's paths (immutable: shared by calls and threads)."""
    key = (tuple(spec.paths), str(device))
    found = _buffers.get(key)
    if found is None:
        found = (_buffers.setdefault(key, build_buffers(spec).to(device)) if len(_buffers) < 256
                 else build_buffers(spec).to(device))
    return found
