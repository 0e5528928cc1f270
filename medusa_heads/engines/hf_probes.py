"""Probes of a transformers model at load: can it be driven with tree attention (check_tree_attention), and are a
tree's rows its plain steps bit for bit (exactness_problem)? Small trees on the model itself, not lists of names."""
from __future__ import annotations

import torch

from torch import nn

from medusa_heads.engines.hf import Target
from medusa_heads.engines.hf_cache import crop_to, keep_accepted, new_cache
from medusa_heads.kernels import exact_attention, int8
from medusa_heads.kernels.exactness import first_dependent_rows, has_attention_sinks
from medusa_heads.kernels.prepack import PackedLinear
from medusa_heads.tree.buffers import build_buffers, from_parents
from medusa_heads.tree.spec import TreeSpec

_UNSUPPORTED_ATTENTION = ("flash_attention_2", "flash_attention_3", "flex_attention")


@torch.no_grad()
def check_tree_attention(target: Target) -> None:
    """Verify a two-branch tree and commit one branch, and compare with plain forwards. Raise ValueError if the
    model (in this transformers version) ignores a custom 4D mask or its cache cannot keep a path. On a model with
    sliding-window or chunked layers the prefix runs past the smallest window, so that what would fail mid-answer
    fails here."""
    model = target.model
    name = type(model).__name__
    impl = getattr(model.config, "_attn_implementation", None)
    if impl in _UNSUPPORTED_ATTENTION:
        raise ValueError(f"{name}: attn_implementation={impl!r} takes no custom 4D mask; load it with 'sdpa' or 'eager'")
    vocab = model.get_output_embeddings().weight.shape[0]
    device = model.device
    a, y, z, w = (torch.tensor([t % vocab], device=device) for t in (11, 23, 29, 31))
    window = target.layout.smallest_window
    n = 2 if window is None else window + 2  # the tree's nodes see past the window's first edge
    prefix = torch.cat([a, (torch.arange(1, n, device=device) * 7 + 17) % vocab])  # (n,)
    buffers = build_buffers(TreeSpec.from_paths([[0], [1]])).to(device)
    try:
        cache = new_cache(model)
        target.prefill(prefix[None], cache)
        tree = target.verify(torch.cat([w, y, z]), n, cache, buffers)
        keep_accepted(cache, n, torch.tensor([0, 2], device=device))
        after = target.verify(torch.cat([a, w]), n + 2, cache, build_buffers(TreeSpec.from_paths([[0]])).to(device))
        plain_y = model(torch.cat([prefix, w, y])[None]).logits[0, -1]
        plain_z = model(torch.cat([prefix, w, z, a])[None]).logits[0, -2:]
    except Exception as e:  # report any failure of the probe as "unsupported", with its cause
        raise ValueError(f"{name} cannot be driven with a custom 4D attention mask and cache surgery: {e}") from e
    tol = 1e-3 if model.dtype == torch.float32 else 5e-2
    scale = plain_z.abs().max().clamp_min(1.0)
    checks = {
        "tree branch 1": (tree.logits[1], plain_y),
        "tree branch 2": (tree.logits[2], plain_z[0]),
        "after keeping branch 2": (after.logits[0], plain_z[1]),
    }
    for what, (got, want) in checks.items():
        err = float((got.float() - want.float()).abs().max() / scale)
        if err > tol:
            raise ValueError(
                f"{name} does not apply a custom 4D attention mask as medusa-heads needs ({what}: relative error "
                f"{err:.2e}); tree decoding would change its outputs, so it is refused"
            )


@torch.no_grad()
def exactness_problem(target) -> str | None:
    """Why a tree's rows would not be this model's plain steps bit for bit (None: they are, as far as checked):
    its attention, its linears' kernels, or a probe on the model itself. For models that promise it (promises_exact)."""
    model = target.model
    own_attention = (f"{type(model).__name__} computes its attention itself, not through transformers' attention "
                     "interface, so the row-exact attention cannot serve it")
    if model.dtype == torch.bfloat16 and not exact_attention.rows_invariant(torch.bfloat16):
        return "this CPU's bf16 products give a row other bits beside other rows"
    if int8.is_int8(model) and not int8.int8_rows_invariant(model.dtype):
        return "this CPU's int8 products are not exact integer sums, or give a row other bits beside other rows"
    if not getattr(model, "_supports_attention_backend", True):
        return own_attention
    if not exact_attention.uses_exact_attention(model):
        if has_attention_sinks(model):
            return ("its attention has sinks (a learned logit per head beside the keys), which the row-exact "
                    "attention does not take")
        impl = getattr(model.config, "_attn_implementation", None)
        return (f"its attention is {impl!r}, which rounds a tree's rows by the rows beside them; load it with "
                f"attn_implementation='{exact_attention.NAME}' (medusa_heads.kernels.exact_attention."
                "use_exact_attention(model) before MedusaModel.from_pretrained)")
    checked = set()  # stock linears by shape: the kernel follows the shape, not the weights
    for module_name, m in model.named_modules():
        if type(m) is nn.Linear and m.weight.dtype == torch.bfloat16:
            shape = (m.out_features, m.in_features, m.bias is not None, m.weight.device)
            if shape in checked:
                continue
            checked.add(shape)
            bad = first_dependent_rows(lambda a, m=m: nn.functional.linear(a, m.weight, m.bias), m.in_features,
                                       torch.bfloat16, m.weight.device, 33)
            if bad is not None:
                return (f"its {module_name} ({m.out_features} x {m.in_features}) runs on the stock bf16 kernel, which "
                        f"gives a row other bits beside {bad - 1} others here; load it with prepack=True, which splits "
                        "such products")
        elif isinstance(m, PackedLinear) and m.packed_as[0] == torch.bfloat16 and not m.enabled:
            return f"its {module_name} runs on the stock kernels (stock_kernels)"
    before = exact_attention.calls()
    rows = _probe(target)
    if exact_attention.calls() == before:
        return own_attention
    if rows:
        return (f"in a probe on this model, {rows} of a small tree's rows differ from plain steps along their paths "
                "(some layer rounds a row by the rows beside it)")
    return None


def _probe(target) -> int:
    """How many rows of a 7-node tree (two branches) verified after a 12-token prefix differ from plain steps."""
    model = target.model
    vocab = model.get_output_embeddings().weight.shape[0]
    device = model.device
    past = 12
    ids = ((torch.arange(past + 7, device=device) * 7919 + 17) % vocab)
    prefix, tokens = ids[None, :past], ids[past:]
    parents = (-1, 0, 1, 2, 0, 4, 5)  # root; a chain of three below it; a second chain of two
    buffers = from_parents(parents, device)
    cache = new_cache(model, past + 16)
    target.prefill(prefix, cache)
    tree = target.verify(tokens, past, cache, buffers).logits
    differ = set()
    for path in ((0, 1, 2, 3), (0, 4, 5, 6)):
        crop_to(cache, past)
        for depth, node in enumerate(path):
            step = target.step(tokens[node : node + 1], past + depth, cache).logits[-1]
            if not torch.equal(tree[node], step):
                differ.add(node)
    crop_to(cache, past)
    return len(differ)
