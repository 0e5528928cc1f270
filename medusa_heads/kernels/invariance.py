"""The one row-invariance probe: does a product give a row the same bits whatever rows are beside it?

Exactness in bf16 and int8 rests on it (a tree verify's rows must be the plain steps that would compute them), and
three checks ask it of different products: the load check of a model's packed products and stock linears
(exactness.first_dependent_rows, cap_rows), this CPU's bf16 products (exact_attention.rows_invariant) and its int8
linear (int8.int8_rows_invariant)."""
from __future__ import annotations

from typing import Callable, Iterable

import torch

COUNTS = (2, 5, 8, 16, 32)  # the row counts the machine-wide probes check, of 32 rows


def rows_change_at(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                   counts: Iterable[int]) -> int | None:
    """The first row count m of `counts` at which product(x[..., :m, :]) gives a row other bits than product of that
    row alone (rows are x's second-last dimension, outputs the product's); None if none does. Every row is compared:
    a kernel may take the rows past a block another way and leave the first ones as they were. The caller chooses
    the grad mode (no_grad, inference_mode) the products run in."""
    counts = list(counts)
    if not counts:
        return None
    alone = torch.cat([product(x[..., i : i + 1, :]) for i in range(max(counts))], dim=-2)
    for m in counts:
        if not torch.equal(product(x[..., :m, :]), alone[..., :m, :]):
            return m
    return None
