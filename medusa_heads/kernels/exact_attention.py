"""An attention whose every row is computed as if it were alone: what makes a tree verify in bf16 give, row for row,
the logits that plain decoding gives.

Why: a verify appends a whole tree in one forward, and each node's row must equal the plain step that would have
computed that token. In fp32 the two differ by rounding only (~1e-5: argmax ties are all that could flip). In bf16
they differ by ~0.3 in the logits, and greedy output leaves plain decoding's at near-ties. Two things make a row
depend on the others:
- transformers' SDPA path runs PyTorch's fused CPU kernel, whose blocking depends on the query length;
- in a tree, a node's visible keys (the prefix, then its ancestors) are interleaved with masked ones (its cousins),
  and a softmax sums over the row in vector lanes: a masked key in the middle shifts the later keys to other lanes.

This attention is transformers' eager attention (the same products, scaling, softcap, mask, fp32 softmax) made
row-exact:
- before the softmax, each row's keys are put in the order visible first (in their cache order, which is position
  order), masked last; for the product with the values, each such row gets its values in that same order. Visible
  first is exactly the order plain decoding sees, and masked keys at the end add exact zeros;
- the keys are padded (masked, zero values) to whole blocks of 64, so that no kernel meets a tail whose rounding
  depends on the length, and the query heads that share a key head are rows of one product.
Plain decoding with it differs from eager decoding only by that rounding (both are bf16 attention with an fp32
softmax); what it guarantees is that a verify's row and a plain step agree bit for bit.

The products (q k^T, p v) and the linears must also give a row the same result whatever the number of rows: the
oneDNN bf16 kernels do (tests/test_exact.py checks the kernels of the CPU it runs on, `rows_invariant`); MKL's fp32
ones do not, which is why fp32 stays "equal up to rounding".
"""
from __future__ import annotations

import functools
import threading
import weakref

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from medusa_heads.kernels import prepack
from medusa_heads.kernels.invariance import COUNTS, rows_change_at

FREE_TAIL: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
"""Preallocated cache buffers (engines/hf_cache.py registers them), by storage address, while they live: past a
layer's length their slots are free, so _padded pads values there instead of copying them."""

NAME = "medusa_exact"
WIDTH = 64  # products and softmax run over a multiple of this many keys (masked, zero padding at the end)


def exact_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                    softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' attention-interface signature: query (B, Hq, T, D), key and value (B, Hkv, N, D), an additive
    float mask (B, 1, T, >= N) -> (output (B, T, Hq, D), None: the probabilities are not returned)."""
    _count.n = getattr(_count, "n", 0) + 1
    if kwargs.get("s_aux") is not None:
        raise ValueError(f"{NAME}: attention sinks are not supported; load this model with "
                         "attn_implementation='eager' or 'sdpa'")
    b, hq, t, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    groups = hq // hkv
    # each kv head's query heads as rows of one product (no copies of the keys); a row's bits do not depend on the
    # rows beside it (rows_invariant), so this is the per-head product
    weights = torch.matmul(query.reshape(b, hkv, groups * t, d), key.transpose(2, 3)).view(b, hq, t, n) * scaling
    if softcap is not None:
        weights = torch.tanh(weights / softcap) * softcap
    width = n + (-n % WIDTH)  # keys padded to whole blocks: the products' and the softmax's kernels see no tail
    plan = None
    if attention_mask is not None:
        mask, plan = _plan(attention_mask, n, width, weights.dtype)
        weights = weights + mask
        if plan is not None:
            weights = weights.gather(-1, plan[0].expand_as(weights))
    weights = nn.functional.pad(weights, (0, width - n), value=torch.finfo(weights.dtype).min)
    probs = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)  # (B, Hq, T, width)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    values = _padded(value, width)  # (B, Hkv, width, D), zeros past the keys
    if plan is None:
        out = torch.matmul(probs.view(b, hkv, groups * t, width), values).view(b, hq, t, d)
        return out.transpose(1, 2).contiguous(), None
    # each row's values in its own order, so that a visible key meets the same place in the product as in plain
    # decoding (masked keys, now last, add exact zeros): (B, Hkv, T, width, D), one copy of the values per row. The
    # first `shared` keys (the cached prefix) are every row's first, in cache order: copied as one broadcast, and only
    # the rest gathered row by row (a gather of the whole width costs 4-6x more)
    order, shared = plan[1], plan[2]
    rows = (_row_values(values[0], order[0], shared, t)[None] if b == 1
            else torch.stack([_row_values(values[i], order[i], shared, t) for i in range(b)]))
    out = torch.matmul(probs.view(b, hkv, groups, t, width).transpose(2, 3), rows)  # (B, Hkv, T, groups, D)
    return out.transpose(2, 3).reshape(b, hq, t, d).transpose(1, 2).contiguous(), None


_count = threading.local()  # calls so far in each thread: whether a model's forward goes through this attention


def calls() -> int:
    """This attention's calls so far in this thread (medusa_heads/kernels/exactness.py compares the count before and
    after a probe's forwards: another thread decoding meanwhile must not make a model that skips it look as if it ran
    it)."""
    return getattr(_count, "n", 0)


_plans: list = []  # [(mask, n, (float mask, plan))]: the last few masks' analysis, shared by a forward's layers


def _plan(attention_mask: torch.Tensor, n: int, width: int, dtype: torch.dtype):
    """(the additive mask over the n keys, None or (order (B, 1, T, N): each row's keys visible first, order
    (B, T, width) for its values, padding included, and how many leading keys every row sees, which are then every
    row's first in cache order)). A forward passes every layer of a kind the same mask object:
    its analysis is made once and kept while the object lives (held here, so identity cannot be reused)."""
    for held, held_n, result in list(_plans):
        if held is attention_mask and held_n == n:
            return result
    mask = attention_mask[..., :n]
    if mask.dtype == torch.bool:  # True: attend
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    hidden = mask == torch.finfo(mask.dtype).min
    plan = None
    if bool((hidden[..., :-1] & ~hidden[..., 1:]).any()):  # a masked key before a visible one
        order = torch.sort(hidden.to(torch.int8), dim=-1, stable=True).indices  # (B, 1, T, N): visible first
        rows = torch.cat([order[:, 0], torch.arange(n, width, device=order.device).expand(
            order.shape[0], order.shape[2], width - n)], dim=-1)
        masked_somewhere = hidden.flatten(0, -2).any(dim=0)  # (N,): a key some row does not see
        shared = int(masked_somewhere.to(torch.int8).argmax())  # the keys before it: every row's first, in order
        plan = (order, rows, shared)
    result = (mask, plan)
    _plans[:] = [*_plans[-3:], (attention_mask, n, result)]
    return result


def _row_values(values: torch.Tensor, order: torch.Tensor, shared: int, t: int) -> torch.Tensor:
    """values (H, width, D) of one sequence, order (T, width) -> (H, T, width, D): row r's values in order[r],
    whose first `shared` entries are 0..shared - 1 for every row."""
    h, _, d = values.shape
    head = values[:, None, :shared].expand(h, t, shared, d)
    return torch.cat([head, values[:, order[:, shared:]]], dim=2)


def _padded(value: torch.Tensor, width: int) -> torch.Tensor:
    """value (B, H, N, D) with zeros up to `width` keys: in place where it is a view of a preallocated cache layer's
    buffer with room (medusa_heads/engines/hf_cache.py: the slots past its length are free), else a padded copy."""
    n = value.shape[2]
    if width == n:
        return value
    if FREE_TAIL.get(value.untyped_storage().data_ptr()) is not None:
        b, h, _, d = value.shape
        stride = value.stride()
        room = value.untyped_storage().nbytes() // value.element_size() - value.storage_offset()
        if (stride[3] == 1 and stride[2] == d and stride[1] >= width * d and stride[0] >= h * stride[1]
                and room >= (b - 1) * stride[0] + (h - 1) * stride[1] + width * d):
            wide = value.as_strided((b, h, width, d), stride)
            wide[:, :, n:].zero_()
            return wide
    return nn.functional.pad(value, (0, 0, 0, width - n))


@functools.cache
def register() -> str:
    """Registers the attention (and eager's mask builder for it) with transformers; returns its name."""
    AttentionInterface.register(NAME, exact_attention)
    AttentionMaskInterface.register(NAME, eager_mask)
    return NAME


def use_exact_attention(model) -> None:
    """Switch a loaded model to this attention (`generate` on it then is the plain decoding that the heads' greedy
    output equals)."""
    model.set_attn_implementation(register())


def uses_exact_attention(model) -> bool:
    return getattr(model.config, "_attn_implementation", None) == NAME


@functools.cache
def rows_invariant(dtype: torch.dtype, device: str = "cpu", sizes: tuple[tuple[int, int], ...] = (
        (576, 576), (1536, 576), (576, 1536), (960, 576), (3072, 576), (64, 64), (512, 64))) -> bool:
    """Whether this machine's products give a row the same bits whatever the number of rows beside it (1 to 32),
    for linears of these (out, in) sizes (SmolLM2's, its q, k and v stacked, its gate and up stacked) and both orders
    of batched products: the kernels' half of exactness (invariance.rows_change_at)."""
    gen = torch.Generator().manual_seed(0)
    for out_f, in_f in sizes:
        w = (torch.randn(out_f, in_f, generator=gen) * 0.05).to(dtype).to(device)
        x = torch.randn(32, in_f, generator=gen).to(dtype).to(device)
        products = [lambda a, w=w: nn.functional.linear(a, w)]
        if device == "cpu" and prepack.packs(dtype):  # the prepacked linears too (medusa_heads/kernels/prepack.py)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)
            products.append(lambda a, p=packed: torch.ops.mkldnn._linear_pointwise(a, p, None, "none", [], ""))
        if any(rows_change_at(product, x, COUNTS) is not None for product in products):
            return False
        batched = x.view(1, 1, 32, in_f).expand(2, 3, 32, in_f)  # a (2, 3) batch of the same rows
        if rows_change_at(lambda a, w=w: torch.matmul(a, w.T), batched, (8,)) is not None:
            return False
    return True
