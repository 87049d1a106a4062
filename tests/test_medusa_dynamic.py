"""strategy.tree=dynamic (Medusa's default): a tree built every step from the heads' probabilities."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from helpers import random_ids, spy_compactions
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import Tensor

from heads.medusa import medusa_heads
from specdec.cli_checks import CONFIG_DIR
from specdec.errors import SpecdecError
from specdec.models import cpu_kernels
from specdec.models.loader import LoadedModel
from specdec.strategies.base import DecodeState, GenerationParams
from specdec.strategies.copy_branch import CopyBranch
from specdec.strategies.greedy import Greedy
from specdec.strategies.medusa import DynamicMedusaProposer, DynamicTree, Medusa

VOCAB = 512
PROMPTS = [random_ids(9 + 4 * i, VOCAB, seed=60 + i) for i in range(3)]


class FixedHeads:
    """Heads whose guesses and log-probabilities are given: row d for head d, ranks in order."""

    def __init__(self, logp: list[list[float]]) -> None:
        self.logp = torch.tensor(logp)
        self.num_heads = len(logp)

    def topk_logprobs(self, hidden: Tensor, k: int, depth: int | None = None,
                      root: int | None = None) -> tuple[Tensor, Tensor]:
        d = self.num_heads if depth is None else depth
        ids = 100 * torch.arange(d)[:, None] + torch.arange(k)[None]  # token 100*d + rank: easy to read back
        return ids, self.logp[:d, :k]


def _state(max_new_tokens: int = 64, output_len: int = 1) -> DecodeState:
    return DecodeState(ids=[1] * (3 + output_len), prompt_len=3, params=GenerationParams(max_new_tokens),
                       generator=None)


def _paths(proposal_tokens: list[int], parents: list[int]) -> list[tuple[int, ...]]:
    """Node -> its path of ranks, read back from FixedHeads' token ids."""
    paths: list[tuple[int, ...]] = []
    for tok, p in zip(proposal_tokens, parents):
        paths.append((paths[p - 1] if p else ()) + (tok % 100,))
        assert tok // 100 == len(paths[-1]) - 1  # the token came from the head of its depth
    return paths


def _score(logp: list[list[float]], path: tuple[int, ...]) -> float:
    return sum(logp[d][r] for d, r in enumerate(path))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [1, 3, 7, 12])
def test_tree_is_the_best_paths_by_joint_probability(seed: int, budget: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    depth, width = 3, 4
    logp = torch.randn(depth, width, generator=gen).mul(2).log_softmax(-1).sort(-1, descending=True).values.tolist()
    proposer = DynamicMedusaProposer(FixedHeads(logp), DynamicTree(budget, width), lambda: 100)
    proposer.hidden = torch.zeros(4)
    proposal = proposer.propose(_state())
    assert proposal is not None
    parents = proposal.parents
    assert all(p < i for i, p in enumerate(parents, start=1))  # parents come first: any prefix is a tree
    got = _paths(proposal.tokens.tolist(), parents)
    every = [p for n in range(1, depth + 1) for p in itertools.product(range(width), repeat=n)]
    best = sorted(every, key=lambda p: -_score(logp, p))[:budget]
    assert len(got) == budget == len(set(got))
    assert sorted(_score(logp, p) for p in got) == pytest.approx(sorted(_score(logp, p) for p in best))


def test_sure_heads_buy_depth_unsure_heads_buy_siblings() -> None:
    sure = [[math.log(0.95), math.log(0.03), math.log(0.02)]] * 4
    flat = [[math.log(0.3), math.log(0.25), math.log(0.2)]] * 4
    for logp, want in ((sure, [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]), (flat, [(0,), (1,), (2,), (0, 0)])):
        proposer = DynamicMedusaProposer(FixedHeads(logp), DynamicTree(4, 3), lambda: 100)
        proposer.hidden = torch.zeros(4)
        proposal = proposer.propose(_state())
        assert proposal is not None and _paths(proposal.tokens.tolist(), proposal.parents) == want


def test_min_prob_leaves_out_unlikely_paths_and_limits_hold() -> None:
    logp = [[math.log(0.5), math.log(0.2)], [math.log(0.5), math.log(0.1)]]
    make = lambda nodes, min_prob, room=100: DynamicMedusaProposer(  # noqa: E731
        FixedHeads(logp), DynamicTree(nodes, 2, min_prob), lambda: room)
    proposer = make(6, 0.22)
    proposer.hidden = torch.zeros(4)
    proposal = proposer.propose(_state())
    assert proposal is not None and _paths(proposal.tokens.tolist(), proposal.parents) == [(0,), (0, 0)]
    proposer = make(6, 0.9)
    proposer.hidden = torch.zeros(4)
    assert proposer.propose(_state()) is None  # nothing likely enough: a plain one-token step
    proposer = make(6, 0.0, room=2)
    proposer.hidden = torch.zeros(4)
    assert len(proposer.propose(_state()).tokens) == 2  # type: ignore[union-attr]
    proposer = make(6, 0.0)
    proposer.hidden = torch.zeros(4)
    one_left = proposer.propose(_state(max_new_tokens=10, output_len=8))  # one more token can be kept
    assert one_left is not None and all(p == 0 for p in one_left.parents)


@pytest.mark.parametrize("head_vocab", [None, 100])
def test_topk_logprobs_are_the_heads_log_softmax(tiny_target: LoadedModel, head_vocab: int | None) -> None:
    heads = medusa_heads(tiny_target, num_heads=3, num_layers=2, head_vocab=head_vocab, seed=2)
    h = torch.randn(64, generator=torch.Generator().manual_seed(0))
    want = heads(h)[:2].float().log_softmax(-1).topk(5, dim=-1).values  # (2, 5)
    for kernels in (False, True):
        if kernels:
            if not cpu_kernels.available():
                continue
            heads.use_cpu_kernels()
        ids, logp = heads.topk_logprobs(h, 5, depth=2)
        assert torch.equal(ids, heads.topk(h, 5, depth=2))
        torch.testing.assert_close(logp, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("nodes,min_prob", [(1, 0.0), (5, 0.0), (12, 0.0), (8, 0.02)])
def test_dynamic_trees_reproduce_greedy(tiny_target: LoadedModel, nodes: int, min_prob: float) -> None:
    medusa = Medusa(tiny_target, max_len=256, heads=medusa_heads(tiny_target, num_heads=4, seed=5),
                    tree="dynamic", nodes=nodes, min_prob=min_prob)
    greedy = Greedy(tiny_target, "greedy", max_len=256)
    for prompt in PROMPTS:
        want = greedy.generate(prompt, GenerationParams(40), 0).output_ids
        res = medusa.generate(prompt, GenerationParams(40), 0)
        assert res.output_ids == want
        assert res.accept_lengths is not None and sum(res.accept_lengths) == len(res.output_ids)


def test_medusa_config_builds_a_dynamic_tree_and_bad_settings_are_refused(tiny_target: LoadedModel) -> None:
    cfg = OmegaConf.load(CONFIG_DIR / "strategy" / "medusa.yaml")
    assert cfg.tree == "tuned" and cfg.copy_tokens == 0  # Medusa-1 as the paper: a fixed tree, no copy branch
    cfg.heads.path, cfg.tree, cfg.copy_tokens = None, "dynamic", 8  # as hydra_copy builds its tree
    strategy = instantiate(cfg)(target=tiny_target, max_len=128, prefill_chunk=32)
    assert isinstance(strategy, Medusa) and strategy.tree == DynamicTree(cfg.nodes, cfg.width, cfg.min_prob)
    proposer = strategy.make_proposer()
    assert isinstance(proposer, CopyBranch) and isinstance(proposer.inner, DynamicMedusaProposer)
    for bad in ({"nodes": 0}, {"width": 0}, {"min_prob": 1.0}, {"min_prob": -0.1}, {"size": "big"}):
        with pytest.raises(SpecdecError, match="tree=dynamic needs"):
            instantiate(OmegaConf.merge(cfg, bad))(target=tiny_target, max_len=128, prefill_chunk=32)


class OracleHeads:
    """Heads that often know the target's continuation: at rank 0 or 1 with a made-up confidence."""

    def __init__(self, reference: list[int], seed: int) -> None:
        self.reference, self.num_heads = reference, 4
        self.gen = torch.Generator().manual_seed(seed)
        self.root = 0  # index in `reference` of the token the heads read

    def topk_logprobs(self, hidden: Tensor, k: int, depth: int | None = None,
                      root: int | None = None) -> tuple[Tensor, Tensor]:
        d = self.num_heads if depth is None else depth
        ids = torch.randint(3, VOCAB, (d, k), generator=self.gen)
        for h in range(d):
            i, u = self.root + 1 + h, float(torch.rand((), generator=self.gen))
            rank = 0 if u < 0.6 else 1 if u < 0.85 else None
            if i < len(self.reference) and rank is not None and rank < k:
                ids[h, rank] = self.reference[i]
        logp = torch.rand(d, k, generator=self.gen).sort(-1, descending=True).values.log()  # (d, k)
        return ids, logp


class OracleProposer(DynamicMedusaProposer):
    def propose(self, state: DecodeState):  # type: ignore[no-untyped-def]
        self.heads.root = state.output_len - 1  # type: ignore[attr-defined]
        return super().propose(state)


def test_oracle_heads_accept_long_paths_through_dynamic_trees_and_stay_lossless(tiny_target: LoadedModel) -> None:
    medusa = Medusa(tiny_target, max_len=256, heads=medusa_heads(tiny_target, num_heads=4), tree="dynamic", nodes=6)
    compactions = spy_compactions(medusa)
    greedy = Greedy(tiny_target, "greedy", max_len=256)
    longest = 0
    room = lambda: medusa.engine.max_len - medusa.engine.length - 1  # noqa: E731
    for i, prompt in enumerate(PROMPTS):
        want = greedy.generate(prompt, GenerationParams(56), 0).output_ids
        medusa.make_proposer = lambda w=want, s=i: OracleProposer(  # type: ignore[method-assign]
            OracleHeads(w, s), DynamicTree(6, 4), room)
        res = medusa.generate(prompt, GenerationParams(48), 0)
        assert res.output_ids == want[:48]
        assert res.accept_lengths is not None and sum(res.accept_lengths) == 48
        longest = max(longest, max(res.accept_lengths))
    assert longest >= 4  # paths three or more nodes deep were accepted in one pass
    assert any(keep != list(range(len(keep))) for keep in compactions)  # a kept path sat behind a sibling


def test_cost_sizing_keeps_the_prefix_with_most_tokens_per_pass_time() -> None:
    logp = [[math.log(0.8), math.log(0.1)], [math.log(0.5), math.log(0.05)]]  # paths: 0.8, 0.4, 0.1, ...
    costs = [0.0, 1.0, 1.02, 1.05, 1.6]  # a third node makes the pass much dearer
    proposer = DynamicMedusaProposer(FixedHeads(logp), DynamicTree(3, 2, size="cost"), lambda: 100, costs)
    proposer.hidden = torch.zeros(4)
    proposal = proposer.propose(_state())
    # expected tokens (the root's included) over the pass cost, for 1, 2 and 3 nodes: 2 nodes win here
    rates = [(1 + 0.8) / 1.02, (1 + 0.8 + 0.4) / 1.05, (1 + 0.8 + 0.4 + 0.1) / 1.6]
    assert rates.index(max(rates)) == 1
    assert proposal is not None and len(proposal.tokens) == 2
    unsure = [[math.log(0.01), math.log(0.005)], [math.log(0.01), math.log(0.005)]]
    proposer = DynamicMedusaProposer(FixedHeads(unsure), DynamicTree(3, 2, size="cost"), lambda: 100,
                                     [0.0, 1.0, 1.2, 1.3, 1.4])
    proposer.hidden = torch.zeros(4)
    assert proposer.propose(_state()) is None  # 1.01 tokens for 1.2 passes: a plain step is better


def test_cost_sized_trees_measure_costs_and_reproduce_greedy(tiny_target: LoadedModel) -> None:
    medusa = Medusa(tiny_target, max_len=256, heads=medusa_heads(tiny_target, num_heads=4, seed=5),
                    tree="dynamic", nodes=4, size="cost")
    assert medusa.costs is not None and len(medusa.costs) == 6 and medusa.costs == sorted(medusa.costs)
    want = Greedy(tiny_target, "greedy", max_len=256).generate(PROMPTS[0], GenerationParams(30), 0).output_ids
    assert medusa.generate(PROMPTS[0], GenerationParams(30), 0).output_ids == want
