"""The loop the one-process A/B experiments share: each arm on every prompt, the arms' order reversed every other
prompt, tokens per second per arm and how many outputs differ from a reference arm's."""
from __future__ import annotations

import time
from typing import Callable, Hashable

import torch
from tqdm import tqdm

from medusa_heads.prompting import prompt_ids


def alternate(tok, rows, arms: dict[Hashable, Callable[[torch.Tensor], torch.Tensor]],
              reference: Callable[[Hashable], Hashable] = lambda arm: "hf") -> tuple[dict, dict]:
    """arms: name -> run(prompt ids) -> output ids (prompt included); rows: prompts (their first turn is used);
    reference(arm): the arm whose output each arm's is compared with. Returns (tokens/s, outputs differing) by arm."""
    names = list(arms)
    secs, tokens, differ = ({a: 0.0 for a in names}, {a: 0 for a in names}, {a: 0 for a in names})
    for i, row in enumerate(tqdm(rows, desc="A/B", unit="prompt")):
        ids = prompt_ids(tok, row.turns[0])
        outs = {}
        for arm in (names if i % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            out = arms[arm](ids)
            secs[arm] += time.perf_counter() - t0
            tokens[arm] += out.shape[1] - ids.shape[1]
            outs[arm] = out
        for arm in names:
            differ[arm] += not torch.equal(outs[arm], outs[reference(arm)])
    return {a: tokens[a] / secs[a] for a in names}, differ
