"""Token trees: parent lists -> attention masks, depths and root-to-leaf paths.

Node 0 is the root (the newest committed token, not yet in the cache); nodes 1..N are proposals.
`parents[i - 1]` is the parent of node i and is always smaller than i.
"""

from __future__ import annotations

import torch
from torch import Tensor


def chain_parents(n: int) -> list[int]:
    return list(range(n))


def tree_mask(parents: list[int]) -> Tensor:
    """(N+1, N+1) bool: node i sees node j iff j is i or an ancestor of i."""
    n = len(parents) + 1
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents, start=1):
        mask[i] |= mask[p]
    return mask


def tree_depth(parents: list[int]) -> Tensor:
    """(N+1,) distance from the root, used as the position offset of every node."""
    return torch.tensor(depth_list(parents))


def depth_list(parents: list[int]) -> list[int]:
    """tree_depth as a host list (bookkeeping that must not touch tensors)."""
    depth = [0]
    for p in parents:
        depth.append(depth[p] + 1)
    return depth


def children(parents: list[int]) -> list[list[int]]:
    """children[i]: the nodes whose parent is i, in node order (node order = candidate priority)."""
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents, start=1):
        if p >= 0:
            kids[p].append(i)
    return kids


def paths_to_parents(paths: list[tuple[int, ...]]) -> tuple[list[int], list[tuple[int, ...]]]:
    """Medusa-style choices (each a tuple of top-k ranks, one per depth) -> parents, node keys.

    Every prefix of a path becomes one node; the keys say which (depth, rank) each node holds.
    """
    keys: list[tuple[int, ...]] = []
    index: dict[tuple[int, ...], int] = {(): 0}
    for path in sorted({p[:k] for p in paths for k in range(1, len(p) + 1)}, key=lambda p: (len(p), p)):
        index[path] = len(keys) + 1
        keys.append(path)
    return [index[k[:-1]] for k in keys], keys
