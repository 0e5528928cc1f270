"""Probes of a transformers model at load: can it be driven with tree attention (check_tree_attention), and are a
tree's rows its plain steps bit for bit (exactness_problem)? Small trees on the model itself, not lists of names."""
from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache

from medusa_heads.engines.hf import Target
from medusa_heads.engines.hf_cache import crop_to, keep_accepted, new_cache
from medusa_heads.kernels import exact_attention, int8
from medusa_heads.kernels.exactness import first_dependent_rows, has_attention_sinks
from medusa_heads.kernels.prepack import PackedLinear
from medusa_heads.tree.buffers import from_parents

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
        raise ValueError(f"{name}: attn_implementation={impl!r} takes no custom 4D mask; "
                         "load it with 'sdpa' or 'eager'")
    vocab = model.get_output_embeddings().weight.shape[0]
    device = model.device
    a, y, z, w = (torch.tensor([t % vocab], device=device) for t in (11, 23, 29, 31))
    window = target.layout.smallest_window
    n = 2 if window is None else window + 2  # the tree's nodes see past the window's first edge
    prefix = torch.cat([a, (torch.arange(1, n, device=device) * 7 + 17) % vocab])  # (n,)
    tokens = torch.cat([w, y, z])  # w, then y and z below it

    def forward(cache, path):  # plain: the whole text in one forward, no cache; the second branch's on to `a`
        text = torch.cat([prefix, tokens[list(path)], *([a] if path == (0, 2) else [])])
        return model(text[None]).logits[0, n:]

    try:
        rows, plain, cache = _tree_against_plain(target, prefix, tokens, (-1, 0, 0), forward)
        keep_accepted(cache, n, torch.tensor([0, 2], device=device))
        after = target.verify(torch.cat([a, w]), n + 2, cache, from_parents((-1, 0), device))
    except Exception as e:  # report any failure of the probe as "unsupported", with its cause
        raise ValueError(f"{name} cannot be driven with a custom 4D attention mask and cache surgery: {e}") from e
    tol = 1e-3 if model.dtype == torch.float32 else 5e-2
    scale = plain[(0, 2)][1:].abs().max().clamp_min(1.0)
    branch = {node: (got, want) for node, got, want in rows}
    checks = {"tree branch 1": branch[1], "tree branch 2": branch[2],
              "after keeping branch 2": (after.logits[0], plain[(0, 2)][2])}
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
    past = 12
    ids = ((torch.arange(past + 7, device=model.device) * 7919 + 17) % vocab)
    prefix, tokens = ids[:past], ids[past:]

    def steps(cache, path):  # plain steps along the path, on the prefix's cache
        crop_to(cache, past)
        return [target.step(tokens[node : node + 1], past + depth, cache).logits[-1] for depth, node in enumerate(path)]

    parents = (-1, 0, 1, 2, 0, 4, 5)  # root; a chain of three below it; a second chain of two
    rows, _, cache = _tree_against_plain(target, prefix, tokens, parents, steps, past + 16)
    crop_to(cache, past)
    return len({node for node, got, want in rows if not torch.equal(got, want)})


def _tree_against_plain(target: Target, prefix: torch.Tensor, tokens: torch.Tensor, parents: tuple[int, ...], plain,
                        capacity: int | None = None) -> tuple[list, dict, DynamicCache]:
    """What both probes run: the tree of `tokens` (node i below node parents[i]; the root's is -1) verified after
    `prefix` (1-D) on a new cache (of `capacity`), then plain(cache, path) along each of its paths from the root to a
    leaf: plain decoding's logits there, a row for each node of the path in turn (and any past its leaf).
    Returns ([(node, its row in the tree, its plain row)] path after path, {path: plain's logits}, the cache)."""
    model = target.model
    buffers = from_parents(parents, model.device)
    cache = new_cache(model, capacity)
    target.prefill(prefix[None], cache)
    tree = target.verify(tokens, prefix.shape[0], cache, buffers).logits
    plain_rows = {}
    for path in (tuple(p[:n].tolist()) for p, n in zip(buffers.paths, buffers.path_len)):
        plain_rows[path] = plain(cache, path)
    rows = [(node, tree[node], row) for path, along in plain_rows.items() for node, row in zip(path, along)]
    return rows, plain_rows, cache
