"""Acceptance rules: greedy against a naive reference, invariants of the sampling rules, and
chi-square tests that speculative sampling and deterministic-draft sampling keep the target's law."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare
from torch import Tensor

from specdec.engine.sampling import SamplingParams, check_finite, warp
from specdec.errors import SpecdecError
from specdec.trees import chain_parents
from specdec.verify import Proposal, Verdict, verify, verify_deterministic, verify_greedy, verify_sampled_chain

# a random tree: node i (1-based) picks any earlier node as its parent
trees = st.integers(1, 8).flatmap(lambda n: st.tuples(*[st.integers(0, i) for i in range(n)]).map(list))
chains = st.integers(1, 8).map(chain_parents)


def path_of(parents: list[int], node: int) -> list[int]:
    """Nodes from the root's child down to node (the root itself excluded)."""
    path: list[int] = []
    while node != 0:
        path.append(node)
        node = parents[node - 1]
    return path[::-1]


def greedy_draft(data: st.DataObject, parents: list[int], vocab: int, seed: int) -> tuple[Tensor, Tensor]:
    """Target logits (N+1, V) and draft tokens (N,) that agree with the target's argmax at random."""
    logits = torch.randn(len(parents) + 1, vocab, generator=torch.Generator().manual_seed(seed))
    best = logits.argmax(-1).tolist()
    tokens = []
    for p in parents:
        # two in three agree, and the simplest draw agrees: hypothesis favours simple draws, and
        # all-disagreeing drafts would never exercise a partial acceptance
        if data.draw(st.integers(0, 2)) < 2:
            tokens.append(best[p])
        else:
            tokens.append(data.draw(st.sampled_from([t for t in range(vocab) if t != best[p]])))
    return logits, torch.tensor(tokens)


def check_structure(verdict: Verdict, proposal: Proposal) -> None:
    parents = proposal.parents
    assert len(verdict.tokens) == len(verdict.nodes) + 1
    if verdict.nodes:  # a root-to-node path, tokens as proposed
        assert verdict.nodes == path_of(parents, verdict.nodes[-1])
    assert verdict.tokens[:-1] == [int(proposal.tokens[n - 1]) for n in verdict.nodes]


@settings(max_examples=150)  # pure tensor work, about a millisecond an example
@given(data=st.data(), parents=trees, vocab=st.integers(2, 6), seed=st.integers(0, 10_000))
def test_greedy_accepts_the_longest_agreeing_path(data: st.DataObject, parents: list[int], vocab: int,
                                                   seed: int) -> None:
    logits, tokens = greedy_draft(data, parents, vocab, seed)
    proposal = Proposal(tokens, parents)
    verdict = verify_greedy(proposal, logits)
    assert verify(proposal, logits, SamplingParams(0.0)) == verdict
    check_structure(verdict, proposal)
    best = logits.argmax(-1).tolist()
    agreeing = [path_of(parents, n) for n in range(1, len(parents) + 1)
                if all(tokens[m - 1] == best[parents[m - 1]] for m in path_of(parents, n))]
    longest = max((len(p) for p in agreeing), default=0)
    # the longest agreeing path, first in node order on ties; never longer than the draft
    assert verdict.nodes == min((p for p in agreeing if len(p) == longest), default=[])
    assert len(verdict.nodes) <= max(len(path_of(parents, n)) for n in range(1, len(parents) + 1))
    last = verdict.nodes[-1] if verdict.nodes else 0
    assert verdict.tokens[-1] == best[last]


@settings(max_examples=100)
@given(data=st.data(), parents=chains, vocab=st.integers(2, 6), seed=st.integers(0, 10_000))
def test_greedy_chain_keeps_the_agreeing_prefix(data: st.DataObject, parents: list[int], vocab: int,
                                                seed: int) -> None:
    logits, tokens = greedy_draft(data, parents, vocab, seed)
    best = logits.argmax(-1).tolist()
    k = 0
    while k < len(tokens) and tokens[k] == best[k]:
        k += 1
    verdict = verify_greedy(Proposal(tokens, parents), logits)
    assert verdict.nodes == list(range(1, k + 1))
    assert verdict.tokens == tokens[:k].tolist() + [best[k]]


def test_unverified_nodes_are_never_accepted() -> None:
    logits = torch.zeros(3, 4)
    logits[:, 1] = 1.0
    verdict = verify_greedy(Proposal(torch.tensor([1, 1]), [0, -1]), logits)
    assert verdict.nodes == [1] and verdict.tokens == [1, 1]


params_st = st.builds(SamplingParams, temperature=st.floats(0.3, 2.0), top_p=st.floats(0.3, 1.0))


@given(n=st.integers(1, 6), vocab=st.integers(2, 8), params=params_st, seed=st.integers(0, 10_000),
       same=st.booleans())
def test_sampled_chain_invariants(n: int, vocab: int, params: SamplingParams, seed: int, same: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n + 1, vocab, generator=gen) * 2
    p = warp(logits, params)
    q = p[:n].clone() if same else warp(torch.randn(n, vocab, generator=gen) * 2, params)
    tokens = torch.multinomial(q, 1, generator=gen)[:, 0]
    proposal = Proposal(tokens, chain_parents(n), probs=q)
    verdict = verify_sampled_chain(proposal, logits, params, gen)
    check_structure(verdict, proposal)
    k = len(verdict.nodes)
    assert verdict.nodes == list(range(1, k + 1))
    y = verdict.tokens[-1]
    if same:  # q == p: acceptance probability min(1, p/q) is exactly 1
        assert k == n
    if k < n:  # the correction comes from the residual max(0, p - q)
        assert p[k, y] > q[k, y]
    else:
        assert p[n, y] > 0
    # a token the target cannot produce (cut by top-p) is never accepted
    assert all(p[i, int(tokens[i])] > 0 for i in range(k))


@given(parents=trees, vocab=st.integers(2, 8), params=params_st, seed=st.integers(0, 10_000))
def test_deterministic_invariants(parents: list[int], vocab: int, params: SamplingParams, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(parents) + 1, vocab, generator=gen) * 2
    tokens = torch.randint(0, vocab, (len(parents),), generator=gen)
    proposal = Proposal(tokens, parents)
    verdict = verify(proposal, logits, params, gen)
    check_structure(verdict, proposal)
    p = warp(logits, params)
    path = [0, *verdict.nodes]
    for parent, child in zip(path, path[1:]):
        assert p[parent, int(tokens[child - 1])] > 0  # zero-probability drafts are never accepted
    last = path[-1]
    y = verdict.tokens[-1]
    assert p[last, y] > 0
    # the final token is none of the rejected children: their mass went to the residual
    assert y not in {int(tokens[c - 1]) for c in range(1, len(parents) + 1) if parents[c - 1] == last}


# --- chi-square: the first committed token follows the warped target distribution ------------------

V = 6
N_SAMPLES = 2000
PARAMS = SamplingParams(temperature=0.8, top_p=0.95)
LOGITS = torch.tensor([[2.0, 1.2, 0.6, 0.1, -0.4, -2.5],
                       [-0.3, 1.5, 0.2, 0.9, -1.0, 0.4],
                       [0.5, 0.5, 0.5, 0.5, 0.5, 0.5]])
P = warp(LOGITS, PARAMS)  # (3, V) the warped target rows


def assert_follows(samples: list[int], probs: Tensor, min_p: float = 1e-3) -> None:
    """Chi-square goodness of fit on probs' support; samples outside the support fail outright."""
    counts = torch.bincount(torch.tensor(samples), minlength=V).double()
    support = probs > 0
    assert counts[~support].sum() == 0, f"sampled tokens the target cannot produce: {counts.tolist()}"
    expected = probs[support].double() * len(samples)
    stat = chisquare(counts[support].numpy(), expected.numpy() * counts.sum().item() / expected.sum().item())
    assert stat.pvalue > min_p, f"counts {counts.tolist()} vs target {probs.tolist()} (p={stat.pvalue:.2g})"


def q_far() -> Tensor:
    return warp(-LOGITS[:2], PARAMS)  # mass where the target has little


def q_close() -> Tensor:
    return 0.85 * P[:2] + 0.15 / V


@pytest.mark.parametrize("q_of", [q_far, q_close], ids=["far", "close"])
def test_speculative_sampling_keeps_the_target_marginal(q_of: object) -> None:
    assert callable(q_of)
    q = q_of()
    gen = torch.Generator().manual_seed(1234)
    drafts = torch.multinomial(q, N_SAMPLES, replacement=True, generator=gen).T  # (S, 2)
    first, second, accepted = [], [], 0
    for tokens in drafts:
        verdict = verify_sampled_chain(Proposal(tokens, [0, 1], probs=q), LOGITS, PARAMS, gen)
        first.append(verdict.tokens[0])
        if verdict.nodes:  # the first draft was accepted, so the second token is p's row 1's
            second.append(verdict.tokens[1])
            accepted += 1
    assert_follows(first, P[0])
    assert_follows(second, P[1])
    # acceptance of the first draft is sum_x min(p, q) = 1 - TV(p, q), within 4 sigma
    rate = torch.minimum(P[0], q[0]).sum().item()
    assert abs(accepted / N_SAMPLES - rate) < 4 * (rate * (1 - rate) / N_SAMPLES) ** 0.5
    # power: the draft tokens themselves do not follow p, so this test would catch a rule that kept them
    if q_of is q_far:
        with pytest.raises(AssertionError):
            assert_follows(drafts[:, 0].tolist(), P[0])


@pytest.mark.parametrize("draft", [[4], [1, 0], [3, 3]], ids=lambda d: f"tokens{d}")
def test_deterministic_drafts_keep_the_target_marginal(draft: list[int]) -> None:
    parents = [0] * len(draft)  # one candidate, or siblings tried in order
    proposal = Proposal(torch.tensor(draft), parents)
    gen = torch.Generator().manual_seed(99)
    first = [verify_deterministic(proposal, LOGITS, PARAMS, gen).tokens[0] for _ in range(N_SAMPLES)]
    assert_follows(first, P[0])


def test_deterministic_chain_keeps_the_second_token_marginal() -> None:
    # after the first draft is accepted, the second position is again drawn from p's next row
    proposal = Proposal(torch.tensor([0, 3]), [0, 1])
    gen = torch.Generator().manual_seed(7)
    second = []
    for _ in range(N_SAMPLES):
        verdict = verify_deterministic(proposal, LOGITS, PARAMS, gen)
        if verdict.nodes:
            second.append(verdict.tokens[1])
    assert len(second) > N_SAMPLES * P[0, 0] * 0.9
    assert_follows(second, P[1])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_check_finite_flags_any_bad_logit(bad: float) -> None:
    logits = torch.randn(4, 300) * 30
    check_finite(logits)  # large but finite logits pass
    for row, col in ((0, 0), (3, 299), (2, 150)):
        broken = logits.clone()
        broken[row, col] = bad
        with pytest.raises(SpecdecError, match="NaN or inf"):
            check_finite(broken)
    both = logits.clone()
    both[1, 3], both[1, 4] = float("inf"), float("-inf")  # opposite infinities in one row still fail
    with pytest.raises(SpecdecError, match="NaN or inf"):
        check_finite(both)
