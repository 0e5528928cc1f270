"""The target's own phrasebook: what followed each n-gram most often in the answers the target wrote itself (the
distilled data), as a drafting source beside prompt lookup (REST's datastore, kept to one continuation per n-gram).

Pure tensor code, no model. An n-gram (t_1 .. t_n) is one int64 key, sum_i (t_i + 1) * base^(n - i) with base =
vocab + 1: keys of different lengths fall in disjoint ranges, so one sorted array holds every length and one
search finds them all. `medusa-heads calibrate --parts ngrams` builds it from the distilled answers, measures its
acceptance on held-out ones, and stores it beside the heads (`ngrams.safetensors`)."""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable

import torch

INT64_MAX = 2**63 - 1


def max_order(vocab_size: int) -> int:
    """The longest n-gram whose key fits an int64 for this vocabulary (4 for 49,152 tokens, 3 for 128K)."""
    return int(math.log(INT64_MAX) // math.log(vocab_size + 1))


@dataclass(frozen=True)
class NgramStore:
    """Sorted n-gram keys (M,), and for each the token that followed it most often (M,) with that token's share of
    what followed (M,): the store's confidence, which its calibrated acceptance (tree.adaptive.Acceptance) reads."""

    keys: torch.Tensor  # (M,) int64, increasing
    tokens: torch.Tensor  # (M,) int64
    confidence: torch.Tensor  # (M,) float32 in (0, 1]
    vocab_size: int
    min_n: int  # shortest n-gram stored; a chain backs off from max_n down to it
    max_n: int

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n <= max_order(self.vocab_size):
            raise ValueError(f"n-gram store needs 1 <= min_n <= max_n <= {max_order(self.vocab_size)} for a vocabulary "
                             f"of {self.vocab_size}, got {self.min_n}..{self.max_n}")
        m = self.keys.shape[0]
        if self.keys.dim() != 1 or self.tokens.shape != (m,) or self.confidence.shape != (m,):
            raise ValueError(f"n-gram store needs keys, tokens and confidence of one shape (M,), got "
                             f"{tuple(self.keys.shape)}, {tuple(self.tokens.shape)}, {tuple(self.confidence.shape)}")
        if m > 1 and not bool((self.keys[1:] > self.keys[:-1]).all()):
            raise ValueError("n-gram store keys must be strictly increasing")
        if m and (int(self.tokens.min()) < 0 or int(self.tokens.max()) >= self.vocab_size):
            raise ValueError(f"n-gram store tokens must lie in [0, {self.vocab_size})")

    def __len__(self) -> int:
        return self.keys.shape[0]

    @property
    def base(self) -> int:
        return self.vocab_size + 1

    @cached_property
    def _index(self) -> tuple[list[int], list[int], list[float]]:
        """The store as Python lists, made once: a chain asks a few dozen keys per step, and bisect over a list
        answers each in a microsecond, where a tensor search costs tens."""
        return self.keys.tolist(), self.tokens.tolist(), self.confidence.tolist()

    def find(self, ngram: list[int]) -> int:
        """The store's row for this n-gram, or -1."""
        keys = self._index[0]
        key = _key(ngram, self.base)
        i = bisect.bisect_left(keys, key)
        return i if i < len(keys) and keys[i] == key else -1

    def chain(self, context: list[int], length: int) -> tuple[list[int], list[float], list[int]]:
        """Up to `length` tokens, each the most frequent follower of the longest stored n-gram (max_n down to
        min_n) that ends the context so far, drafted tokens included; each one's confidence, and the length of the
        n-gram that found it. Stops where no suffix is stored."""
        _, tokens, confidence = self._index
        ctx = list(context[-self.max_n:])
        out, conf, orders = [], [], []
        for _ in range(length):
            row, n = -1, 0
            for n in range(min(self.max_n, len(ctx)), self.min_n - 1, -1):
                if (row := self.find(ctx[-n:])) >= 0:
                    break
            if row < 0:
                break
            out.append(tokens[row])
            conf.append(confidence[row])
            orders.append(n)
            ctx = (ctx + out[-1:])[-self.max_n:]
        return out, conf, orders

    @classmethod
    def build(cls, sequences: Iterable[tuple[torch.Tensor, list[tuple[int, int]]]], vocab_size: int, min_n: int = 2,
              max_n: int = 4, min_count: int = 2) -> "NgramStore":
        """sequences: (token ids (L,), spans [start, end) of the tokens to learn, e.g. the answers). Every n-gram
        (min_n <= n <= max_n) that ends just before a span token, with the token; an n-gram seen fewer than
        min_count times is left out. Ties between followers go to the lower token id."""
        base = vocab_size + 1
        if max_n > max_order(vocab_size):
            raise ValueError(f"n-grams of {max_n} tokens do not fit an int64 key for a vocabulary of {vocab_size}")
        keys, nexts = [], []
        for ids, spans in sequences:
            ids = ids.to(torch.int64)
            for n in range(min_n, max_n + 1):
                runs = [torch.arange(max(a, n), b) for a, b in spans if max(a, n) < b]
                if not runs:
                    continue
                pos = torch.cat(runs)
                window = ids[pos[:, None] + torch.arange(-n, 0)]  # (P, n): the n tokens before each span token
                keys.append(_keys(window, base))
                nexts.append(ids[pos])
        if not keys:
            raise ValueError("no n-grams to build a store from (empty or too short sequences)")
        key, nxt = torch.cat(keys), torch.cat(nexts)
        order = torch.argsort(nxt, stable=True)
        order = order[torch.argsort(key[order], stable=True)]  # by key, then by token
        key, nxt = key[order], nxt[order]
        new = torch.ones(len(key), dtype=torch.bool)
        new[1:] = (key[1:] != key[:-1]) | (nxt[1:] != nxt[:-1])
        starts = new.nonzero().flatten()  # one row per distinct (key, token) pair
        counts = torch.diff(starts, append=torch.tensor([len(key)]))
        key, nxt = key[starts], nxt[starts]
        key, seg = torch.unique_consecutive(key, return_inverse=True)
        total = torch.zeros(len(key), dtype=torch.int64).index_add_(0, seg, counts)
        best = torch.zeros(len(key), dtype=torch.int64).scatter_reduce_(0, seg, counts, "amax")
        # the first (lowest-token) pair of each key that reaches its key's best count
        row = torch.arange(len(nxt))
        first = torch.full((len(key),), len(nxt), dtype=torch.int64)
        first.scatter_reduce_(0, seg, torch.where(counts == best[seg], row, len(nxt)), "amin")
        keep = total >= min_count
        return cls(key[keep], nxt[first[keep]], (best[keep].float() / total[keep].float()), vocab_size, min_n, max_n)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"keys": self.keys, "tokens": self.tokens.to(torch.int32), "confidence": self.confidence.half()}

    def metadata(self) -> dict[str, str]:
        return {"vocab_size": str(self.vocab_size), "min_n": str(self.min_n), "max_n": str(self.max_n)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> "NgramStore":
        missing = ({"keys", "tokens", "confidence"} - set(tensors)
                   or {"vocab_size", "min_n", "max_n"} - set(metadata or {}))
        if missing:
            raise ValueError(f"n-gram store lacks {sorted(missing)}")
        return cls(tensors["keys"].to(torch.int64), tensors["tokens"].to(torch.int64), tensors["confidence"].float(),
                   int(metadata["vocab_size"]), int(metadata["min_n"]), int(metadata["max_n"]))


def _key(tokens: list[int], base: int) -> int:
    k = 0
    for t in tokens:
        k = k * base + t + 1
    return k


def _keys(window: torch.Tensor, base: int) -> torch.Tensor:
    """(P, n) token ids -> (P,) int64 keys (see the module's docstring)."""
    k = torch.zeros(window.shape[0], dtype=torch.int64)
    for j in range(window.shape[1]):
        k = k * base + window[:, j] + 1
    return k
