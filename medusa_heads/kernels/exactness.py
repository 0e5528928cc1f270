"""Is a tree verify's every row, bit for bit, the plain step that would compute it, on the model at hand?

bf16 (with the row-exact attention) and int8 on a CPU promise greedy output equal to the model's own plain decoding
token for token. That rests on every op of a forward giving a row the same bits whatever the rows beside it, which
depends on the model as much as on the CPU:
- a product's kernel can change with the number of rows: oneDNN's bf16 linears on an Intel Xeon with AMX give a row
  other bits from 33 rows on (at 960 x 576, 3072 x 576, 576 x 1536 and the LM head; not at 576 x 576), and a batch's
  verify takes rows x tree tokens at once. `cap_rows` finds, for each of the model's own packed products, the rows
  from which this happens and splits larger products there (PackedLinear.run);
- a model may compute its attention itself instead of through transformers' attention interface (Falcon does), so
  that the row-exact attention never runs; or hold a layer whose rows depend on each other in another way.
  `exactness_problem` checks, on the model itself, that the row-exact attention runs, and that a small tree's rows
  equal plain steps along their paths.
Where either fails the model still decodes, with output that may leave its plain decoding at near-ties of the top two
tokens (as fp16 or SDPA bf16 may), and MedusaModel says so once at load."""
from __future__ import annotations

import torch
from torch import nn

from medusa_heads.kernels.int8 import Int8Linear, is_int8
from medusa_heads.kernels.invariance import rows_change_at
from medusa_heads.kernels.prepack import PackedLinear

MAX_ROWS = 64  # products are checked for 2 .. this many rows (cap_rows)


def first_dependent_rows(product, in_features: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                         max_rows: int = MAX_ROWS) -> int | None:
    """The smallest number of rows m (2 .. max_rows) at which product(x[:m]) gives a row other bits than product of
    that row alone; None if none does (invariance.rows_change_at, on two inputs: whether a row's bits move can
    depend on its values). Every row is compared: a kernel may take the rows past a block (32 rows for oneDNN's bf16
    linears with AMX) another way and leave the first ones as they were."""
    first = None
    for seed, scale in ((0, 1.0), (1, 8.0)):
        gen = torch.Generator().manual_seed(seed)
        x = (torch.randn(max_rows, in_features, generator=gen) * scale).to(dtype=dtype, device=device)
        with torch.no_grad():
            found = rows_change_at(product, x, range(2, max_rows + 1 if first is None else first))
        first = first if found is None else found
    return first


def _products(model: nn.Module):
    """The model's distinct packed products: each PackedLinear, or the one its siblings share."""
    seen = set()
    for m in model.modules():
        if isinstance(m, PackedLinear) and m.enabled:
            kernel = m.siblings.kernel if m.siblings is not None else m
            if id(kernel) not in seen:
                seen.add(id(kernel))
                yield kernel


def cap_rows(model: nn.Module, max_rows: int = MAX_ROWS) -> dict[tuple, int | None]:
    """Set `row_cap` on each bf16 packed product of the model (by kernel and shape, checked once each) to the rows
    its kernel takes at once without changing a row's bits (the largest power of two below the first row count that
    changes one); None where every count up to max_rows keeps them. fp32 makes no bit-for-bit promise, and int8's
    integer sums are exact at any row count: they are left as they are.
    Returns {(kernel, out, in): cap}."""
    caps: dict[tuple, int | None] = {}
    for kernel in _products(model):
        if kernel.packed_as[0] != torch.bfloat16 or isinstance(kernel, Int8Linear):
            continue
        key = (type(kernel).__name__, kernel.out_features, kernel.in_features, kernel.bias is not None)
        if key not in caps:
            bad = first_dependent_rows(kernel.product, kernel.in_features, torch.bfloat16, kernel.packed_as[1],
                                       max_rows)
            # down to a power of two: kernels change at block sizes, and some inputs keep their bits a row or two past
            caps[key] = None if bad is None else 1 << ((bad - 1).bit_length() - 1)
        kernel.row_cap = caps[key]
    return caps


def has_attention_sinks(model: nn.Module) -> bool:
    """Whether the model's attention has sinks (a learned logit per head beside the keys, as GPT-OSS's), which the
    row-exact attention does not take."""
    return any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules())


def promises_exact(model: nn.Module) -> bool:
    """Whether this model's greedy output is promised bit for bit: a CPU model in bf16, or with int8 linears."""
    return model.device.type == "cpu" and (model.dtype == torch.bfloat16 or is_int8(model))
