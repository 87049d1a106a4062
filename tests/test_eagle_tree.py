"""EAGLE-2's dynamic draft tree (specdec/strategies/eagle_tree.py): lossless at temperature 0, exact above
it, the drafter's tree passes equal to drafting each path alone, trees well formed and sized."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_draws_follow, assert_kv_matches_fresh, save_random_eagle, speculative_rounds
from test_eagle import OracleNet

from heads.eagle import load_eagle
from specdec.engine.sampling import SamplingParams, warp
from specdec.errors import SpecdecError
from specdec.models.loader import LoadedModel
from specdec.strategies.base import DecodeState, GenerationParams
from specdec.strategies.eagle import EagleStrategy
from specdec.strategies.eagle_tree import Eagle2, EagleTreeProposer, RunCosts
from specdec.strategies.greedy import Greedy
from specdec.strategies.schedules import FixedLength
from specdec.trees import children

TEXTS = ["Summarize: the quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return"]


def prompt_ids(target: LoadedModel, text: str) -> list[int]:
    return target.chat_ids([{"role": "user", "content": text}])


@pytest.fixture(scope="module")
def drafter(tiny_target: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random drafter, sharpened so that it drafts with some confidence, saved as a trained one is."""
    return save_random_eagle(tiny_target, tmp_path_factory.mktemp("eagle2"))


@pytest.mark.parametrize("kw", [{"depth": 3, "topk": 3, "nodes": 6}, {"depth": 4, "topk": 2, "nodes": 10},
                                {"depth": 3, "topk": 3, "nodes": 8, "size": "cost"},
                                {"depth": 4, "topk": 3, "nodes": 4, "size": "cost", "grow": "useful"},
                                {"depth": 4, "topk": 3, "nodes": 6, "size": "cost", "estimate": "observed"},
                                {"depth": 4, "topk": 3, "nodes": 6, "size": "cost", "curve": "run"},
                                {"depth": 6, "topk": 10, "nodes": 60}],  # EAGLE-2's size (experiment=paper_trees)
                         ids=["3x3", "4x2", "cost", "cost-useful", "cost-observed", "cost-run", "paper60"])
def test_eagle2_reproduces_greedy(tiny_target: LoadedModel, drafter: Path, kw: dict[str, Any]) -> None:
    strategy = Eagle2(tiny_target, "eagle2", load_eagle(str(drafter)), max_len=512, prefill_chunk=64, **kw)
    if strategy.costs is not None:  # measured on ~1 ms passes, noise could price every node out: a known curve
        strategy.costs = [0.0] + [1.0 + 0.01 * n for n in range(kw["nodes"] + 1)]
    if strategy.run_costs is not None:
        strategy.run_costs.startup = strategy.costs
    greedy = Greedy(tiny_target, "greedy", 512, 64)
    for text in TEXTS:
        prompt = prompt_ids(tiny_target, text)
        res = strategy.generate(prompt, GenerationParams(40), 0)
        assert res.output_ids == greedy.generate(prompt, GenerationParams(40), 0).output_ids
        assert res.proposed > 0
        if "size" not in kw:  # size=fixed: the rounds verify (nearly) all `nodes`, fewer only near the end
            assert res.proposed_nodes >= 0.9 * kw["nodes"] * res.decode_steps
    if strategy.observed is not None:  # the run's acceptance moved the estimate off the prior
        assert strategy.observed.accepted > 20 and strategy.observed.predicted > 20
        assert strategy.observed.scale() != 1.0
    if strategy.run_costs is not None:  # every round's target pass was timed, across both turns
        assert strategy.run_costs.rounds > 5 and strategy.run_costs.means[1] > 0


def test_run_costs_fit_the_runs_passes_once_sizes_vary() -> None:
    startup = [0.0, 1.0, 1.3, 1.6]
    costs = RunCosts(startup, least=10)
    for _ in range(40):  # one size only: the slope is not identifiable, the start-up curve stays
        costs.observe(3, 0.02)
    assert costs.slope is None and costs.cost(2) == 1.3 and costs.cost(9) == 1.6
    costs = RunCosts(startup, least=10)
    for r in range(9):
        n = 2 + r % 5
        costs.observe(n, 0.010 + 0.0005 * (n - 1))
    assert costs.slope is None  # fewer rounds than `least`
    for r in range(9, 200):
        n = 2 + r % 5
        costs.observe(n, 0.010 + 0.0005 * (n - 1))  # t = a + b (n - 1): b / a = 0.05
    assert costs.slope == pytest.approx(0.05, rel=1e-6)
    assert costs.cost(1) == pytest.approx(1.0) and costs.cost(9) == pytest.approx(1.4)


def test_trees_are_well_formed_and_the_caches_stay_right(tiny_target: LoadedModel, drafter: Path) -> None:
    strategy = Eagle2(tiny_target, "eagle2", load_eagle(str(drafter)), depth=4, topk=3, nodes=7, max_len=512)
    wide = 0
    for state, proposal, _, proposer in speculative_rounds(strategy, prompt_ids(tiny_target, TEXTS[0]), 8,
                                                           GenerationParams(200)):
        n = len(proposal.parents)
        assert 1 <= n <= 7 and all(0 <= p <= i for i, p in enumerate(proposal.parents))  # parents come first
        depth = [0]
        for p in proposal.parents:
            depth.append(depth[p] + 1)
        assert max(depth) <= 4 and all(len(kids) <= 3 for kids in children(proposal.parents))
        wide += not proposal.is_chain
        assert_kv_matches_fresh(strategy.engine, state.ids[:-1])
        assert isinstance(proposer, EagleTreeProposer)
        assert proposer.cache.lengths[0] == proposer.fed == len(state.ids) - 1 - len(proposer.pending)  # type: ignore[arg-type]
    assert wide > 0  # real trees, not chains


def test_growing_only_useful_depths_verifies_the_same_trees_with_fewer_passes(tiny_target: LoadedModel,
                                                                              drafter: Path) -> None:
    """size=fixed: a depth whose surest node is not among the `nodes` best cannot add a verified node (no
    child outscores its parent), so grow=useful skips its pass and every round verifies the same tree."""
    passes = {}
    results = {}
    for grow in ("all", "useful"):
        strategy = Eagle2(tiny_target, "eagle2", load_eagle(str(drafter)), depth=4, topk=2, nodes=5, max_len=512,
                          grow=grow)
        runs = [strategy.generate(prompt_ids(tiny_target, text), GenerationParams(40), 0) for text in TEXTS]
        assert strategy.last_proposer is not None
        results[grow] = [(r.output_ids, r.accept_lengths, r.proposed) for r in runs]
        passes[grow] = strategy.last_proposer.passes  # type: ignore[attr-defined]
    assert results["useful"] == results["all"]
    assert 0 < passes["useful"] < passes["all"]


def test_a_one_wide_tree_is_the_chain(tiny_target: LoadedModel, drafter: Path) -> None:
    """topk=1: every depth expands its only node, so the tree is EAGLE's chain of `depth` tokens."""
    tree = Eagle2(tiny_target, "eagle2", load_eagle(str(drafter)), depth=3, topk=1, nodes=3, max_len=512)
    chain = EagleStrategy(tiny_target, "eagle", load_eagle(str(drafter)), FixedLength(3), 512)
    for text in TEXTS:
        prompt = prompt_ids(tiny_target, text)
        a, b = tree.generate(prompt, GenerationParams(30), 0), chain.generate(prompt, GenerationParams(30), 0)
        assert a.output_ids == b.output_ids and a.accept_lengths == b.accept_lengths and a.proposed == b.proposed


def test_each_expanded_node_gets_the_logits_of_drafting_its_path_alone(tiny_target: LoadedModel, drafter: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A tree pass must let a node see the real prefix and its own ancestors only: its logits then equal
    a fresh chain run of the drafter over the prefix and the node's path."""
    strategy = Eagle2(tiny_target, "eagle2", load_eagle(str(drafter)), depth=3, topk=3, nodes=12, max_len=512)
    seen: list[tuple[list[int], torch.Tensor]] = []
    expand = EagleTreeProposer._expand

    def spy(self: EagleTreeProposer, frontier: list[Any], tree: list[Any], start: int, prefix: int) -> torch.Tensor:
        logits = expand(self, frontier, tree, start, prefix)
        for i, node in enumerate(frontier):
            path, at = [], node
            while True:
                path.insert(0, at.token)
                if at.parent < 0:
                    break
                at = tree[at.parent]
            seen.append((path, logits[i].clone()))
        return logits

    monkeypatch.setattr(EagleTreeProposer, "_expand", spy)
    prompt = prompt_ids(tiny_target, TEXTS[1])
    out = strategy.engine.prefill(prompt)
    state = DecodeState([*prompt, int(out.logits[-1].argmax())], len(prompt), GenerationParams(50), None)
    proposer = strategy.make_proposer()
    proposer.start(state, out)
    assert proposer.propose(state) is not None and len(seen) >= 4
    net = strategy.net
    for path, logits in seen:
        cache = net.new_cache(128)
        ids = torch.tensor(state.ids[1:])[None]  # pairs (h_j, x_{j+1}) for j = 0 .. L-2 on real features
        L = len(state.ids)
        got, guess = net(ids, out.hidden[None], torch.arange(L - 1)[None], cache, cache.attention_mask(None, L - 1))
        feature = guess[0, -1]
        for j, tok in enumerate(path):
            got, guess = net(torch.tensor([[tok]]), feature[None, None], torch.tensor([[L - 1 + j]]), cache, None)
            feature = guess[0, -1]
        torch.testing.assert_close(got[0, -1], logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("temperature", [0.3, 0.7])
@pytest.mark.parametrize("kind", ["oracle", "random"])
def test_sampling_preserves_the_target_distribution(tiny_target: LoadedModel, drafter: Path, kind: str,
                                                    temperature: float) -> None:
    """The tree's nodes are fixed choices verified by recursive rejection over siblings: the first token
    after the root follows the target's distribution, whether the candidates are the target's own top
    tokens (one level: the oracle drafts from the target's logits) or a random drafter's two levels."""
    sp = SamplingParams(temperature=temperature, top_p=0.9)
    prompt = prompt_ids(tiny_target, "Hello")
    net = OracleNet(tiny_target, prompt[0]) if kind == "oracle" else load_eagle(str(drafter))
    depth = 1 if kind == "oracle" else 2  # the oracle answers chains only: one level of siblings
    strategy = Eagle2(tiny_target, "eagle2", net, depth=depth, topk=4, nodes=6, max_len=256)
    base = len(prompt) - 1  # the last prompt token is the root
    out = strategy.engine.prefill(prompt[:-1])
    proposer = strategy.make_proposer()
    counts = torch.zeros(tiny_target.vocab_size)
    accepted = 0
    first_level: list[int] = []
    for seed in range(300):
        state = DecodeState(list(prompt), base, GenerationParams(8, sp), torch.Generator().manual_seed(seed))
        proposer.start(state, out)
        proposal = proposer.propose(state)
        assert proposal is not None and proposal.probs is None and not proposal.is_chain
        first_level = [int(proposal.tokens[i - 1]) for i in children(proposal.parents)[0]]
        verdict, _ = strategy._step(state, proposal)
        counts[verdict.tokens[0]] += 1
        accepted += bool(verdict.nodes)
        strategy.engine.rollback(base)
    p = warp(strategy.engine.prefill(prompt).logits[-1], sp)  # (V,) the target's distribution
    assert_draws_follow(counts, p)
    if kind == "oracle":
        # fixed candidates drawn from the target itself: some sibling is accepted with probability equal
        # to their target mass (alpha at the first level), else the residual is drawn
        alpha = float(p[first_level].sum())
        assert 0 < alpha < 1 and abs(accepted - 300 * alpha) <= 4 * (300 * alpha * (1 - alpha)) ** 0.5 + 1


def test_bad_settings_are_refused(tiny_target: LoadedModel, drafter: Path) -> None:
    for bad in ({"depth": 0}, {"topk": 0}, {"nodes": 0}, {"size": "big"}, {"grow": "some"},
                {"estimate": "guess"}, {"curve": "later"}, {"curve": "run", "size": "fixed"}):
        with pytest.raises(SpecdecError) as err:
            Eagle2(tiny_target, "eagle2", load_eagle(str(drafter)), max_len=128, **bad)  # type: ignore[arg-type]
        assert "\n" not in str(err.value) and "eagle2" in str(err.value)
