"""The alternating A/B loop every timing in the project shares: each arm once on every item, the arms' order reversed
every other item (or rotated, each arm first in turn), so that a drift in the machine's speed hits every arm alike;
each call timed on perf_counter between two syncs of the device (device_sync: CUDA runs kernels asynchronously, so a
call's work is drained into its own time and none is left pending into the next), with set-up and clean-up around a
call (before / after) off the clock.

`alternate` yields each item's round as it ends, for callers that read the outputs before the next item is made (a
bench's next turn holds the reply just timed); `timings` collects every round's seconds and outputs by arm."""
from __future__ import annotations

import time
from typing import Any, Callable, Hashable, Iterable, Iterator, Mapping, NamedTuple, Sequence

import torch

Arms = Mapping[Hashable, Callable[[Any], Any]]  # arm -> run(item) -> its output
Hook = Callable[[Hashable], None] | None  # called with the arm, off the clock


class Timed(NamedTuple):
    """One timed call: what it returned and its wall seconds."""

    output: Any
    seconds: float


class Timings(NamedTuple):
    """Every round by arm, in the order of the items: each call's seconds and output."""

    seconds: dict[Hashable, list[float]]
    outputs: dict[Hashable, list[Any]]


def device_sync(device: torch.device | str) -> Callable[[], None] | None:
    """The sync hook for timings on `device`: CUDA's synchronize there, else None (a CPU call ends when it returns)."""
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else None


def arm_order(arms: Sequence[Hashable], index: int, rotate: bool = False) -> list[Hashable]:
    """The arms in the order they run at item `index`: as given on even items, reversed on odd ones; rotate: the
    arm at index % len(arms) first, the others after it in turn (each arm first in turn, for three arms or more)."""
    arms = list(arms)
    if rotate:
        k = index % len(arms)
        return arms[k:] + arms[:k]
    return arms if index % 2 == 0 else arms[::-1]


def timed(call: Callable[[], Any], sync: Callable[[], None] | None = None) -> Timed:
    """call()'s output and wall seconds on perf_counter, sync() before the clock starts and before it stops."""
    if sync is not None:
        sync()
    t0 = time.perf_counter()
    output = call()
    if sync is not None:
        sync()
    return Timed(output, time.perf_counter() - t0)


def run_round(arms: Arms, item: Any, index: int, sync: Callable[[], None] | None = None, before: Hook = None,
              after: Hook = None, rotate: bool = False) -> dict[Hashable, Timed]:
    """Each arm once on `item`, in arm_order(arms, index, rotate), each call timed (timed); before(arm) and
    after(arm) run just outside its clock (inputs prepared, a cache cropped back, a counter or a peak read).
    Returns {arm: Timed} in the order the arms ran."""
    results = {}
    for arm in arm_order(list(arms), index, rotate):
        if before is not None:
            before(arm)
        results[arm] = timed(lambda: arms[arm](item), sync)
        if after is not None:
            after(arm)
    return results


def alternate(arms: Arms, items: Iterable[Any], sync: Callable[[], None] | None = None, before: Hook = None,
              after: Hook = None, rotate: bool = False) -> Iterator[tuple[Any, dict[Hashable, Timed]]]:
    """run_round on each item in turn, the i-th at index i: yields (item, {arm: Timed}) as each round ends, before
    the next item is taken from `items` (which may be made from the outputs just yielded)."""
    for index, item in enumerate(items):
        yield item, run_round(arms, item, index, sync, before, after, rotate)


def timings(arms: Arms, items: Iterable[Any], skip: int = 0, sync: Callable[[], None] | None = None,
            before: Hook = None, after: Hook = None, rotate: bool = False) -> Timings:
    """Every round of alternate() collected by arm, the first `skip` rounds (a warm-up) left out."""
    out = Timings({arm: [] for arm in arms}, {arm: [] for arm in arms})
    for index, (_, results) in enumerate(alternate(arms, items, sync, before, after, rotate)):
        if index < skip:
            continue
        for arm, (output, seconds) in results.items():
            out.seconds[arm].append(seconds)
            out.outputs[arm].append(output)
    return out
