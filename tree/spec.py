"""TreeSpec: a token tree as the paths of child ranks, validated on construction."""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Sequence

RankPath = tuple[int, ...]  # child ranks from the root: (0, 1) = the top token, then its second child


@dataclass(frozen=True)
class TreeSpec:
    """A draft tree: path (r1, ..., rd) is the node reached by taking head 1's rank-r1 token,
    then head 2's rank-r2 token, and so on (the format of Medusa's `medusa_choices`).
    The root (the target's own next token) is implicit."""

    paths: tuple[RankPath, ...]  # sorted by (depth, ranks): parents always precede children

    def __post_init__(self) -> None:
        if len(self.paths) == 0:
            raise ValueError("tree spec is empty: give at least one path such as [0]")
        seen: set[RankPath] = set()
        for path in self.paths:
            if not isinstance(path, tuple) or len(path) == 0:
                raise ValueError(f"tree path {list(path)!r} is empty or not a sequence of ranks")
            if any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in path):
                raise ValueError(f"tree path {list(path)} has a rank that is not a non-negative integer")
            if path in seen:
                raise ValueError(f"tree path {list(path)} appears twice")
            seen.add(path)
        for path in self.paths:
            if len(path) > 1 and path[:-1] not in seen:
                raise ValueError(f"tree path {list(path)} has no parent: its prefix {list(path[:-1])} is missing")
        object.__setattr__(self, "paths", tuple(sorted(self.paths, key=lambda p: (len(p), p))))

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> "TreeSpec":
        if isinstance(paths, (str, bytes)) or not isinstance(paths, Sequence):
            raise ValueError(f"a tree must be a list of rank paths, got {type(paths).__name__}")
        out = []
        for p in paths:
            if isinstance(p, (str, bytes)) or not isinstance(p, Sequence):
                raise ValueError(f"tree path {p!r} is not a list of ranks")
            out.append(tuple(p))
        return cls(tuple(out))

    @property
    def num_nodes(self) -> int:
        """Drafted nodes, not counting the root."""
        return len(self.paths)

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    @property
    def topk(self) -> int:
        """How many ranks of each head the tree reads."""
        return 1 + max(max(p) for p in self.paths)

    def check_heads(self, num_heads: int) -> None:
        """Raise if the tree is deeper than the heads that feed it."""
        for path in self.paths:
            if len(path) > num_heads:
                raise ValueError(
                    f"tree path {list(path)} has depth {len(path)} but there are only {num_heads} heads"
                )

    def to_list(self) -> list[list[int]]:
        return [list(p) for p in self.paths]


def list_presets() -> list[str]:
    """Names of the tree presets shipped in configs/trees/."""
    folder = resources.files("medusa_heads.configs") / "trees"
    return sorted(f.name[: -len(".json")] for f in folder.iterdir() if f.name.endswith(".json"))


def load_tree(tree: "str | Sequence[Sequence[int]] | TreeSpec") -> TreeSpec:
    """A TreeSpec from a preset name, a list of rank paths, or a TreeSpec."""
    if isinstance(tree, TreeSpec):
        return tree
    if isinstance(tree, str):
        if tree not in list_presets():
            raise ValueError(f"unknown tree preset {tree!r}; presets: {', '.join(list_presets())}")
        text = (resources.files("medusa_heads.configs") / "trees" / f"{tree}.json").read_text()
        return TreeSpec.from_paths(json.loads(text)["paths"])
    return TreeSpec.from_paths(tree)
