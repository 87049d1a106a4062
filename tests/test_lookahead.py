"""Lookahead decoding: the n-gram pool and the combined attention mask against naive definitions,
the Jacobi window bookkeeping, the lookahead branch's logits against a plain chain recomputation,
and losslessness against `greedy` on tiny random models."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import chain_forward, check_counters, make_looping_target, prompts
from hydra.utils import instantiate
from omegaconf import OmegaConf

from specdec.cli_checks import CONFIG_DIR
from specdec.engine.engine import ForwardOut, StaticEngine
from specdec.engine.sampling import SamplingParams
from specdec.errors import SpecdecError
from specdec.models.loader import LoadedModel
from specdec.ngram import ContextPool, NGramPool
from specdec.strategies.base import DecodeState, GenerationParams
from specdec.strategies.greedy import Greedy
from specdec.strategies.lookahead import Lookahead, LookaheadProposer, combined_mask
from specdec.verify import Verdict

# --- the pool ------------------------------------------------------------------------------------


def naive_pool(ids: list[int], n: int, head: int, num: int) -> list[tuple[int, ...]]:
    """Distinct tails after `head`, ordered by their latest occurrence, newest first."""
    out: list[tuple[int, ...]] = []
    for i in range(len(ids) - n, -1, -1):
        tail = tuple(ids[i + 1:i + n])
        if ids[i] == head and tail not in out:
            out.append(tail)
    return out[:num]


def grown_from_random_text(pool: NGramPool | ContextPool, n: int, seed: int) -> list[int]:
    """Random text over 4 tokens added to `pool` in chunks, as tokens are committed; returns the text."""
    rng = random.Random(seed)
    ids = [rng.randrange(4) for _ in range(150)]
    nxt = 0
    for end in range(0, len(ids) + 1, rng.randint(1, 6)):
        nxt = pool.add_text(ids[:end], nxt)
    assert pool.add_text(ids, nxt) == len(ids) - n + 1
    return ids


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n,capacity", [(2, 1), (3, 2), (4, 3), (5, 8)])
def test_pool_keeps_the_most_recent_distinct_ngrams(seed: int, n: int, capacity: int) -> None:
    pool = NGramPool(n, capacity)
    ids = grown_from_random_text(pool, n, seed)
    for head in range(5):
        for num in (1, capacity):
            assert pool.get(head, num) == naive_pool(ids, n, head, min(num, capacity))


def naive_context_pool(ids: list[int], n: int, head: int, prev: int, num: int, capacity: int) -> list[tuple[int, ...]]:
    """The `capacity` latest occurrences of `head` (counting a repeated (previous token, tail) once, at its
    latest), newest first; among them the distinct tails preceded by `prev` first, then the rest."""
    occurrences: list[tuple[int, tuple[int, ...]]] = []
    for i in range(len(ids) - n, -1, -1):
        entry = (ids[i - 1] if i else -1, tuple(ids[i + 1:i + n]))
        if ids[i] == head and entry not in occurrences:
            occurrences.append(entry)
    occurrences = occurrences[:capacity]
    out: list[tuple[int, ...]] = []
    for _before, tail in [e for e in occurrences if e[0] == prev] + [e for e in occurrences if e[0] != prev]:
        if tail not in out:
            out.append(tail)
    return out[:num]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n,capacity", [(2, 1), (3, 4), (3, 32), (4, 8)])
def test_context_pool_ranks_tails_after_the_same_two_tokens_first(seed: int, n: int, capacity: int) -> None:
    pool = ContextPool(n, capacity)
    ids = grown_from_random_text(pool, n, seed)
    for head in range(5):
        for prev in (-1, 0, 1, 3):
            for num in (1, 2, 5):
                assert pool.get(head, prev, num) == naive_context_pool(ids, n, head, prev, num, capacity)


def test_context_pool_prefers_the_matching_context_over_recency() -> None:
    pool = ContextPool(3, 8)
    pool.add_text([7, 1, 2, 3, 9, 1, 4, 5, 8, 1, 6, 6])
    assert pool.get(1, 7, 3) == [(2, 3), (6, 6), (4, 5)]  # after (7, 1) came 2 3; then newest first
    assert pool.get(1, 0, 2) == [(6, 6), (4, 5)]


# --- the combined mask ---------------------------------------------------------------------------


def naive_layout(parents: list[int], W: int, rows: int) -> tuple[list[tuple], torch.Tensor, torch.Tensor]:
    """Describe every node, then apply the paper's rules pair by pair."""
    nodes: list[tuple] = [("root",)]
    nodes += [("tree", i + 1) for i in range(len(parents))]
    nodes += [("win", 0, c) for c in range(1, W)] if rows else []
    nodes += [("win", r, c) for r in range(1, rows) for c in range(W)]

    def ancestors(i: int) -> set[int]:
        out = {i}
        while i:
            i = parents[i - 1]
            out.add(i)
        return out

    def sees(a: tuple, b: tuple) -> bool:
        if b == ("root",):
            return True
        if a[0] != b[0]:
            return False  # the two branches never see each other
        if a[0] == "tree":
            return b[1] in ancestors(a[1])
        (_, ra, ca), (_, rb, cb) = a, b
        if rb == 0:  # the heads' chain, up to this column
            return 1 <= cb <= ca
        return cb == ca and rb <= ra  # this column, up to this row

    def depth(a: tuple) -> int:
        if a[0] == "root":
            return 0
        if a[0] == "tree":
            return len(ancestors(a[1])) - 1
        return a[1] + a[2]

    mask = torch.tensor([[sees(a, b) for b in nodes] for a in nodes])
    return nodes, mask, torch.tensor([depth(a) for a in nodes])


@pytest.mark.parametrize("parents", [[], [0], [0, 1, 2], [0, 1, 0, 3, 1, 0]])
@pytest.mark.parametrize("W,rows", [(2, 1), (4, 1), (4, 2), (4, 3), (5, 4), (3, 0)])
def test_combined_mask_matches_definition(parents: list[int], W: int, rows: int) -> None:
    nodes, want_mask, want_depth = naive_layout(parents, W, rows)
    mask, depth = combined_mask(parents, W, rows)
    assert mask.shape == (len(nodes), len(nodes))
    assert torch.equal(mask, want_mask)
    assert torch.equal(depth, want_depth)


def test_lookahead_logits_equal_a_chain_recomputation(tiny_target: LoadedModel) -> None:
    """Each window node's output is what the target predicts after root, heads up to its column and
    its column's rows: the mask and positions implement the intended contexts, not just a shape."""
    prompt = list(range(5, 25))
    W, rows = 3, 3
    window = {(0, c): 100 + c for c in range(1, W)} | {(r, c): 200 + 10 * r + c for r in range(1, rows)
                                                        for c in range(W)}
    tree = ([300, 301, 302], [0, 1, 0])
    nodes, _, _ = naive_layout(tree[1], W, rows)
    tokens = tree[0] + [window[a[1:]] for a in nodes if a[0] == "win"]
    mask, depth = combined_mask(tree[1], W, rows)
    root = 7
    engine = StaticEngine(tiny_target.model, 128)
    engine.prefill(prompt)
    out = engine.forward(torch.tensor([root, *tokens]), depth, mask)
    for i, a in enumerate(nodes):
        if a[0] == "root":
            context = [root]
        elif a[0] == "tree":
            context = [root, *{1: [300], 2: [300, 301], 3: [302]}[a[1]]]
        else:
            _, r, c = a
            context = [root, *[window[(0, j)] for j in range(1, c + 1)], *[window[(k, c)] for k in range(1, r + 1)]]
        _, ref = chain_forward(tiny_target.model, prompt + context, 128)
        torch.testing.assert_close(out.logits[i], ref[-1], atol=1e-4, rtol=1e-4)


# --- the Jacobi window ---------------------------------------------------------------------------


def fake_step(proposer: LookaheadProposer, state: DecodeState, outputs: dict[int, int], vocab: int = 50) -> None:
    """Propose, then commit with logits whose argmax at row i is outputs.get(i, 0)."""
    proposal = proposer.propose(state)
    assert proposal is not None
    logits = torch.zeros(1 + len(proposal.tokens), vocab)
    for i in range(len(logits)):
        logits[i, outputs.get(i, 0)] = 1.0
    state.ids.append(49)
    proposer.commit(state, Verdict([], [49]), ForwardOut(logits, torch.zeros(len(logits), 1)))


def test_window_fills_then_slides_and_pools_its_columns() -> None:
    W, N = 3, 4
    prompt = [1, 2, 3, 4, 5, 6]
    state = DecodeState(prompt + [9], len(prompt), GenerationParams(100), None)
    proposer = LookaheadProposer(W, N, G=8, max_len=100, harvest_output=False)
    proposer.start(state, ForwardOut(torch.zeros(1, 50), torch.zeros(1, 1)))
    assert len(proposer.rows) == 1 and len(proposer.rows[0]) == W - 1 and set(proposer.rows[0]) <= set(prompt)
    heads = [5, 6]
    proposer.rows = [list(heads)]
    assert proposer.pool.get(9, 8) == []  # root 9 is not in the prompt: no verification nodes

    # step 1: only the heads; the root and each head predict the next column's row 1
    fake_step(proposer, state, {0: 10, 1: 11, 2: 12})
    assert proposer.rows == [heads, [10, 11, 12]]
    # step 2: row 1 sits after the heads (offset 1 + W - 1); its outputs become row 2
    fake_step(proposer, state, {3: 20, 4: 21, 5: 22})
    assert proposer.rows == [heads, [10, 11, 12], [20, 21, 22]]
    # step 3: the window is full; row 2's outputs complete one 4-gram per column, then it slides
    fake_step(proposer, state, {6: 30, 7: 31, 8: 32})
    assert proposer.rows == [[11, 12], [20, 21, 22], [30, 31, 32]]
    assert proposer.pool.get(49, 8) == [(10, 20, 30)]  # column 0's head was that step's root
    assert proposer.pool.get(heads[0], 8)[0] == (11, 21, 31)
    assert proposer.pool.get(heads[1], 8)[0] == (12, 22, 32)
    # step 4: the new heads are row 1 without its first column, each still heading its own column;
    # the pool now has (10, 20, 30) after root 49, verified first, so the window starts 3 nodes later
    fake_step(proposer, state, {9: 40, 10: 41, 11: 42})
    assert proposer.rows == [[21, 22], [30, 31, 32], [40, 41, 42]]
    assert proposer.pool.get(49, 8)[0] == (20, 30, 40)
    assert proposer.pool.get(11, 8) == [(21, 31, 41)]
    assert proposer.pool.get(12, 8) == [(22, 32, 42)]


def test_text_ngrams_come_first_and_the_guess_budget_holds() -> None:
    prompt = [5, 1, 2, 3, 6, 1, 4, 4, 5]  # (5, 1) was followed by 2 3, (6, 1) by 4 4
    state = DecodeState(prompt + [1], len(prompt), GenerationParams(100), None)
    proposer = LookaheadProposer(2, 2, G=2, max_len=100, harvest_output=True, text_ngram=3, verify_tokens=3)
    proposer.start(state, ForwardOut(torch.zeros(1, 50), torch.zeros(1, 1)))
    proposer.pool.add(1, [9])  # a window bigram after the root: tried after the text's n-grams
    proposal = proposer.propose(state)
    assert proposal is not None
    guess = [(int(t), p) for t, p in zip(proposal.tokens, proposal.parents) if p >= 0]
    assert guess == [(2, 0), (3, 1), (4, 0)]  # (5, 1) -> 2 3 whole, then the first node of 4 4; no room for 9
    assert len(proposal.tokens) - len(guess) == 1  # the window's one node (W=2, N=2)


# --- decoding ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def looping_target() -> LoadedModel:
    return make_looping_target()






@pytest.mark.parametrize("options", [
    {},
    {"window": 2, "level": 2, "guesses": 1},
    {"window": 5, "level": 3, "guesses": 4, "harvest_output": False},
    {"window": 2, "level": 2, "guesses": 2, "text_ngram": 3, "verify_tokens": 2},
    {"window": 3, "level": 3, "guesses": 3, "text_ngram": 5, "verify_tokens": 1},
])
@pytest.mark.parametrize("name", ["repeating", "pattern", "no_repeats", "one_token", "chat"])
def test_reproduces_greedy(tiny_target: LoadedModel, options: dict, name: str) -> None:
    ids = prompts(tiny_target)[name]
    params = GenerationParams(40)
    ref = Greedy(tiny_target, "greedy", 256).generate(ids, params, 0)
    res = Lookahead(tiny_target, max_len=256, **options).generate(ids, params, 0)
    assert res.output_ids == ref.output_ids
    check_counters(res, 40)


def test_accepts_ngrams_on_a_repeating_target(looping_target: LoadedModel) -> None:
    params = GenerationParams(60)
    for ids in prompts(looping_target).values():
        ref = Greedy(looping_target, "greedy", 256).generate(ids, params, 0)
        res = Lookahead(looping_target, max_len=256).generate(ids, params, 0)
        assert res.output_ids == ref.output_ids
        check_counters(res, 60)
        tau = sum(res.accept_lengths) / len(res.accept_lengths)
        assert tau > 1.5, (ref.output_ids, res.accept_lengths)


def test_window_alone_finds_ngrams(looping_target: LoadedModel) -> None:
    """Without prompt or output n-grams the pool holds only what the Jacobi window produced."""
    ids = list(range(3, 40))  # nothing in the prompt repeats, so prompt seeding cannot help either
    params = GenerationParams(60)
    ref = Greedy(looping_target, "greedy", 256).generate(ids, params, 0)
    res = Lookahead(looping_target, max_len=256, harvest_output=False).generate(ids, params, 0)
    assert res.output_ids == ref.output_ids
    assert res.accepted > 10


def test_fits_a_cache_that_is_just_large_enough(looping_target: LoadedModel) -> None:
    ids = prompts(looping_target)["pattern"]
    params = GenerationParams(40)
    ref = Greedy(looping_target, "greedy", 256).generate(ids, params, 0)
    res = Lookahead(looping_target, max_len=len(ids) + 40).generate(ids, params, 0)
    assert res.output_ids == ref.output_ids
    check_counters(res, 40)


def test_stops_at_eos_and_budget(looping_target: LoadedModel) -> None:
    ids = prompts(looping_target)["pattern"]
    ref = Greedy(looping_target, "greedy", 256).generate(ids, GenerationParams(30), 0)
    eos = ref.output_ids[12]
    first = ref.output_ids.index(eos)
    for max_new in (1, 2, 7, 30):
        res = Lookahead(looping_target, max_len=256).generate(ids, GenerationParams(max_new, eos_ids=(eos,)), 0)
        assert res.output_ids == ref.output_ids[:min(max_new, first + 1)]
        check_counters(res, max_new)


def test_sampling_is_reproducible(tiny_target: LoadedModel) -> None:
    ids = prompts(tiny_target)["repeating"]
    params = GenerationParams(40, SamplingParams(temperature=0.8, top_p=0.95))
    strategy = Lookahead(tiny_target, max_len=256)
    runs = [strategy.generate(ids, params, seed).output_ids for seed in (1, 1, 2)]
    assert runs[0] == runs[1]
    assert len(runs[0]) == 40 and len(runs[2]) == 40
    assert runs[0] != runs[2]


def test_config_builds_the_strategy(tiny_target: LoadedModel) -> None:
    cfg = OmegaConf.load(CONFIG_DIR / "strategy" / "lookahead.yaml")
    assert cfg.name == "lookahead"
    strategy = instantiate(cfg)(target=tiny_target, max_len=128, prefill_chunk=64)
    assert isinstance(strategy, Lookahead) and strategy.name == "lookahead"
    assert (strategy.window, strategy.level, strategy.guesses) == (cfg.window, cfg.level, cfg.guesses)
    assert (strategy.text_ngram, strategy.verify_tokens) == (cfg.text_ngram, cfg.verify_tokens)


@pytest.mark.parametrize("bad", [{"window": 1}, {"level": 1}, {"guesses": 0}, {"text_ngram": 1}, {"verify_tokens": 0}])
def test_bad_parameters_fail_in_one_line(tiny_target: LoadedModel, bad: dict) -> None:
    with pytest.raises(SpecdecError) as err:
        Lookahead(tiny_target, max_len=64, **bad)
    assert "\n" not in str(err.value)
