"""The draft architecture vLLM builds for `medusa-heads export --format vllm`: vLLM's MedusaProposer calls
model(hidden_states), then model.compute_logits(...) and takes each head's argmax as the chain it proposes."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from medusa_heads_vllm.heads import DraftHeads

ARCHITECTURE = "MedusaHeadsDraft"


class MedusaHeadsDraft(nn.Module):
    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()
        spec_config = vllm_config.speculative_config
        config = spec_config.draft_model_config.hf_config
        spec = getattr(config, "medusa_heads", None)
        if spec is None:
            raise ValueError(f"{spec_config.model}: config.json has no medusa_heads entry; export the heads with "
                             "`medusa-heads export --format vllm`")
        self.heads = DraftHeads(spec, config.hidden_size, config.vocab_size)
        asked = spec_config.num_speculative_tokens
        if not 1 <= asked <= spec["num_heads"]:
            raise ValueError(f"num_speculative_tokens={asked}, but these heads draft 1 to {spec['num_heads']} tokens")
        self.heads.heads = asked  # the first `asked` heads draft: fewer tokens to verify where that pays

    def forward(self, hidden_states: torch.Tensor) -> list[torch.Tensor]:
        return self.heads.draft(hidden_states)

    def compute_logits(self, hidden_states: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.heads.full_vocab(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return {f"heads.{name}" for name in self.heads.load_state(weights)}
