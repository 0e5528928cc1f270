"""The decode loop, one for a row and a batch: propose -> verify -> accept -> commit."""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from medusa_heads.tree.buffers import TreeBuffers, from_parents
from medusa_heads.inference.accept import AcceptRule, accept_choices
from medusa_heads.inference.propose import Draft
from medusa_heads.inference.sampling import process_tree
from medusa_heads.engines.base import Engine, Session, TargetOutput

if TYPE_CHECKING:
    from medusa_heads.inference.plan import DecodePlan

@dataclass
class DecodeStats:
    tokens_per_step: list[int] = field(default_factory=list)  # new tokens per target forward; [0] is the prefill
    rows_per_step: list[int] = field(default_factory=list)  # batched decoding: rows still running at each forward
    tree_sizes: list[int] = field(default_factory=list)  # drafted nodes verified at each step (each row's, batched)
    loop_seconds: list[float] = field(default_factory=list)  # each step's time outside the verify (calibrate's loop)
    seconds: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("prefill", "propose", "verify", "accept", "commit"), 0.0))

    @property
    def steps(self) -> int:
        """Target forwards, prefill included."""
        return len(self.tokens_per_step)

    @property
    def new_tokens(self) -> int:
        return sum(self.tokens_per_step)

    @property
    def mean_accepted(self) -> float:
        """tau: new tokens per target forward of one row (plain decoding: 1.0)."""
        return self.new_tokens / max(sum(self.rows_per_step) if self.rows_per_step else self.steps, 1)

    @property
    def accept_histogram(self) -> list[int]:
        """accept_histogram[n - 1] = steps that yielded n tokens."""
        counts = Counter(self.tokens_per_step)
        return [counts.get(n, 0) for n in range(1, max(counts, default=0) + 1)]


@dataclass
class DecodeState:
    sequence: torch.Tensor  # (capacity,) prompt then new tokens
    length: int  # valid entries of sequence; the last is the root, not yet in the cache
    hidden: torch.Tensor | None  # (H,) LM-head input at the last cached token (None: the engine gave none)
    new_tokens: int = 0
    done: bool = False


def emit(state: DecodeState, tokens: list[int], budget: int, eos: set[int], stopping=None) -> list[int]:
    """Append tokens, stopping at the budget, just after an EOS, or where a stopping criterion fires (checked
    after every token, as transformers does); returns what was appended."""
    out = []
    for tok in tokens:
        state.sequence[state.length] = tok
        state.length += 1
        state.new_tokens += 1
        out.append(tok)
        if tok in eos or state.new_tokens >= budget or (
            stopping and bool(stopping(state.sequence[None, : state.length], None).any())
        ):
            state.done = True
            break
    return out


def accept_tree(rule: AcceptRule, tree: torch.Tensor, buffers: TreeBuffers, out: TargetOutput, processors,
                prefix: torch.Tensor) -> tuple[torch.Tensor, int]:
    """One tree's accepted nodes (root first) and the target's own next token: from the target's argmax at each
    node where it handed that over (out.choices), else by `rule` from its logits, processed first with each node's
    own path after `prefix` as context."""
    if out.choices is not None:
        return accept_choices(tree, out.choices, buffers)
    logits = out.logits
    if processors:
        logits = process_tree(processors, prefix, tree, logits, buffers.mask)
    return rule.accept(tree, logits, buffers)


class _Rows(Protocol):
    """What the decode loop needs of its rows: one sequence (_OneRow) or a batch (engines/base.BatchRows)."""

    def verify(self, running: list[int], roots: list[torch.Tensor], drafts: list[Draft],
               greedy: bool) -> list[tuple[torch.Tensor, TargetOutput]]:
        """One target forward over the running rows' trees: each one's tree tokens (root first) and its output."""
        ...

    def commit(self, running: list[int], keeps: list[torch.Tensor]) -> None:
        """The cache keeps each running row's accepted nodes (root first) and nothing else of its tree."""
        ...


def run(rows: _Rows, states: list[DecodeState], plan: "DecodePlan", max_new_tokens: int, eos: set[int],
        stats: DecodeStats, stopping=None, on_emit=None) -> None:
    """The decode loop, for one row and a batch alike: propose -> verify -> accept -> commit until every row is
    done. `on_emit(tokens)`: called with each step's new tokens of a single row (a streamer)."""
    clock = time.perf_counter
    drafter, buffers, rule, processors = plan.drafter, plan.buffers, plan.rule, plan.processors
    root_alone = from_parents((-1,), buffers.mask.device)
    while not all(s.done for s in states):
        # 1. propose: the drafter chooses each running row's tree below its root and drafts it
        t0 = clock()
        running = [b for b, s in enumerate(states) if not s.done]
        drafted = all(states[b].hidden is not None for b in running)
        if drafted:
            drafts = drafter.draft(torch.stack([states[b].hidden for b in running]),
                                   [states[b].sequence[: states[b].length] for b in running], buffers)
        else:  # an engine that hands over no hidden state with its prefill: the roots alone, once
            drafts = [Draft(states[b].sequence[:0], root_alone) for b in running]
        # 2. verify: one target forward over root + nodes of every running row
        t1 = clock()
        roots = [s.sequence[s.length - 1] for s in states]
        verified = rows.verify(running, roots, drafts, plan.greedy)
        # 3. accept: each row's longest path the target agrees with, plus the target's own next token
        t2 = clock()
        accepted, keeps, emitted = [], [], 0
        for b, (tree, out), (_, step) in zip(running, verified, drafts):
            s = states[b]
            nodes, bonus = accept_tree(rule, tree, step, out, processors, s.sequence[: s.length - 1])
            chunk = emit(s, tree[nodes[1:]].tolist() + [bonus], max_new_tokens, eos, stopping)
            accepted.append(nodes)
            keeps.append(nodes[: len(chunk) + 1])  # up to EOS or the budget; the bonus is the next root
            s.hidden = out.hidden[keeps[-1][-1]]
            emitted += len(chunk)
            stats.tree_sizes.append(step.size - 1)
            if on_emit is not None:
                on_emit(chunk)
        if drafted:
            drafter.update(accepted)
        # 4. commit: the cache keeps root + emitted nodes
        t3 = clock()
        rows.commit(running, keeps)
        stats.tokens_per_step.append(emitted)
        stats.rows_per_step.append(len(running))
        t4 = clock()
        for key, dt in zip(("propose", "verify", "accept", "commit"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            stats.seconds[key] += dt
        stats.loop_seconds.append(t4 - t0 - (t2 - t1))


class _OneRow:
    """One sequence on an engine's session: its tree verified at its own position, cut back to the accepted path."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def verify(self, running, roots, drafts, greedy):
        drafted, buffers = drafts[0]
        tree = torch.cat([roots[0][None], drafted])
        return [(tree, self.session.verify(tree, buffers, greedy))]

    def commit(self, running, keeps):
        self.session.commit(keeps[0])


@torch.no_grad()
def decode(engine: Engine, plan: "DecodePlan", input_ids: torch.Tensor, max_new_tokens: int, eos: set[int],
           streamer=None, stopping=None) -> tuple[torch.Tensor, DecodeStats]:
    """input_ids: (1, L). Returns ((1, L + new) tokens, stats). `stopping`: a transformers StoppingCriteriaList."""
    stats, clock = DecodeStats(), time.perf_counter
    prompt_len = input_ids.shape[1]
    sequence = torch.empty(prompt_len + max_new_tokens, dtype=torch.long, device=input_ids.device)
    sequence[:prompt_len] = input_ids[0]
    on_emit = None if streamer is None else (lambda chunk: streamer.put(torch.tensor(chunk)))
    if streamer is not None:
        streamer.put(input_ids.cpu())

    # past the plan's largest tree the cache grows
    session = engine.session(prompt_len + max_new_tokens + plan.max_size)
    try:
        t0 = clock()
        out = session.prefill(input_ids)
        logits = plan.processors(input_ids, out.logits[-1:].float()) if plan.processors else out.logits[-1:]
        state = DecodeState(sequence, prompt_len, None if out.hidden is None else out.hidden[-1])
        chunk = emit(state, [plan.rule.first(logits)], max_new_tokens, eos, stopping)
        stats.tokens_per_step.append(len(chunk))
        stats.rows_per_step.append(1)
        stats.seconds["prefill"] += clock() - t0
        if on_emit is not None:
            on_emit(chunk)
        run(_OneRow(session), [state], plan, max_new_tokens, eos, stats, stopping, on_emit)
    finally:
        session.close()
    if streamer is not None:
        streamer.end()
    return state.sequence[None, : state.length].clone(), stats
