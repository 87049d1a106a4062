"""Sequential Medusa heads (heads/medusa_sequential.py): each head continues the previous one along the
path. Teacher-forced and one-node-at-a-time computations agree, the kernels match torch, the
path-aware dynamic tree picks the best paths exactly, decoding stays lossless, training learns a
dependence on the path that independent heads cannot."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import fit_on_pairs, random_ids

from heads.medusa import load_heads, medusa_heads
from heads.medusa_sequential import SequentialMedusaHeads
from heads.medusa_train import MedusaTrainable
from specdec.errors import SpecdecError
from specdec.models import cpu_kernels
from specdec.models.loader import LoadedModel, load_model
from specdec.strategies.base import GenerationParams
from specdec.strategies.greedy import Greedy
from specdec.strategies.medusa import DynamicTree, Medusa, PathHeads, PathMedusaProposer

VOCAB = 512


def _heads(target: LoadedModel, seed: int = 3, **kw: object) -> SequentialMedusaHeads:
    heads = medusa_heads(target, num_heads=kw.pop("num_heads", 3), num_layers=kw.pop("num_layers", 2),  # type: ignore[arg-type]
                         root_input=True, sequential=True, seed=seed, **kw)  # type: ignore[arg-type]
    assert isinstance(heads, SequentialMedusaHeads) and isinstance(heads, PathHeads)
    return heads


@pytest.mark.parametrize("chain_head0", [True, False])
def test_node_by_node_equals_teacher_forcing(tiny_target: LoadedModel, chain_head0: bool) -> None:
    heads = _heads(tiny_target, chain_head0=chain_head0)
    h = torch.randn(64)
    root, path = 7, [11, 12]
    feats = heads.features(h, torch.tensor(root), path=torch.tensor(path))  # (3, dim)
    node, _, _ = heads.tree_start(h, root, 4)
    torch.testing.assert_close(node.features, feats[0], rtol=1e-5, atol=1e-5)
    for k, tok in enumerate(path, start=1):
        node, _, _ = heads.tree_expand(node, tok, 4)
        torch.testing.assert_close(node.features, feats[k], rtol=1e-5, atol=1e-5)
    # the path changes the deeper heads, not head 0
    other = heads.features(h, torch.tensor(root), path=torch.tensor([13, 12]))
    torch.testing.assert_close(other[0], feats[0])
    assert not torch.allclose(other[1], feats[1]) and not torch.allclose(other[2], feats[2])
    # topk follows each head's own top guess: the same as teacher forcing on that chain
    logits = heads(h, torch.tensor(root))  # (3, V): path defaults to the heads' own top-1
    first = int(logits[0].argmax())
    chain = heads(h, torch.tensor(root), path=torch.tensor([first, int(logits[1].argmax())]))
    torch.testing.assert_close(logits, chain)
    assert torch.equal(heads.topk(h, 4, root=root), logits.topk(4, dim=-1).indices)


def test_teacher_features_read_the_sequence(tiny_target: LoadedModel) -> None:
    heads = _heads(tiny_target, num_heads=3)
    ids = torch.tensor([[5, 6, 7, 8, 9, -1]])  # -1: padding
    hidden = torch.randn(1, 6, 64)
    x = heads.teacher_features(hidden, ids)  # (1, 6, 3, dim)
    want = heads.features(hidden[0, 1], torch.tensor(7), path=torch.tensor([8, 9]))  # position 1: root 7, path 8, 9
    torch.testing.assert_close(x[0, 1], want)


@pytest.mark.parametrize("chain_head0", [True, False])
def test_sequential_heads_on_the_cpu_kernels_match_torch(tiny_target: LoadedModel, chain_head0: bool) -> None:
    if not cpu_kernels.available():
        pytest.skip("CPU kernels unavailable")
    heads = _heads(tiny_target, seed=4, chain_head0=chain_head0)
    h = torch.randn(64)
    want_start = heads.tree_start(h, 7, 5)
    want_next = heads.tree_expand(want_start[0], 21, 5)
    heads.use_cpu_kernels("int8", "int8")
    heads.tree_start(h, 7, 5)  # runs on the int8 copies; packing again below must switch kernels with them
    heads.use_cpu_kernels()  # fp32 projection: the same ranking as torch
    assert heads.head_panels is not None
    got_start = heads.tree_start(h, 7, 5)
    got_next = heads.tree_expand(got_start[0], 21, 5)
    for got, want in ((got_start, want_start), (got_next, want_next)):
        np.testing.assert_allclose(got[0].features.numpy(), want[0].features.numpy(), rtol=1e-5, atol=1e-5)
        assert torch.equal(got[1], want[1])
        torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-4)


def test_path_tree_is_the_best_paths(tiny_target: LoadedModel) -> None:
    """The lazy best-first tree holds exactly the `nodes` most probable paths of an exhaustive search."""
    heads = _heads(tiny_target, seed=5, num_heads=3)
    width, nodes = 3, 7
    h, root = torch.randn(64), 9
    calls = 0
    real_expand = heads.tree_expand

    def counting(parent: object, token: int, k: int) -> tuple[object, torch.Tensor, torch.Tensor]:
        nonlocal calls
        calls += 1
        return real_expand(parent, token, k)  # type: ignore[arg-type]

    # every path of ranks up to depth 3, scored by the heads run along it
    start, ids, logp = heads.tree_start(h, root, width)
    scored: dict[tuple[int, ...], tuple[list[int], float]] = {}
    frontier = [((), start, [], 0.0, ids, logp)]
    while frontier:
        path, node, toks, score, c_ids, c_logp = frontier.pop()
        for r in range(width):
            p, tok, s = path + (r,), int(c_ids[r]), score + float(c_logp[r])
            scored[p] = (toks + [tok], s)
            if len(p) < 3:
                child, g_ids, g_logp = heads.tree_expand(node, tok, width)
                frontier.append((p, child, toks + [tok], s, g_ids, g_logp))
    best = sorted(scored.values(), key=lambda v: -v[1])[:nodes]

    heads.tree_expand = counting  # type: ignore[method-assign]
    proposer = PathMedusaProposer(heads, DynamicTree(nodes=nodes, width=width), room=lambda: 100)
    proposer.hidden = h
    state = type("S", (), {"ids": [1, root], "output_len": 0,
                           "params": GenerationParams(64)})()
    proposal = proposer.propose(state)  # type: ignore[arg-type]
    assert proposal is not None
    # rebuild each node's token path from the parents
    got = []
    for i in range(len(proposal.tokens)):
        toks, j = [], i + 1
        while j:
            toks.append(int(proposal.tokens[j - 1]))
            j = proposal.parents[j - 1]
        got.append(toks[::-1])
    assert sorted(got) == sorted(toks for toks, _ in best)
    assert calls <= nodes - 1  # only the expansions the search needed


@pytest.mark.parametrize("copy_tokens", [0, 6])
@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("tree", ["dynamic", "chain", [(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (0, 1)]])
def test_sequential_medusa_matches_greedy(tiny_target: LoadedModel, tree: object, kernels: bool,
                                          copy_tokens: int) -> None:
    heads = _heads(tiny_target, seed=6, num_heads=4, num_layers=1)
    target = tiny_target
    if kernels:  # as the real model runs: the target's fused passes (attention on the K/V panels, compaction
        # included) and the heads' int8 copies, all on the CPU kernels
        if not cpu_kernels.available():
            pytest.skip("CPU kernels unavailable")
        target = load_model("tiny-llama", "builtin:tiny-llama", matmul="numba")  # the same weights
        assert target.model.fused is not None
        heads.use_cpu_kernels("int8", "int8")
        assert heads.head_panels is not None
    want = {}
    for seed in (71, 72):
        # the second prompt repeats itself, so the copy branch (copy_tokens > 0) has something to copy
        prompt = random_ids(12, VOCAB, seed=seed) if seed == 71 else random_ids(5, VOCAB, seed=seed) * 3
        want[seed] = Greedy(target, "greedy", max_len=256).generate(prompt, GenerationParams(40), 0).output_ids
        medusa = Medusa(target, max_len=256, heads=heads, tree=tree, copy_tokens=copy_tokens)  # type: ignore[arg-type]
        assert medusa.generate(prompt, GenerationParams(40), 0).output_ids == want[seed]


def test_sequential_heads_save_load_and_config(tiny_target: LoadedModel, tmp_path: Path) -> None:
    heads = _heads(tiny_target, seed=7, head_vocab=64)
    heads.save(tmp_path / "m")
    loaded = load_heads(tiny_target, tmp_path / "m")
    assert isinstance(loaded, SequentialMedusaHeads) and loaded.cfg == heads.cfg
    h = torch.randn(3, 64)
    roots, path = torch.tensor([9, 10, 11]), torch.tensor([[1, 2], [3, 4], [5, 6]])
    torch.testing.assert_close(loaded(h, roots, path), heads(h, roots, path), rtol=0, atol=0)
    with pytest.raises(SpecdecError, match="root_input=true"):
        medusa_heads(tiny_target, num_heads=2, sequential=True)


@pytest.mark.parametrize("sequential", [False, True])
def test_training_learns_from_the_path(tiny_target: LoadedModel, sequential: bool) -> None:
    trainable = MedusaTrainable(num_heads=2, num_layers=1, head_vocab=None, root_input=True, sequential=sequential)
    _, metrics = fit_on_pairs(trainable, tiny_target)
    # pair_batch: head 1 (guessing t + 3) can beat chance only by reading the path's token t + 2. Half of
    # its targets are fixed by that token, the rest are random (1 in 8)
    if sequential:
        assert metrics["top1_1"] > 0.4
    else:
        assert metrics["top1_1"] < 0.3


def test_sequential_trees_cost_few_head_calls(tiny_target: LoadedModel) -> None:
    """A whole generation never asks the heads for more than `nodes` calls a step."""
    heads = _heads(tiny_target, seed=8, num_heads=4, num_layers=1)
    starts = expands = 0
    real_start, real_expand = heads.tree_start, heads.tree_expand

    def start(*a: object) -> object:
        nonlocal starts
        starts += 1
        return real_start(*a)  # type: ignore[arg-type]

    def expand(*a: object) -> object:
        nonlocal expands
        expands += 1
        return real_expand(*a)  # type: ignore[arg-type]

    heads.tree_start, heads.tree_expand = start, expand  # type: ignore[method-assign, assignment]
    prompt = random_ids(10, VOCAB, seed=73)
    Medusa(tiny_target, max_len=256, heads=heads, nodes=4).generate(prompt, GenerationParams(30), 0)
    assert starts > 0 and expands <= 3 * starts


def test_fixed_trees_guess_each_branch_after_its_own_token(tiny_target: LoadedModel) -> None:
    heads = _heads(tiny_target, seed=9, num_heads=3)
    medusa = Medusa(tiny_target, max_len=256, heads=heads, tree=[(0,), (1,), (1, 0), (1, 0, 0)])
    proposer = medusa.make_proposer()
    h, root = torch.randn(64), 5
    proposer.hidden = h
    state = type("S", (), {"ids": [1, root], "output_len": 0, "params": GenerationParams(64)})()
    proposal = proposer.propose(state)  # type: ignore[arg-type]
    assert proposal is not None and proposal.parents == [0, 0, 2, 3]
    start, ids, _ = heads.tree_start(h, root, 2)
    second, ids2, _ = heads.tree_expand(start, int(ids[1]), 1)
    _, ids3, _ = heads.tree_expand(second, int(ids2[0]), 1)
    assert proposal.tokens.tolist() == [int(ids[0]), int(ids[1]), int(ids2[0]), int(ids3[0])]
