"""TreeBuffers: every tensor the decode loop needs for one TreeSpec, built once."""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, fields

import torch

from medusa_heads.tree.spec import TreeSpec


@dataclass(frozen=True)
class TreeBuffers:
    """Node 0 is the root (the target's own token); nodes 1..N are the spec's paths in order.
    T = N + 1 tree tokens, D = depth, P = root-to-leaf paths."""

    mask: torch.Tensor  # (T, T) bool: node i attends to node j iff j is i or an ancestor of i
    depth: torch.Tensor  # (T,) long: root 0
    draft_index: torch.Tensor  # (N,) long: (depth - 1) * topk + rank, index into the heads' flat (K * topk) top-k ids
    parent: torch.Tensor  # (T,) long: parent node, -1 for the root
    paths: torch.Tensor  # (P, D + 1) long: node indices root -> leaf, padded with the leaf
    path_len: torch.Tensor  # (P,) long: nodes on each path, root included
    children: tuple[tuple[int, ...], ...]  # children[i]: node indices of i's children
    topk: int  # ranks read from each head
    num_heads: int  # heads the tree reads (= depth)
    # levels[d - 1], for the nodes at depth d, drafted together by head d from their parents (path-conditioned heads):
    # (chains (P, d): root -> parent node indices of each parent with children, nodes (C,), parent_row (C,), rank (C,))
    levels: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], ...] = ()

    @property
    def size(self) -> int:
        """Tree tokens, root included."""
        return self.mask.shape[0]

    def to(self, device: torch.device | str) -> "TreeBuffers":
        def move(value):
            if isinstance(value, torch.Tensor):
                return value.to(device)
            if isinstance(value, tuple) and any(isinstance(t, torch.Tensor) for level in value for t in level):
                return tuple(tuple(t.to(device) for t in level) for level in value)  # levels
            return value

        return TreeBuffers(**{f.name: move(getattr(self, f.name)) for f in fields(self)})


_STRUCTURE = ("mask", "depth", "parent", "paths", "path_len", "children")  # what a parent list decides


def _structure(parent: list[int]) -> dict:
    """Everything about a tree that follows from its parent list (parent[0] = -1 for the root, every node after
    its parent): mask, depth, parent, paths, path_len, children."""
    t = len(parent)
    depth = [0] * t
    children: list[list[int]] = [[] for _ in range(t)]
    for i in range(1, t):
        if not 0 <= parent[i] < i:
            raise ValueError(f"node {i} has parent {parent[i]}; a parent must come before its children")
        depth[i] = depth[parent[i]] + 1
        children[parent[i]].append(i)

    mask = torch.zeros(t, t, dtype=torch.bool)
    chains = []  # chains[i]: root -> i
    for i in range(t):
        chains.append([i] if i == 0 else chains[parent[i]] + [i])
        mask[i, chains[i]] = True

    leaves = [i for i in range(t) if not children[i]]
    width = max(depth) + 1
    paths = torch.tensor([chains[leaf] + [leaf] * (width - len(chains[leaf])) for leaf in leaves], dtype=torch.long)
    return dict(
        mask=mask,
        depth=torch.tensor(depth, dtype=torch.long),
        parent=torch.tensor(parent, dtype=torch.long),
        paths=paths.reshape(len(leaves), width),
        path_len=torch.tensor([len(chains[leaf]) for leaf in leaves], dtype=torch.long),
        children=tuple(tuple(c) for c in children),
    )


def build_buffers(spec: TreeSpec) -> TreeBuffers:
    """The buffers of a validated spec: from_parents' tree, plus what the heads draft it by (draft_index, levels)."""
    nodes = [()] + list(spec.paths)
    index = {path: i for i, path in enumerate(nodes)}
    t, topk = len(nodes), spec.topk
    parent = [-1] + [index[p[:-1]] for p in spec.paths]

    levels = []
    for d in range(1, spec.depth + 1):
        nodes_d = [i for i in range(1, t) if len(nodes[i]) == d]
        parents = sorted({parent[i] for i in nodes_d})
        row = {p: r for r, p in enumerate(parents)}
        chains = torch.tensor([[index[nodes[p][:j]] for j in range(d)] for p in parents], dtype=torch.long)
        levels.append((
            chains.reshape(len(parents), d),
            torch.tensor(nodes_d, dtype=torch.long),
            torch.tensor([row[parent[i]] for i in nodes_d], dtype=torch.long),
            torch.tensor([nodes[i][-1] for i in nodes_d], dtype=torch.long),
        ))

    return dataclasses.replace(
        from_parents(tuple(parent)),
        draft_index=torch.tensor([(len(p) - 1) * topk + p[-1] for p in spec.paths], dtype=torch.long),
        topk=topk,
        levels=tuple(levels),
    )


def with_chain(buffers: TreeBuffers, below: int, length: int) -> TreeBuffers:
    """The same tree plus a chain of `length` nodes hanging below node `below`, appended after the existing
    nodes (whose indices, and so the heads' drafting buffers, stay as they are). A prompt-lookup continuation
    takes these nodes; positions follow the depth as for any node."""
    if not 0 <= below < buffers.size or length < 1:
        raise ValueError(f"a chain of {length} nodes below node {below} does not fit a tree of {buffers.size} nodes")
    t = buffers.size
    grown = from_parents((*buffers.parent.tolist(), below, *range(t, t + length - 1)), buffers.mask.device)
    return dataclasses.replace(buffers, **{f: getattr(grown, f) for f in _STRUCTURE})


def chain(n: int, device: torch.device | str = "cpu") -> TreeBuffers:
    """A chain of n tree tokens: the root and n - 1 nodes, each below the one before."""
    return from_parents(tuple(range(-1, n - 1)), device)


_by_shape: dict[tuple[tuple[int, ...], str], TreeBuffers] = {}
_by_shape_lock = threading.Lock()


def from_parents(parent: tuple[int, ...], device: torch.device | str = "cpu") -> TreeBuffers:
    """The buffers of the tree with this parent list (parent[0] = -1 is the root; each node after its parent): the
    one builder of tree buffers (build_buffers, with_chain, chain and engines.hf.pad_trees call it). Immutable,
    so kept by shape and shared between calls and threads (at most 4,096 shapes; past that, built anew). No heads'
    drafting buffers (build_buffers adds them for a spec's tree): a per-step drafter drafts the tree it chose."""
    key = (parent, str(device))
    buffers = _by_shape.get(key)
    if buffers is None:
        structure = _structure(list(parent))
        buffers = TreeBuffers(**structure, draft_index=torch.zeros(0, dtype=torch.long), topk=0,
                              num_heads=int(structure["depth"].max())).to(device)
        with _by_shape_lock:
            if len(_by_shape) < 4096:
                buffers = _by_shape.setdefault(key, buffers)
    return buffers
