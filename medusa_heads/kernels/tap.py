"""The one way we read a model's LM-head input (its final hidden state): a forward pre-hook, while a `with` lasts.

One model may serve many threads at once (as transformers' generate allows), so a tap must see only the forwards
of its own thread. The LM head therefore carries one permanent hook, installed once, which hands each call's input
to the taps open in the calling thread; a forward in another thread finds none of them."""
from __future__ import annotations

import threading

import torch

_install_lock = threading.Lock()
_local = threading.local()  # _local.taps: {lm_head module: [taps open in this thread, innermost last]}


def _open_taps(lm_head: torch.nn.Module) -> list["LMHeadTap"]:
    if not hasattr(_local, "taps"):
        _local.taps = {}
    return _local.taps.setdefault(lm_head, [])


def _dispatch(module: torch.nn.Module, args: tuple) -> None:
    """The LM head's one pre-hook: hands its input to the taps open in the calling thread."""
    for tap in getattr(_local, "taps", {}).get(module, ()):
        tap.record(args[0])


def _install(lm_head: torch.nn.Module) -> None:
    """Hook the LM head once (under a lock, so two threads never hook it twice). A plain function: deep copies
    of the model keep it, and it holds no state."""
    hooked = lambda: any(hook is _dispatch for hook in lm_head._forward_pre_hooks.values())  # noqa: E731
    if not hooked():
        with _install_lock:
            if not hooked():
                lm_head.register_forward_pre_hook(_dispatch)


class LMHeadTap:
    """Records the LM head's input at every forward call of this thread inside the `with`: the whole input
    (B, T, H), or with `last_only` just its last position (B, H) in bf16 (one call per token during generate:
    training features)."""

    def __init__(self, model, last_only: bool = False) -> None:
        self.lm_head = model.get_output_embeddings()
        if self.lm_head is None:
            raise ValueError(f"{type(model).__name__} has no output embeddings (LM head) to read hidden states from")
        self.last_only = last_only
        self.steps: list[torch.Tensor] = []

    def record(self, x: torch.Tensor) -> None:
        self.steps.append(x[:, -1].to(torch.bfloat16) if self.last_only else x)

    def __enter__(self) -> "LMHeadTap":
        _install(self.lm_head)
        _open_taps(self.lm_head).append(self)
        return self

    def __exit__(self, *exc) -> None:
        taps = _open_taps(self.lm_head)
        taps.remove(self)
        if not taps:
            del _local.taps[self.lm_head]  # hold no reference to a model nobody taps

    def first(self) -> torch.Tensor:
        """The input of the first call (B, T, H)."""
        if not self.steps:
            raise RuntimeError(f"{type(self.lm_head).__name__} was never called: "
                               "the model's forward did not use its LM head")
        return self.steps[0]

    def hidden(self) -> torch.Tensor:
        """(B, steps, H): the last position of every call, in order (with last_only)."""
        return torch.stack(self.steps, dim=1)
