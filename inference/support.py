"""Can we drive this model with tree attention? A small probe at load time, instead of a list of names."""
from __future__ import annotations

import torch

from medusa_heads.tree.buffers import build_buffers
from medusa_heads.tree.spec import TreeSpec
from medusa_heads.engines.hf_cache import keep_accepted, new_cache
from medusa_heads.engines.hf import Target

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
