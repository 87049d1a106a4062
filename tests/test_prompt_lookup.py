"""Prompt lookup decoding: the n-gram index and lookup against naive scans, losslessness against
`greedy` on tiny random models, acceptance on a target that repeats itself, and the turn counters."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest
from helpers import check_counters, make_looping_target, prompts
from hydra.utils import instantiate
from omegaconf import OmegaConf

from specdec.cli_checks import CONFIG_DIR
from specdec.engine.sampling import SamplingParams
from specdec.errors import SpecdecError
from specdec.models.loader import LoadedModel
from specdec.ngram import NGramIndex, candidates_to_tree, continuation, lookup
from specdec.strategies.base import GenerationParams
from specdec.strategies.greedy import Greedy
from specdec.strategies.prompt_lookup import PromptLookup, PromptLookupProposer
from specdec.verify import Verdict

# --- naive references --------------------------------------------------------------------------


def naive_positions(ids: list[int], key: tuple[int, ...]) -> list[int]:
    n = len(key)
    return [end for end in range(n, len(ids) + 1) if tuple(ids[end - n:end]) == key]


def naive_continuation(ids: list[int], end: int, k: int) -> list[int]:
    # let the text go on as if it kept repeating from `end`, then read k tokens from there
    seq = list(ids)
    while len(seq) < end + k:
        seq.append(seq[end + len(seq) - len(ids)])
    return seq[end:end + k]


def naive_lookup(ids: list[int], n_min: int, n_max: int, k: int, num: int) -> list[list[int]]:
    found: list[list[int]] = []
    L = len(ids)
    for n in range(n_max, n_min - 1, -1):
        if n >= L:
            continue
        for end in range(L - 1, n - 1, -1):
            if ids[end - n:end] == ids[L - n:]:
                cont = naive_continuation(ids, end, k)
                if cont not in found:
                    found.append(cont)
    return found[:num]


def grow(ids: list[int], seed: int) -> NGramIndex:
    """Index ids in random chunks, the way decoding commits 1..k tokens per step."""
    rng = random.Random(seed)
    index = NGramIndex(1, 4)
    seen = 0
    while seen < len(ids):
        seen = min(len(ids), seen + rng.randint(1, 5))
        index.extend(ids[:seen])
    return index


# --- the index and the lookup --------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_index_positions_match_naive_scan(seed: int) -> None:
    rng = random.Random(seed)
    ids = [rng.randrange(6) for _ in range(200)]  # a small vocabulary: many repeats
    index = grow(ids, seed)
    assert index.length == len(ids)
    for n in range(1, 5):
        keys = {tuple(ids[e - n:e]) for e in range(n, len(ids) + 1)}
        for key in keys:
            assert index.positions(key) == naive_positions(ids, key)
        assert sum(len(v) for v in index.tables[n].values()) == len(ids) - n + 1
    assert index.positions((99, 99)) == []
    assert index.positions((1,) * 7) == []  # longer than any indexed n


def test_continuation_copies_text_then_repeats_with_the_period() -> None:
    ids = [5, 1, 2, 3, 1, 2]
    assert continuation(ids, 2, 3) == [2, 3, 1]  # inside the text
    assert continuation(ids, 4, 5) == [1, 2, 1, 2, 1]  # period 2 past the end
    assert continuation(ids, 5, 3) == [2, 2, 2]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num", [1, 3])
def test_lookup_matches_naive_scan(seed: int, num: int) -> None:
    rng = random.Random(100 + seed)
    ids = [rng.randrange(5) for _ in range(rng.randint(2, 120))]
    index = grow(ids, seed)
    for k in (1, 4, 9):
        got = lookup(ids, index, k, num, max_scan=10**9)
        assert got == naive_lookup(ids, 1, 4, k, num)


def test_lookup_prefers_longest_ngram_then_most_recent() -> None:
    # "7 8 9" last appears followed by 4; the bigram "8 9" most recently by 6; the unigram 9 by 1
    ids = [7, 8, 9, 4, 0, 8, 9, 6, 9, 1, 7, 8, 9]
    index = NGramIndex(1, 3)
    index.extend(ids)
    got = lookup(ids, index, 1, 4)
    assert [c[0] for c in got] == [4, 6, 1]


def test_no_match_without_repeats() -> None:
    ids = list(range(50))
    index = NGramIndex(1, 3)
    index.extend(ids)
    assert lookup(ids, index, 5, 2) == []


def test_lookup_cost_per_step_is_small() -> None:
    rng = random.Random(0)
    ids = [rng.randrange(40) for _ in range(3000)]
    index = NGramIndex(1, 3)
    index.extend(ids[:2000])
    start = time.perf_counter()
    for end in range(2000, 3000):  # one committed token per step, then a lookup
        index.extend(ids[:end])
        lookup(ids[:end], index, 8, 2)
    per_step = (time.perf_counter() - start) / 1000
    # slicing ids[:end] above costs ~10 us itself; the bound leaves room for a loaded machine
    assert per_step < 1e-3


def test_candidates_to_tree_merges_shared_prefixes() -> None:
    cands = [[1, 2, 3], [1, 2, 4], [5, 6], [1, 7]]
    tokens, parents = candidates_to_tree(cands)
    prefixes = {tuple(c[:i]) for c in cands for i in range(1, len(c) + 1)}
    assert len(tokens) == len(prefixes)
    paths: list[tuple[int, ...]] = [()]
    for tok, p in zip(tokens, parents):
        assert p < len(paths)
        paths.append(paths[p] + (tok,))
    assert set(paths[1:]) == prefixes
    assert [t for t, p in zip(tokens, parents) if p == 0] == [1, 5]  # candidate order among siblings


@pytest.mark.parametrize("max_nodes,want", [(1, [[1]]), (2, [[1, 2]]), (3, [[1, 2, 3]]), (4, [[1, 2, 3], [1, 2, 4]]),
                                            (5, [[1, 2, 3], [1, 2, 4], [5]]), (9, None)])
def test_candidates_to_tree_stops_at_max_nodes(max_nodes: int, want: list[list[int]] | None) -> None:
    cands = [[1, 2, 3], [1, 2, 4], [5, 6], [1, 7]]
    got = candidates_to_tree(cands, max_nodes)
    assert got == candidates_to_tree(cands if want is None else want)
    assert len(got[0]) <= max_nodes


# --- decoding ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def looping_target() -> LoadedModel:
    return make_looping_target()



@pytest.mark.parametrize("options", [
    {},
    {"num_candidates": 3},
    {"ngram_min": 2, "ngram_max": 4, "num_draft_tokens": 3, "adaptive": False},
    {"num_candidates": 2, "num_draft_tokens": 16, "min_draft_tokens": 1},
])
@pytest.mark.parametrize("name", ["repeating", "pattern", "no_repeats", "one_token", "chat"])
def test_reproduces_greedy(tiny_target: LoadedModel, options: dict, name: str) -> None:
    ids = prompts(tiny_target)[name]
    params = GenerationParams(40)
    ref = Greedy(tiny_target, "greedy", 256).generate(ids, params, 0)
    res = PromptLookup(tiny_target, max_len=256, **options).generate(ids, params, 0)
    assert res.output_ids == ref.output_ids
    check_counters(res, 40)


@pytest.mark.parametrize("num_candidates", [1, 2])
def test_accepts_drafts_on_a_repeating_target(looping_target: LoadedModel, num_candidates: int) -> None:
    params = GenerationParams(60)
    for ids in prompts(looping_target).values():
        ref = Greedy(looping_target, "greedy", 256).generate(ids, params, 0)
        strategy = PromptLookup(looping_target, max_len=256, num_candidates=num_candidates, gate=False)
        res = strategy.generate(ids, params, 0)
        assert res.output_ids == ref.output_ids
        check_counters(res, 60)
        tau = sum(res.accept_lengths) / len(res.accept_lengths)
        assert tau > 1.5, (ref.output_ids, res.accept_lengths)
        assert res.decode_steps < ref.decode_steps


def test_stops_at_eos_and_budget(looping_target: LoadedModel) -> None:
    ids = prompts(looping_target)["pattern"]
    ref = Greedy(looping_target, "greedy", 256).generate(ids, GenerationParams(30), 0)
    eos = ref.output_ids[12]  # a token the target emits mid-run
    first = ref.output_ids.index(eos)
    for max_new in (1, 2, 7, 30):
        params = GenerationParams(max_new, eos_ids=(eos,))
        res = PromptLookup(looping_target, max_len=256, gate=False).generate(ids, params, 0)
        assert res.output_ids == ref.output_ids[:min(max_new, first + 1)]
        check_counters(res, max_new)


def test_fits_a_cache_that_is_just_large_enough(looping_target: LoadedModel) -> None:
    ids = prompts(looping_target)["pattern"]
    params = GenerationParams(40)
    ref = Greedy(looping_target, "greedy", 256).generate(ids, params, 0)
    tight = len(ids) + 40  # the cache holds everything but the newest token
    res = PromptLookup(looping_target, max_len=tight, num_candidates=2, gate=False).generate(ids, params, 0)
    assert res.output_ids == ref.output_ids


@pytest.mark.parametrize("num_candidates", [1, 3])
def test_sampling_is_reproducible(tiny_target: LoadedModel, num_candidates: int) -> None:
    ids = prompts(tiny_target)["repeating"]
    params = GenerationParams(40, SamplingParams(temperature=0.8, top_p=0.95))
    strategy = PromptLookup(tiny_target, max_len=256, num_candidates=num_candidates, gate=False)
    runs = [strategy.generate(ids, params, seed).output_ids for seed in (1, 1, 2)]
    assert runs[0] == runs[1]
    assert len(runs[0]) == 40 and len(runs[2]) == 40
    assert runs[0] != runs[2]


def test_sampling_at_low_temperature_follows_greedy(looping_target: LoadedModel) -> None:
    # with logits this far apart a temperature of 0.05 leaves essentially one token per step
    ids = prompts(looping_target)["pattern"]
    ref = Greedy(looping_target, "greedy", 256).generate(ids, GenerationParams(40), 0)
    res = PromptLookup(looping_target, max_len=256, gate=False).generate(
        ids, GenerationParams(40, SamplingParams(temperature=0.01)), 3)
    assert res.output_ids == ref.output_ids
    assert res.accepted > 0


def test_config_builds_the_strategy(tiny_target: LoadedModel) -> None:
    cfg = OmegaConf.load(CONFIG_DIR / "strategy" / "prompt_lookup.yaml")
    assert cfg.name == "prompt_lookup"
    strategy = instantiate(cfg)(target=tiny_target, max_len=128, prefill_chunk=64)
    assert isinstance(strategy, PromptLookup) and strategy.name == "prompt_lookup"
    assert strategy.engine.max_len == 128


@pytest.mark.parametrize("bad", [
    {"ngram_min": 0}, {"ngram_min": 3, "ngram_max": 2}, {"num_draft_tokens": 0}, {"num_candidates": 0},
    {"min_draft_tokens": 0},
])
def test_bad_parameters_fail_in_one_line(tiny_target: LoadedModel, bad: dict) -> None:
    make: Callable[[], PromptLookup] = lambda: PromptLookup(tiny_target, max_len=64, **bad)
    with pytest.raises(SpecdecError) as err:
        make()
    assert "\n" not in str(err.value)


def test_draft_length_follows_measured_costs_and_acceptance() -> None:
    """The gate drafts the length that maximises expected tokens per unit of pass time: everything the
    cap allows when passes are free, nothing when a pass over 2 tokens costs as much as 3 steps, and
    nothing once this turn's drafts for a match length keep failing at their first token."""
    def proposer(costs: dict[int, float] | None) -> PromptLookupProposer:
        return PromptLookupProposer(1, 3, 6, 1, 2, False, 256, costs)

    flat = {r: 1.0 for r in range(1, 8)}
    assert proposer(None).best_length(2, 6) == 6
    assert proposer(flat).best_length(2, 6) == 6
    assert proposer({r: 3.0 if r > 1 else 1.0 for r in range(1, 8)}).best_length(2, 6) == 0
    cpu_like = {1: 1.0, 2: 1.3, 3: 1.5, 4: 1.7, 5: 1.9, 6: 2.1, 7: 2.3}
    p = proposer(cpu_like)
    assert p.best_length(2, 6) > 0
    for _ in range(10):  # drafts at n = 2 that were all rejected at depth 1
        p._n, p._drafted = 2, 3
        p.commit(None, Verdict(nodes=[], tokens=[5]), None)  # type: ignore[arg-type]
    assert p.best_length(2, 6) == 0
    assert p.best_length(3, 6) > 0  # other match lengths keep their own record
    for _ in range(10):  # and at n = 3 every draft of 4 was accepted whole
        p._n, p._drafted = 3, 4
        p.commit(None, Verdict(nodes=[0, 1, 2, 3], tokens=[5, 6, 7, 8, 9]), None)  # type: ignore[arg-type]
    assert p.best_length(3, 6) >= 4
