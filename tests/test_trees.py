"""Token trees: masks and depths, one tree forward against decoding each path alone, path compaction."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_cache_matches_fresh, chain_forward, random_ids
from hypothesis import given
from hypothesis import strategies as st

from specdec.engine.engine import StaticEngine
from specdec.models.loader import LoadedModel
from specdec.trees import chain_parents, children, paths_to_parents, tree_depth, tree_mask

VOCAB = 512
# node:     1  2  3  4  5  6  7  8
PARENTS = [0, 0, 1, 1, 2, 4, 0, 7]


def path_to(parents: list[int], node: int) -> list[int]:
    """Nodes from the root (0) down to node, both included."""
    path = [node]
    while path[-1] != 0:
        path.append(parents[path[-1] - 1])
    return path[::-1]


random_parents = st.integers(1, 9).flatmap(
    lambda n: st.tuples(*[st.integers(0, i) for i in range(n)]).map(list))


@given(random_parents)
def test_mask_depth_children_follow_the_parent_list(parents: list[int]) -> None:
    mask, depth, kids = tree_mask(parents), tree_depth(parents), children(parents)
    n = len(parents) + 1
    assert mask.shape == (n, n) and mask.dtype == torch.bool
    for i in range(n):
        ancestors = set(path_to(parents, i))
        assert {j for j in range(n) if mask[i, j]} == ancestors
        assert depth[i] == len(ancestors) - 1
        assert kids[i] == [c for c in range(1, n) if parents[c - 1] == i]


def test_chain_is_a_lower_triangle() -> None:
    parents = chain_parents(4)
    assert torch.equal(tree_mask(parents), torch.ones(5, 5, dtype=torch.bool).tril())
    assert tree_depth(parents).tolist() == [0, 1, 2, 3, 4]


def test_paths_to_parents_builds_every_prefix() -> None:
    choices = [(0, 0, 1), (1,), (0, 1), (0,)]
    parents, keys = paths_to_parents(choices)
    assert keys == [(0,), (1,), (0, 0), (0, 1), (0, 0, 1)]
    assert parents == [0, 0, 1, 1, 3]
    for node, key in enumerate(keys, start=1):
        parent = parents[node - 1]
        assert (keys[parent - 1] if parent else ()) == key[:-1]


def tree_logits_vs_paths(model: object, prompt: list[int], parents: list[int], seed: int) -> None:
    nodes = random_ids(len(parents) + 1, VOCAB, seed)  # node 0 is the root
    engine = StaticEngine(model, 64)
    engine.prefill(prompt)
    out = engine.forward(torch.tensor(nodes), tree_depth(parents), tree_mask(parents))
    assert out.logits.shape == (len(nodes), VOCAB)
    for i in range(len(nodes)):
        _, ref = chain_forward(model, prompt + [nodes[j] for j in path_to(parents, i)])
        torch.testing.assert_close(out.logits[i], ref[-1], atol=1e-5, rtol=1e-4)


def test_tree_forward_equals_each_path_decoded_alone(tiny_target: LoadedModel) -> None:
    tree_logits_vs_paths(tiny_target.model, random_ids(7, VOCAB, seed=0), PARENTS, seed=1)


@given(parents=random_parents, seed=st.integers(0, 1000))
def test_random_trees_equal_paths(tiny_target: LoadedModel, parents: list[int], seed: int) -> None:
    tree_logits_vs_paths(tiny_target.model, random_ids(3, VOCAB, seed=seed + 1), parents, seed)


@pytest.mark.parametrize("leaf", [3, 5, 6, 8, 2])
def test_compacting_a_path_equals_fresh(tiny_target: LoadedModel, leaf: int) -> None:
    prompt = random_ids(6, VOCAB, seed=2)
    nodes = random_ids(len(PARENTS) + 1, VOCAB, seed=3)
    engine = StaticEngine(tiny_target.model, 64)
    engine.prefill(prompt)
    base = engine.length
    engine.forward(torch.tensor(nodes), tree_depth(PARENTS), tree_mask(PARENTS))
    path = path_to(PARENTS, leaf)
    engine.compact(base, [base + n for n in path])
    assert_cache_matches_fresh(engine, prompt + [nodes[n] for n in path])
    # the next step's tree sees only the compacted path
    out = engine.forward(torch.tensor(nodes[:3]), tree_depth([0, 0]), tree_mask([0, 0]))
    _, ref = chain_forward(tiny_target.model, prompt + [nodes[n] for n in path] + [nodes[0], nodes[2]])
    torch.testing.assert_close(out.logits[2], ref[-1], atol=1e-5, rtol=1e-4)
