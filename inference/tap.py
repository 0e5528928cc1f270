"""The one way we read a model's LM-head input (its final hidden state): a forward pre-hook, while a `with` lasts."""
from __future__ import annotations

import torch


class LMHeadTap:
    """Records the LM head's input at every forward call inside the `with`: the whole input (B, T, H), or with
    `last_only` just its last position (B, H) in bf16 (one call per token during generate: training features)."""

    def __init__(self, model, last_only: bool = False) -> None:
        self.lm_head = model.get_output_embeddings()
        if self.lm_head is None:
            raise ValueError(f"{type(model).__name__} has no output embeddings (LM head) to read hidden states from")
        self.last_only = last_only
        self.steps: list[torch.Tensor] = []

    def _record(self, module: torch.nn.Module, args: tuple) -> None:
        self.steps.append(args[0][:, -1].to(torch.bfloat16) if self.last_only else args[0])

    def __enter__(self) -> "LMHeadTap":
        self.handle = self.lm_head.register_forward_pre_hook(self._record)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()

    def first(self) -> torch.Tensor:
        """The input of the first call (B, T, H)."""
        if not self.steps:
            raise RuntimeError(f"{type(self.lm_head).__name__} was never called: the model's forward did not use its LM head")
        return self.steps[0]

    def hidden(self) -> torch.Tensor:
        """(B, steps, H): the last position of every call, in order (with last_only)."""
        return torch.stack(self.steps, dim=1)
