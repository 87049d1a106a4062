"""The copy branch in Medusa's tree: how it merges, how long it grows, and that decoding stays lossless."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_draws_follow, chain_forward, check_counters, make_looping_target, speculative_rounds
from omegaconf import OmegaConf

from heads.medusa import medusa_heads
from specdec.cli_checks import CONFIG_DIR
from specdec.engine.engine import ForwardOut
from specdec.engine.sampling import SamplingParams, warp
from specdec.errors import SpecdecError
from specdec.models.loader import LoadedModel
from specdec.strategies.base import DecodeState, GenerationParams
from specdec.strategies.copy_branch import CopyBranch
from specdec.strategies.greedy import Greedy
from specdec.strategies.medusa import Medusa
from specdec.verify import Proposal, Verdict

PATTERN = [17, 40, 99, 23] * 6


class FixedTree:
    """An inner proposer that always proposes the same tree."""

    def __init__(self, tokens: list[int], parents: list[int]) -> None:
        self.tokens, self.parents = tokens, parents
        self.commits = 0

    def start(self, state: DecodeState, out: ForwardOut) -> None:
        pass

    def propose(self, state: DecodeState) -> Proposal | None:
        return Proposal(torch.tensor(self.tokens), list(self.parents)) if self.tokens else None

    def commit(self, state: DecodeState, verdict: Verdict, out: ForwardOut) -> None:
        self.commits += 1


def branch(inner: FixedTree, max_tokens: int = 4, room: int = 1000) -> CopyBranch:
    costs = {n: 1.0 for n in range(1, 40)}  # free passes: the copy always grows to its cap
    return CopyBranch(inner, 1, 3, max_tokens, room, costs)


def state_of(ids: list[int], max_new: int = 100) -> DecodeState:
    return DecodeState(list(ids), len(ids) - 1, GenerationParams(max_new), None)


def test_the_copy_shares_the_trees_nodes_and_hangs_after_them() -> None:
    # ids end in 40, 99 -> the earlier 40, 99 was followed by 23, 17, 40, 99
    ids = [17, 40, 99, 23, 17, 40, 99]
    inner = FixedTree([23, 5, 17, 6], [0, 0, 1, 3])  # 23 -> 17 agrees with the copy, then 6 does not
    proposer = branch(inner)
    proposer.start(state_of(ids), None)  # type: ignore[arg-type]
    proposal = proposer.propose(state_of(ids))
    assert proposal is not None
    assert proposal.tokens.tolist() == [23, 5, 17, 6, 40, 99]
    assert proposal.parents == [0, 0, 1, 3, 3, 5]  # the inner tree is untouched; 40 hangs under 17
    assert proposer._nodes == [1, 3, 5, 6]
    # no copy without a match; the inner tree comes back as it was
    fresh = branch(FixedTree([7], [0]))
    alone = fresh.propose(state_of([1, 2, 3, 4]))
    assert alone is not None and alone.tokens.tolist() == [7] and alone.parents == [0]
    # no inner tree: the copy alone is a chain
    lone = branch(FixedTree([], []))
    chain = lone.propose(state_of(ids))
    assert chain is not None and chain.tokens.tolist() == [23, 17, 40, 99] and chain.is_chain


def test_the_copy_keeps_to_the_budget_and_the_cache() -> None:
    ids = [17, 40, 99, 23, 17, 40, 99]
    inner = FixedTree([5, 6], [0, 0])
    near_end = branch(inner, max_tokens=6).propose(state_of(ids, max_new=3))  # output_len 1: 1 token useful
    assert near_end is not None and near_end.tokens.tolist() == [5, 6, 23]
    full = branch(inner, max_tokens=6, room=len(ids) + 2 + 2).propose(state_of(ids))  # 2 slots past the tree
    assert full is not None and full.tokens.tolist() == [5, 6, 23, 17]


def test_the_record_sets_the_copys_length() -> None:
    ids = [17, 40, 99, 23, 17, 40, 99]
    costs = {n: 1.0 + 0.02 * (n - 1) for n in range(1, 40)}  # each token adds 2% to a pass
    proposer = CopyBranch(FixedTree([5], [0]), 1, 3, 6, 1000, costs)
    assert proposer.length(3, 6, 1) == 6  # no record: the optimistic prior tries the whole copy
    proposer.tried[3] = [0] + [100] * 6
    proposer.hit[3] = [0] * 7  # copies after 3-gram matches always failed at once
    assert proposer.length(3, 6, 1) == 0
    proposer.hit[3] = [0, 96, 92, 88, 80, 4, 1]  # kept for 4 tokens, rarely beyond
    assert proposer.length(3, 6, 1) == 4
    assert proposer.length(2, 6, 1) == 6  # each match length keeps its own record
    # what committing records: token i was tested when tokens 1..i - 1 were kept
    run = CopyBranch(FixedTree([5], [0]), 1, 3, 4, 1000, {n: 1.0 for n in range(1, 40)})
    assert run.propose(state_of(ids)) is not None and run._nodes == [2, 3, 4, 5]
    run.commit(state_of(ids), Verdict([2, 3], [23, 17, 8]), None)  # type: ignore[arg-type]
    assert run.tried[3][1:] == [1, 1, 1, 0] and run.hit[3][1:] == [1, 1, 0, 0]
    assert run.inner.commits == 1 and (run.steps, run.committed) == (1, 3)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def looping() -> LoadedModel:
    return make_looping_target()


def test_medusa_with_a_copy_branch_reproduces_greedy(looping: LoadedModel) -> None:
    heads = medusa_heads(looping, num_heads=3, seed=5)
    greedy = Greedy(looping, "greedy", max_len=256)
    plain = Medusa(looping, max_len=256, heads=heads, nodes=4)
    copying = Medusa(looping, max_len=256, heads=heads, nodes=4, copy_tokens=6)
    chat = looping.chat_ids([{"role": "user", "content": "def add(a, b):\n    return a + b\n" * 3}])
    taus = {"plain": 0.0, "copying": 0.0}
    for prompt in (PATTERN, chat, list(range(3, 40))):
        want = greedy.generate(prompt, GenerationParams(60), 0).output_ids
        for name, strategy in (("plain", plain), ("copying", copying)):
            res = strategy.generate(prompt, GenerationParams(60), 0)
            assert res.output_ids == want
            check_counters(res, 60)
            taus[name] += len(res.output_ids) / (res.decode_steps or 1)
    assert taus["copying"] > taus["plain"]  # the looping model's output repeats: the copy pays


def test_copy_nodes_are_kept_and_the_cache_follows(looping: LoadedModel) -> None:
    medusa = Medusa(looping, max_len=256, heads=medusa_heads(looping, num_heads=3, seed=5), nodes=3,
                    copy_tokens=6)
    kept_copy = 0
    for state, proposal, verdict, proposer in speculative_rounds(medusa, PATTERN, 12, GenerationParams(200)):
        assert len(proposal.tokens) <= 3 + 6
        kept_copy += len(set(verdict.nodes) & set(proposer._nodes) - set(range(1, 4)))
        assert medusa.engine.length == len(state.ids) - 1  # the root is the only token not cached
    assert kept_copy > 0  # tokens only the copy proposed were accepted and compacted into place


def test_exact_sampling_with_the_copy_preserves_the_target_distribution(looping: LoadedModel) -> None:
    medusa = Medusa(looping, max_len=128, heads=medusa_heads(looping, num_heads=3, seed=5), nodes=3,
                    acceptance="exact", copy_tokens=4)
    sp = SamplingParams(temperature=0.3, top_p=0.9)
    # the looping model's own output runs on one token, so the copy offers a token the target likes
    run = Greedy(looping, "greedy", max_len=128).generate(PATTERN, GenerationParams(24), 0).output_ids
    prompt, root = PATTERN + run[:20], run[20]
    counts = torch.zeros(looping.vocab_size)
    copied = kept = 0
    for seed in range(300):
        out = medusa.engine.prefill(prompt)
        state = DecodeState([*prompt, root], len(prompt), GenerationParams(8, sp), torch.Generator().manual_seed(seed))
        proposer = medusa.make_proposer()
        assert isinstance(proposer, CopyBranch)
        proposer.start(state, out)
        proposal = proposer.propose(state)
        assert proposal is not None
        copied += len(proposer._nodes) > 0
        verdict, _ = medusa._step(state, proposal)
        kept += proposer._nodes[0] in verdict.nodes
        counts[verdict.tokens[0]] += 1
    assert copied == 300 and 0 < kept < 300, kept  # the copy's node both accepted and rejected
    _, logits = chain_forward(looping.model, [*prompt, root])
    assert_draws_follow(counts, warp(logits[-1], sp), min_bins=3)


def test_typical_acceptance_gets_no_copy(looping: LoadedModel) -> None:
    heads = medusa_heads(looping, num_heads=3, seed=5)
    sampled = GenerationParams(8, SamplingParams(temperature=0.7))
    for acceptance, copies in (("typical", False), ("exact", True)):
        medusa = Medusa(looping, max_len=128, heads=heads, nodes=3, acceptance=acceptance, copy_tokens=4)
        for params, want in ((sampled, copies), (GenerationParams(8), True)):  # greedy always copies
            out = medusa.engine.prefill(PATTERN)
            state = DecodeState([*PATTERN, PATTERN[0]], len(PATTERN), params, torch.Generator().manual_seed(0))
            proposer = medusa.make_proposer()
            proposer.start(state, out)
            proposal = proposer.propose(state)
            assert proposal is not None and bool(proposer._nodes) == want  # type: ignore[attr-defined]


def test_config_and_bad_settings(tiny_target: LoadedModel) -> None:
    copy = OmegaConf.load(CONFIG_DIR / "strategy" / "hydra_copy.yaml")
    assert copy.copy_tokens > 0 and copy.defaults[0] == "hydra"  # hydra_copy is hydra plus the copy
    for plain in ("medusa", "hydra"):  # off by default: the names mean the papers' methods
        assert OmegaConf.load(CONFIG_DIR / "strategy" / f"{plain}.yaml").get("copy_tokens", 0) == 0
    heads = medusa_heads(tiny_target, num_heads=2)
    assert not isinstance(Medusa(tiny_target, max_len=64, heads=heads).make_proposer(), CopyBranch)
    for bad in ({"copy_tokens": -1}, {"copy_tokens": 2, "ngram_min": 0}, {"copy_tokens": 2, "ngram_max": 0}):
        with pytest.raises(SpecdecError) as err:
            Medusa(tiny_target, max_len=64, heads=heads, **bad)  # type: ignore[arg-type]
        assert "\n" not in str(err.value) and "copy_tokens" in str(err.value)
