"""Medusa at generation.batch_size > 1: each sequence's tokens are its batch-of-one tokens, the heads run
once for every slot (batched top-k equal to per-row top-k), and the tree's size follows the batch's costs."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import pytest
import torch

from heads.medusa import medusa_heads
from specdec.errors import SpecdecError
from specdec.models import cpu_kernels
from specdec.models.loader import LoadedModel
from specdec.strategies.base import GenerationParams, TurnResult
from specdec.strategies.batched import Job
from specdec.strategies.batched_heads import BatchedHeads, TreeCosts, node_priors
from specdec.strategies.medusa import Medusa

PATHS = ["torch", pytest.param("numba", marks=pytest.mark.skipif(not cpu_kernels.available(), reason="needs numba"))]
TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)]


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(4, 12))] * rng.randrange(1, 4) for _ in range(n)]


def batched(strategy: Medusa, ps: list[list[int]], params: GenerationParams, batch: int,
            size: int | None) -> tuple[list[list[int]], list[TurnResult]]:
    """Outputs of `ps` decoded `batch` at a time; `size`: the nodes every round verifies (None: chosen)."""
    outs: dict[int, TurnResult] = {}

    def job(i: int, p: list[int]) -> Job:
        return Job(1, lambda t: p, lambda t: 0, lambda t, ids, res: outs.__setitem__(i, res))

    decoder = strategy.batch_decoder(batch, params)
    assert isinstance(decoder.proposer, BatchedHeads)
    if size is not None:  # a fixed size, so that trees are surely verified (and mostly rejected)
        decoder.proposer.size = lambda: size  # type: ignore[method-assign]
    decoder.run([job(i, p) for i, p in enumerate(ps)])
    results = [outs[i] for i in range(len(ps))]
    for r in results:
        assert r.accept_lengths is not None and sum(r.accept_lengths) == len(r.output_ids)
        assert len(r.accept_lengths) == (r.decode_steps or 0) + 1
    return [r.output_ids for r in results], results


@pytest.mark.parametrize("matmul", PATHS)
def test_each_sequence_decodes_its_batch_of_one_tokens(load_tiny: Callable[..., LoadedModel], matmul: str) -> None:
    target = load_tiny("llama", matmul=matmul)
    # untrained heads (copies of the target's head): some guesses right on a tiny model's repetitive text
    medusa = Medusa(target, max_len=256, heads=medusa_heads(target, num_heads=4), tree=TREE)
    ps = prompts(6)
    params = GenerationParams(max_new_tokens=24)
    alone = [medusa.generate(p, params, 0).output_ids for p in ps]
    # an EOS token from the middle of one answer: that sequence (at least) ends early, its slot is refilled
    params = dataclasses.replace(params, eos_ids=(alone[2][10],))
    alone = [medusa.generate(p, params, 0).output_ids for p in ps]
    assert len({len(a) for a in alone}) > 1
    for size in (3, len(TREE)):
        outs, results = batched(medusa, ps, params, batch=4, size=size)
        assert outs == alone
        assert sum(r.proposed for r in results) > 0 and sum(r.accepted for r in results) > 0


@pytest.mark.parametrize("matmul", PATHS)
def test_trees_are_trimmed_to_each_slots_cache(load_tiny: Callable[..., LoadedModel], matmul: str) -> None:
    target = load_tiny("llama", matmul=matmul)
    medusa = Medusa(target, max_len=40, heads=medusa_heads(target, num_heads=4, seed=3), tree=TREE)
    ps = [prompts(1, seed=s)[0][:20] for s in range(3)]
    ps = [p + [7] * (20 - len(p)) for p in ps]  # 20 tokens each: 19 new fill a 40-slot cache to the last slot
    params = GenerationParams(max_new_tokens=19)
    alone = [medusa.generate(p, params, 0).output_ids for p in ps]
    assert batched(medusa, ps, params, batch=2, size=len(TREE))[0] == alone


@pytest.mark.parametrize("matmul", PATHS)
@pytest.mark.parametrize("kind", ["shared", "own", "root"])
def test_batched_topk_equals_per_row_topk(load_tiny: Callable[..., LoadedModel], matmul: str, kind: str) -> None:
    target = load_tiny("llama", matmul=matmul)
    heads = medusa_heads(target, num_heads=4, num_layers=2, seed=4, projection="own" if kind == "own" else "shared",
                         root_input=kind == "root")
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    roots = [3, 9, 3, 41, 7]
    ids = heads.topk(hidden, 6, 3, root=roots)  # (5, 3, 6)
    ranked, logp = heads.topk_logprobs(hidden, 6, 3, root=roots)
    assert ids.shape == (5, 3, 6) and torch.equal(ranked, ids)
    for i in range(5):
        assert torch.equal(ids[i], heads.topk(hidden[i], 6, 3, root=roots[i]))
        one_ids, one_logp = heads.topk_logprobs(hidden[i], 6, 3, root=roots[i])
        assert torch.equal(one_ids, ids[i])
        torch.testing.assert_close(one_logp, logp[i])


def test_sequential_heads_take_batches_too(tiny_target: LoadedModel) -> None:
    heads = medusa_heads(tiny_target, num_heads=3, num_layers=1, seed=2, root_input=True, sequential=True)
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    ids = heads.topk(hidden, 4, root=[5, 6, 7])
    assert ids.shape == (3, 3, 4)
    for i in range(3):
        assert torch.equal(ids[i], heads.topk(hidden[i], 4, root=5 + i))


def _proposer(verify: list[float], heads: float, priors: list[float], probe_every: int = 16) -> BatchedHeads:
    return BatchedHeads(None, TREE[:len(priors)], 256, TreeCosts(verify, heads), priors, probe_every=probe_every)


def test_nodes_are_listed_likeliest_first_parents_before_children() -> None:
    p = _proposer([1.0] * 6, 0.0, [0.8, 0.3, 0.1, 0.6])  # nodes (0,), (1,), (2,), (0, 0)
    assert p.priors == [0.8, 0.6, 0.3, 0.1] and p.parents == [0, 1, 0, 0]  # (0,), (0, 0), (1,), (2,)
    assert (p.head_of, p.rank_of) == ([0, 1, 0, 0], [0, 0, 1, 2])
    assert p.up_to == [0, 1, 4] and p.depth_of == [0, 1, 2, 2, 2]
    child_first = _proposer([1.0] * 6, 0.0, [0.1, 0.3, 0.2, 0.9])  # a child never goes before its parent
    assert child_first.parents == [0, 0, 0, 3]  # (1,), (2,), (0,), then (0, 0)


def test_size_follows_the_costs_and_the_learnt_rates() -> None:
    priors = [0.8, 0.3, 0.1, 0.6]  # listed as (0,) 0.8, (0, 0) 0.6, (1,) 0.3, (2,) 0.1
    assert _proposer([1.0] * 6, 0.0, priors).size() == 4  # every node pays on a flat curve
    assert _proposer([1.0, 1.0, 2.0, 3.0, 4.0, 5.0], 0.0, priors).size() == 0  # a token more costs a whole pass
    p = _proposer([1.0, 1.0, 1.3, 1.6, 1.9, 2.2], 0.05, priors)
    assert p.size() == 2  # 2.4 / 1.65 beats 1.8 / 1.35 and 2.7 / 1.95
    for _ in range(200):  # the rank-1 guess (node 3) turns out always right, the others never
        p.verified[0] = 3
        p.commit(0, None, _verdict([3]), _out())  # type: ignore[arg-type]
    assert p.rates[2] > 0.95 and max(p.rates[:2]) < 0.05 and p.size() == 3


def test_probes_one_slot_in_turn_while_no_tree_pays() -> None:
    p = _proposer([1.0, 1.0, 2.0, 3.0, 4.0, 5.0], 0.0, [0.5, 0.1], probe_every=4)
    picked = [p._sizes({0: 2, 1: 2, 2: 1}) for _ in range(12)]
    assert [s for s in picked if s] == [{1: 2}, {2: 1}, {0: 2}]


def test_priors_from_the_tuned_tree_file(tmp_path) -> None:
    f = tmp_path / "tree.yaml"
    f.write_text("rank_accuracy:\n- [0.5, 0.2]\n- [0.4, 0.1]\nchoices:\n- [0]\n- [1]\n- [0, 0]\n")
    paths = [(0,), (1,), (0, 0)]
    assert node_priors(paths, str(f)) == pytest.approx([0.5, 0.2, 0.2])
    assert node_priors(paths, "default") == pytest.approx([0.5, 0.1, 0.25])


def test_trees_that_are_not_fixed_cannot_batch_yet(tiny_target: LoadedModel) -> None:
    heads = medusa_heads(tiny_target, num_heads=4)
    for kw in ({"tree": "dynamic"}, {"tree": "default", "copy_tokens": 3}):
        with pytest.raises(SpecdecError, match="strategy.tree=tuned strategy.copy_tokens=0"):
            Medusa(tiny_target, max_len=128, heads=heads, **kw).batch_decoder(2, GenerationParams(8))
    seq = medusa_heads(tiny_target, num_heads=3, root_input=True, sequential=True)
    with pytest.raises(SpecdecError, match="strategy hydra cannot decode in batches yet; run it with generation"):
        Medusa(tiny_target, "hydra", max_len=128, heads=seq, tree="dynamic").batch_decoder(2, GenerationParams(8))


def _verdict(nodes: list[int]):  # noqa: ANN202
    from specdec.verify import Verdict

    return Verdict(nodes, [0] * (len(nodes) + 1))


def _out():  # noqa: ANN202
    from specdec.engine.engine import ForwardOut

    return ForwardOut(torch.zeros(5, 8), torch.zeros(5, 4))
