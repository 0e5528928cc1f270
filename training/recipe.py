"""Training recipes: YAML files under configs/train/, parsed into a dataclass; `--set key=value` overrides."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from medusa_heads.config import DEFAULT_TREE


@dataclass
class TrainRecipe:
    model: str = "smollm2-135m-instruct"  # base model: the default's name, a local HF directory or a hub id
    # distilled conversations (JSONL from `medusa-heads distill`; several: comma-separated)
    data: str = "data/distilled.jsonl"
    features: str = "data/features"  # hidden-state shards (`distill --features`); train computes those missing
    out: str = "runs/heads"  # heads directory to write (loadable with MedusaModel.from_pretrained(base, heads=out))
    num_heads: int = 4  # K
    num_layers: int = 1  # residual blocks per head
    mlp_size: int = 0  # 0: square residual blocks (Medusa); > 0: two-layer blocks H -> mlp_size -> H
    # what heads see besides h_t: "none" (Medusa), "root" (+ the root token), "path" (+ root and drafted path)
    condition: str = "none"
    draft_vocab_size: int = 4096  # most frequent answer tokens the heads may propose; 0 = the whole vocabulary
    decay: float = 0.8  # loss weight of head k is decay ** (k - 1)
    soft_weight: float = 0.0  # share of the soft-target loss: each head also learns the target's own distribution
    # at the position it guesses (the frozen LM head over the cached features), not only the token it chose there
    soft_topk: int = 32  # soft targets keep the target's m most likely draft tokens there, renormalised
    lr: float = 1e-3  # AdamW peak learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    warmup_steps: int = 50  # linear warm-up, then cosine decay to 0 at max_steps
    max_steps: int = 1000  # optimizer steps
    batch_size: int = 2048  # answer positions per process per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    eval_fraction: float = 0.05  # share of conversations held out (chosen by a hash of their id)
    eval_every: int = 100  # steps between evaluations (and log lines)
    save_every: int = 100  # steps between checkpoints (atomic; --resume continues from the last)
    mixed_precision: str = "no"  # "no" (fp32) or "bf16", through accelerate
    seed: int = 0  # data order
    tree: str = DEFAULT_TREE  # tree preset written into the heads' config (calibrate can replace it)
    lookup_tokens: int = 0  # prompt-lookup tokens merged into the tree by default (written into the heads' config)
    # Medusa-2 (joint training): lora_rank > 0 trains peft LoRA adapters on the target together with the heads,
    # from the conversations themselves (no cached features: the target runs every step). Loss = heads' loss
    # + lm_weight * CE(target, distilled tokens) + kl_weight * KL(frozen target || adapted target), answers only.
    lora_rank: int = 0  # 0: Medusa-1, the target stays frozen
    lora_alpha: float = 16.0  # LoRA scaling numerator (scale = alpha / rank)
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj"  # comma-separated module names that get adapters
    lora_lr: float = 1e-4  # AdamW learning rate of the adapters (the heads use lr)
    lm_weight: float = 0.0  # weight of the target's own LM loss on the distilled answers
    kl_weight: float = 1.0  # weight of the KL to the frozen target (keeps the adapted model's outputs close)
    max_length: int = 512  # tokens per conversation in joint training
    init_heads: str = ""  # start from these trained heads (more data; Medusa-2's second stage); "" = new heads

    def __post_init__(self) -> None:
        from medusa_heads.config import CONDITIONS

        if self.condition not in CONDITIONS:
            raise ValueError(f"condition must be one of {', '.join(CONDITIONS)}, got {self.condition!r}")
        if self.mixed_precision not in ("no", "bf16"):
            raise ValueError(f"mixed_precision must be 'no' or 'bf16', got {self.mixed_precision!r}")
        if not 0 <= self.soft_weight <= 1:
            raise ValueError(f"soft_weight must be in [0, 1], got {self.soft_weight}")
        if self.soft_weight > 0 and self.lora_rank > 0:
            raise ValueError("soft_weight applies to heads trained on cached features; "
                             "joint (LoRA) training has no soft targets")
        if self.soft_topk < 1:
            raise ValueError(f"soft_topk must be >= 1, got {self.soft_topk}")
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0, got {self.lora_rank}")
        for name in ("num_heads", "max_steps", "batch_size", "grad_accum", "eval_every", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")

    def heads_config(self, vocab_size: int, hidden_size: int, vocab: list[int], fingerprint: dict):
        """The MedusaConfig of the heads this recipe trains over a base of that shape: the recipe's head fields,
        the draft vocabulary `vocab` (None when it is the whole vocabulary) and the base's fingerprint."""
        from medusa_heads.config import MedusaConfig

        return MedusaConfig(
            num_heads=self.num_heads, num_layers=self.num_layers, mlp_size=self.mlp_size, condition=self.condition,
            hidden_size=hidden_size, vocab_size=vocab_size, draft_vocab=None if len(vocab) == vocab_size else vocab,
            tree=self.tree, lookup_tokens=self.lookup_tokens, base_fingerprint=fingerprint,
        )

    @classmethod
    def load(cls, path: str | Path | None, overrides: list[str] = ()) -> "TrainRecipe":
        values = {}
        if path is not None:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
            if not isinstance(loaded, dict):
                raise ValueError(f"{path}: a recipe is a mapping of keys to values")
            values.update(loaded)
        types = {f.name: f.type for f in fields(cls)}
        for item in overrides:
            key, sep, raw = item.partition("=")
            if not sep:
                raise ValueError(f"--set expects key=value, got {item!r}")
            values[key] = yaml.safe_load(raw)
        unknown = sorted(set(values) - set(types))
        if unknown:
            raise ValueError(f"unknown recipe keys: {', '.join(unknown)} (known: {', '.join(types)})")
        for key, value in values.items():
            want = {"int": int, "float": float, "str": str}[types[key]]
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if want is float and isinstance(value, str):  # YAML 1.1 reads 2e-4 (no dot) as a string
                try:
                    value = float(value)
                except ValueError:
                    pass
            if not isinstance(value, want) or isinstance(value, bool):
                raise ValueError(f"recipe key {key} must be {types[key]}, got {value!r}")
            values[key] = value
        return cls(**values)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
