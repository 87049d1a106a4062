"""EAGLE at generation.batch_size > 1: every sequence's tokens are its batch-of-one tokens, the drafter
drafts, and its pairs' features stay the target's own (strategies/batched_eagle.py)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import save_random_eagle

from heads.eagle import load_eagle
from specdec.engine.engine import StaticEngine
from specdec.errors import SpecdecError
from specdec.models import cpu_kernels
from specdec.models.loader import LoadedModel
from specdec.strategies.base import GenerationParams, TurnResult
from specdec.strategies.batched import Job
from specdec.strategies.batched_eagle import BatchedEagle
from specdec.strategies.eagle import EagleStrategy
from specdec.strategies.schedules import FixedLength

PATHS = ["torch", pytest.param("numba", marks=pytest.mark.skipif(not cpu_kernels.available(), reason="needs numba"))]
K = 3  # the forced draft length: drafting (and rejection) surely happens


def eagle(target: LoadedModel, folder: Path) -> EagleStrategy:
    """A random drafter for `target`, saved and loaded as a trained one is (sharpened: it drafts confidently)."""
    save_random_eagle(target, folder)
    return EagleStrategy(target, "eagle", load_eagle(str(folder)), FixedLength(K), 512, 64)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(4, 30))] for _ in range(n)]


def checked(proposer: BatchedEagle, target: LoadedModel) -> list[tuple[int, int]]:
    """After every start and commit: the invariant of BatchedEagle, and pending features equal to a fresh
    target pass's. The features a start feeds are the target's too, with no zero rows (a later turn lacks
    none: see BatchedEagle.start and finish). Returns, per start, the first pair it fed (the pairs before
    are kept) and its zero rows."""
    fed_at_start: list[tuple[int, Any]] = []  # (first pair fed, features) of the last start's prefill
    zeros: list[tuple[int, int]] = []

    def check(b: int, state: Any) -> None:
        fed, pending = proposer.fed[b], proposer.pending[b]
        assert fed + len(pending) == len(state.ids) - 1 == proposer.engine.length(b) + len(pending)
        fresh = StaticEngine(target.model, 512).prefill(state.ids[:-1]).hidden  # (L - 1, D)
        torch.testing.assert_close(pending, fresh[fed:], atol=1e-4, rtol=1e-4)
        while fed_at_start:
            first, feats = fed_at_start.pop()
            real = feats.abs().sum(-1) > 0
            zeros.append((first, int((~real).sum())))
            assert zeros[-1][1] == 0  # `finish` keeps the last pass's features: none is missing
            torch.testing.assert_close(feats[real], fresh[first:first + len(feats)][real], atol=1e-4, rtol=1e-4)

    start, commit, prefill = proposer.start, proposer.commit, proposer.engine.prefill
    proposer.engine.prefill = lambda b, ids, first, features: (  # type: ignore[method-assign]
        fed_at_start.append((first, features)), prefill(b, ids, first, features))[1]
    proposer.start = lambda b, state, out, fresh: (start(b, state, out, fresh), check(b, state))[0]  # type: ignore
    proposer.commit = lambda b, state, v, out: (commit(b, state, v, out), check(b, state))[0]  # type: ignore
    return zeros


def drafts(strategy: EagleStrategy, run: Callable[[], Any]) -> dict[tuple[int, ...], list[list[int]]]:
    """What `run` drafted, by the sequence's ids when it drafted (batch-1 proposers or the batched one)."""
    seen: dict[tuple[int, ...], list[int]] = {}
    make, batch_proposer = strategy.make_proposer, strategy.batch_proposer

    def spy(propose: Callable[..., Any], batched: bool) -> Callable[..., Any]:
        def wrapped(states: Any) -> Any:
            out = propose(states)
            pairs = out.items() if batched else [(None, out)]
            for b, p in pairs:
                if p is not None:
                    seen[tuple((states[b] if batched else states).ids)] = p.tokens.tolist()
            return out
        return wrapped

    def make_spied() -> Any:
        proposer = make()
        proposer.propose = spy(proposer.propose, False)  # type: ignore[union-attr]
        return proposer

    def batch_spied(engine: Any) -> Any:
        proposer = batch_proposer(engine)
        proposer.propose = spy(proposer.propose, True)  # type: ignore[method-assign]
        return proposer

    strategy.make_proposer, strategy.batch_proposer = make_spied, batch_spied  # type: ignore[method-assign]
    try:
        run()
    finally:
        del strategy.make_proposer, strategy.batch_proposer
    return seen


def run_batched(strategy: EagleStrategy, jobs: list[Job], params: GenerationParams, batch: int) -> tuple[
        BatchedEagle, list[tuple[int, int]]]:
    decoder = strategy.batch_decoder(batch, params)
    proposer = decoder.proposer
    assert isinstance(proposer, BatchedEagle)
    proposer.length = lambda: K  # type: ignore[method-assign]
    zeros = checked(proposer, strategy.target)
    decoder.run(jobs)
    return proposer, zeros


@pytest.mark.parametrize("matmul", PATHS)
def test_each_sequence_decodes_its_batch_of_one_tokens(load_tiny: Callable[..., LoadedModel], tmp_path: Path,
                                                       matmul: str) -> None:
    target = load_tiny("llama", matmul=matmul)
    strategy = eagle(target, tmp_path)
    ps = prompts(6)
    params = GenerationParams(max_new_tokens=24)
    # an EOS token from the middle of one answer: that sequence (at least) ends early, its slot is refilled
    params = dataclasses.replace(params, eos_ids=(strategy.generate(ps[2], params, 0).output_ids[10],))
    alone = [strategy.generate(p, params, 0) for p in ps]
    assert len({len(a.output_ids) for a in alone}) > 1
    drafts_alone = drafts(strategy, lambda: [strategy.generate(p, params, 0) for p in ps])
    results: dict[int, TurnResult] = {}
    jobs = [Job(1, lambda t, p=p: p, lambda t: 0, lambda t, ids, res, i=i: results.__setitem__(i, res))
            for i, p in enumerate(ps)]
    drafts_batched = drafts(strategy, lambda: run_batched(strategy, jobs, params, batch=4))
    assert [results[i].output_ids for i in range(len(ps))] == [a.output_ids for a in alone]
    assert sum(r.proposed for r in results.values()) > 0
    # the same pairs on the same features at the same positions: every round drafts what it drafted alone
    assert drafts_batched and drafts_batched == drafts_alone


@pytest.mark.parametrize("matmul", PATHS)
def test_later_turns_keep_the_slots_pairs(load_tiny: Callable[..., LoadedModel], tmp_path: Path, matmul: str) -> None:
    target = load_tiny("llama", matmul=matmul)
    strategy = eagle(target, tmp_path)
    strategy.reuse_prefix(True)  # generation.prefix_cache, as the runner sets it
    params = GenerationParams(max_new_tokens=12)
    extra = prompts(9, seed=1)
    convs: dict[int, list[list[int]]] = {i: [] for i in range(3)}  # each conversation's prompts
    outs: dict[tuple[int, int], TurnResult] = {}

    def job(i: int) -> Job:
        def prompt(t: int) -> list[int]:
            before = convs[i][-1] + outs[i, t - 1].output_ids if t else []
            convs[i].append(before + extra[3 * i + t])
            return convs[i][-1]
        return Job(3, prompt, lambda t: 0, lambda t, ids, res: outs.__setitem__((i, t), res))

    proposer, zeros = run_batched(strategy, [job(i) for i in range(3)], params, batch=2)
    for i in range(3):
        for t in range(3):
            assert outs[i, t].output_ids == strategy.generate(convs[i][t], params, 0).output_ids
    assert sum(r.proposed for r in outs.values()) > 0
    # 9 starts, 3 first turns from pair 0 and 6 later ones keeping the pairs they share
    assert len(zeros) == 9 and sum(first > 0 for first, _ in zeros) == 6


def test_sampling_drafts_with_probabilities(load_tiny: Callable[..., LoadedModel], tmp_path: Path) -> None:
    """At temperature > 0 each drafted chain carries q, the drafter's warped distribution, for verification."""
    from specdec.engine.sampling import SamplingParams

    strategy = eagle(load_tiny("llama"), tmp_path)
    params = GenerationParams(max_new_tokens=16, sampling=SamplingParams(temperature=0.8))
    decoder = strategy.batch_decoder(3, params)
    proposer = decoder.proposer
    assert isinstance(proposer, BatchedEagle)
    proposer.length = lambda: K  # type: ignore[method-assign]
    propose, seen = proposer.propose, []

    def spy(states: dict) -> dict:
        out = propose(states)
        seen.extend(p for p in out.values() if p is not None)
        return out

    proposer.propose = spy  # type: ignore[method-assign]
    results: list[TurnResult] = []
    decoder.run([Job(1, lambda t, p=p: p, lambda t, i=i: i, lambda t, ids, res: results.append(res))
                 for i, p in enumerate(prompts(4))])
    assert len(results) == 4 and all(len(r.output_ids) == 16 for r in results)
    assert seen and all(p.probs is not None and p.probs.shape == (len(p.tokens), strategy.target.vocab_size)
                        for p in seen)
    torch.testing.assert_close(seen[0].probs.sum(-1), torch.ones(len(seen[0].tokens)))


def test_a_drafter_that_is_not_saved_cannot_batch(tiny_target: LoadedModel) -> None:
    from test_eagle import OracleNet

    strategy = EagleStrategy(tiny_target, "eagle", OracleNet(tiny_target, 0), FixedLength(2), 128, 64)
    with pytest.raises(SpecdecError, match="batch_size=1"):
        strategy.batch_decoder(2, GenerationParams())
