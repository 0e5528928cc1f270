"""The heads medusa-heads trains, as a draft model: plain torch, so it runs inside vLLM's venv (and is tested against
medusa_heads.heads.MedusaHeads in the project's).

From the target's final hidden state h of the last verified position, the chain it proposes is:
  root = argmax(LM head · h)                the target's own next token (exact for greedy requests; for sampled
                                            ones a guess, which can cost acceptance but never correctness)
  head k: z_k = block_k(h + Σ_j P_kj E[c_j])  c = (root, d_1, …, d_k): the context the head was trained to read
                                            ("none": no context, "root": the root only, "path": all of it)
  d_{k+1} = draft_vocab[argmax(W_k · z_k)]  W_k: the target's LM-head rows at the draft vocabulary, or the head's own
Key names are those of medusa-heads' heads.safetensors, plus `lm_head.weight` (the target's, all rows),
`embed_tokens.weight` (the target's input embeddings, absent when they are the LM head) and `draft_vocab`."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CONDITIONS = ("none", "root", "path")


class ResBlock(nn.Module):
    """x + SiLU(W x + b)."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.linear = nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MLPBlock(nn.Module):
    """x + W2 SiLU(W1 x + b1) + b2."""

    def __init__(self, h: int, mlp: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(h, mlp), nn.Linear(mlp, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.silu(self.up(x)))


class Rows(nn.Module):
    """A (V, H) matrix of the target's, held as `<name>.weight` like the target's own modules."""

    def __init__(self, v: int, h: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(v, h), requires_grad=False)


def check_spec(spec: dict) -> dict:
    """The `medusa_heads` entry of an export's config.json, checked; raises ValueError naming the bad key."""
    need = ("num_heads", "num_layers", "mlp_size", "condition", "own_lm_head", "draft_vocab_size", "tied_embeddings")
    missing = [k for k in need if k not in spec]
    if missing:
        raise ValueError(f"config.json's medusa_heads lacks {missing}: re-export with `medusa-heads export --format vllm`")
    if spec["condition"] not in CONDITIONS:
        raise ValueError(f"medusa_heads.condition must be one of {CONDITIONS}, got {spec['condition']!r}")
    return spec


class DraftHeads(nn.Module):
    def __init__(self, spec: dict, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.spec = check_spec(spec)
        h, k = hidden_size, spec["num_heads"]
        self.vocab_size, self.condition = vocab_size, spec["condition"]
        block = (lambda: MLPBlock(h, spec["mlp_size"])) if spec["mlp_size"] else (lambda: ResBlock(h))
        self.blocks = nn.ModuleList(nn.Sequential(*[block() for _ in range(spec["num_layers"])]) for _ in range(k))
        self.lm_head = Rows(vocab_size, h)
        self.token_proj = None
        self.embed_tokens = None
        if self.condition != "none":
            self.token_proj = nn.ModuleList(
                nn.ModuleList(nn.Linear(h, h, bias=False) for _ in range(self.slots(i))) for i in range(k))
            if not spec["tied_embeddings"]:
                self.embed_tokens = Rows(vocab_size, h)
        rows = spec["draft_vocab_size"]
        self.lm_heads = nn.ModuleList(nn.Linear(h, rows, bias=False) for _ in range(k)) if spec["own_lm_head"] else None
        # draft row -> token id; all ids when the heads draft over the whole vocabulary
        self.register_buffer("draft_vocab", torch.arange(rows) if rows == vocab_size else torch.zeros(rows, dtype=torch.long))
        self._rows: torch.Tensor | None = None  # lm_head rows at draft_vocab in the draft dtype (set by loaded())
        # "exact": the root is the argmax of the whole LM head in the engine's dtype (the target's own token for a
        # greedy request); "draft": the argmax over the draft vocabulary's rows, in the draft dtype (a tenth of the
        # bytes at 4,096 of 49,152 rows; wrong where the target's token lies outside the draft vocabulary)
        self.root = spec.get("root", "exact")
        if self.root not in ("exact", "draft"):
            raise ValueError(f"medusa_heads.root must be exact or draft, got {self.root!r}")
        names = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, None: None}
        if spec.get("draft_dtype") not in names:
            raise ValueError(f"medusa_heads.draft_dtype must be one of bfloat16, float16, float32, got {spec['draft_dtype']!r}")
        self.draft_dtype = names[spec.get("draft_dtype")]  # None: the engine's dtype
        self.heads = k  # how many of them draft (vLLM's num_speculative_tokens may ask for fewer)

    def slots(self, head: int) -> int:
        return {"none": 0, "root": 1, "path": head + 1}[self.condition]

    def loaded(self) -> None:
        """After the weights are in: the heads in the draft dtype, and the LM head's draft rows gathered once."""
        dtype = self.draft_dtype or self.lm_head.weight.dtype
        for part in (self.blocks, self.token_proj, self.lm_heads):
            if part is not None:
                part.to(dtype)
        lm = self.lm_head.weight.data
        self._rows = (lm if len(self.draft_vocab) == self.vocab_size else lm[self.draft_vocab]).to(dtype)

    def root_token(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, H) -> (N,) the root each row's chain starts from, as `root` says (exact or draft)."""
        if self._rows is None:
            self.loaded()
        if self.root == "exact":
            lm = self.lm_head.weight
            return (hidden.to(lm.dtype) @ lm.T).argmax(-1)
        return self.draft_vocab[(hidden.to(self._rows.dtype) @ self._rows.T).argmax(-1)]

    def draft(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """(N, H) -> per head, (N, V') logits over the draft vocabulary; head k reads the tokens chosen above it."""
        if self._rows is None:
            self.loaded()
        h = hidden.to(self._rows.dtype)
        context = []
        if self.condition != "none":
            embed = (self.lm_head if self.embed_tokens is None else self.embed_tokens).weight
            context.append(embed[self.root_token(hidden)].to(h.dtype))
        out = []
        for k in range(self.heads):
            x = h
            for j, proj in enumerate(self.token_proj[k] if self.token_proj is not None else ()):
                x = x + proj(context[j])
            z = self.blocks[k](x)
            logits = z @ self._rows.T if self.lm_heads is None else self.lm_heads[k](z)
            out.append(logits)
            if self.condition == "path" and k + 1 < self.heads:
                context.append(embed[self.draft_vocab[logits.argmax(-1)]].to(h.dtype))
        return out

    def full_vocab(self, logits: list[torch.Tensor]) -> list[torch.Tensor]:
        """Draft-vocabulary logits -> logits over the whole vocabulary, -inf outside the draft vocabulary (an argmax
        of these is a token id)."""
        if len(self.draft_vocab) == self.vocab_size:
            return logits
        full = []
        for x in logits:
            y = x.new_full((*x.shape[:-1], self.vocab_size), float("-inf"))
            y[..., self.draft_vocab] = x
            full.append(y)
        return full

    def load_state(self, weights) -> set[str]:
        """(name, tensor) pairs, as vLLM's loader yields them -> the names loaded; unknown names raise."""
        params = dict(self.named_parameters()) | {"draft_vocab": self.draft_vocab}
        loaded = set()
        for name, w in weights:
            if name not in params:
                raise ValueError(f"draft weights hold {name!r}, which these heads do not have: re-export with "
                                 "`medusa-heads export --format vllm`")
            p = params[name]
            if tuple(p.shape) != tuple(w.shape):
                raise ValueError(f"draft weight {name} has shape {tuple(w.shape)}, the config implies {tuple(p.shape)}")
            with torch.no_grad():
                p.copy_(w.to(p.dtype))
            loaded.add(name)
        self.loaded()
        return loaded
