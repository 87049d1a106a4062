"""Prompt lookup in front of a model drafter: losslessness, routing between the two, caches, sampling."""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers import assert_draws_follow, assert_kv_matches_fresh, chain_forward, check_counters, speculative_rounds
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from test_draft import tiny
from test_eagle import untrained  # noqa: F401  (a fixture: a random EAGLE drafter saved like a trained one)

from heads.eagle import load_eagle
from heads.medusa import medusa_heads
from specdec.cli_checks import CONFIG_DIR, strategy_config
from specdec.engine.sampling import SamplingParams, warp
from specdec.errors import SpecdecError
from specdec.models.loader import LoadedModel
from specdec.ngram import match_length
from specdec.strategies.base import DecodeState, GenerationParams
from specdec.strategies.draft import DraftStrategy
from specdec.strategies.eagle import EagleStrategy
from specdec.strategies.greedy import Greedy
from specdec.strategies.hybrid import LookupFirst, LookupHybrid
from specdec.strategies.medusa import Medusa
from specdec.strategies.rate import RateMeter
from specdec.strategies.schedules import FixedLength

PATTERN = [17, 40, 99, 23] * 6  # copying from it pays; a random model's own tokens rarely repeat it


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return tiny(0)


def draft_hybrid(target: LoadedModel, draft: LoadedModel, prior_rate: float = 1.0,
                 probe_every: int = 8) -> LookupHybrid:
    inner = partial(DraftStrategy, name="draft", draft=draft, schedule=FixedLength(3))  # as Hydra builds it
    return LookupHybrid(target, "draft_lookup", inner, 512, 64, prior_rate=prior_rate, probe_every=probe_every)


def texts(target: LoadedModel) -> list[list[int]]:
    chat = target.chat_ids([{"role": "user", "content": "def add(a, b):\n    return a + b\n" * 3}])
    return [chat, PATTERN]


@pytest.mark.parametrize("which", ["wrong", "self"])
def test_draft_lookup_reproduces_greedy_and_uses_both_drafters(target: LoadedModel, which: str) -> None:
    draft = tiny(1) if which == "wrong" else target
    strategy = draft_hybrid(target, draft)
    greedy = Greedy(target, "greedy", 512, 64)
    used = {"lookup": 0, "model": 0}
    for prompt in texts(target):
        res = strategy.generate(prompt, GenerationParams(40), 0)
        assert res.output_ids == greedy.generate(prompt, GenerationParams(40), 0).output_ids
        check_counters(res, 40)
        assert strategy.last_proposer is not None
        for k in used:
            used[k] += strategy.last_proposer.rounds[k]
    assert used["lookup"] > 0 and used["model"] > 0, used


@pytest.mark.parametrize("drafter", ["eagle", "medusa"])
def test_eagle_and_medusa_behind_the_lookup_reproduce_greedy(tiny_target: LoadedModel, untrained: Path,  # noqa: F811
                                                            drafter: str) -> None:
    if drafter == "eagle":  # an untrained EAGLE-style drafter
        inner = partial(EagleStrategy, name="eagle", drafter=load_eagle(str(untrained)), schedule=FixedLength(3))
    else:  # heads with random blocks: wrong guesses on purpose
        inner = partial(Medusa, name="medusa", heads=medusa_heads(tiny_target, num_heads=4, seed=5), tree="default")
    strategy = LookupHybrid(tiny_target, f"{drafter}_lookup", inner, 512, 64)
    greedy = Greedy(tiny_target, "greedy", 512, 64)
    for prompt in texts(tiny_target):
        res = strategy.generate(prompt, GenerationParams(40), 0)
        assert res.output_ids == greedy.generate(prompt, GenerationParams(40), 0).output_ids
        check_counters(res, 40)
    assert strategy.last_proposer is not None and strategy.last_proposer.rounds["lookup"] > 0


def test_caches_stay_exact_across_both_sources(target: LoadedModel) -> None:
    """After rounds drafted by either, the target's cache and the draft's hold exactly the committed prefix."""
    strategy = draft_hybrid(target, tiny(1), probe_every=0)  # the model drafts whenever the lookup does not
    sources = set()
    for state, _, _, proposer in speculative_rounds(strategy, PATTERN, 30, GenerationParams(200)):
        sources.add(proposer.source)
        assert_kv_matches_fresh(strategy.engine, state.ids[:-1])
        fed = proposer.model.fed
        assert fed == state.ids[:len(fed)]
        assert_kv_matches_fresh(strategy.inner.drafter.engine, fed)
    assert sources == {"lookup", "model"}


def test_the_lookup_drafts_only_when_it_beats_the_model_rate(target: LoadedModel) -> None:
    """A model drafter believed far better than copying is always asked; one at break-even only when
    there is nothing to copy."""
    strategy = draft_hybrid(target, tiny(1), prior_rate=1e9)
    strategy.meter.momentum = 0.0  # hold the belief fixed for the test
    strategy.generate(PATTERN, GenerationParams(30), 0)
    assert strategy.last_proposer is not None and strategy.last_proposer.rounds["lookup"] == 0
    strategy = draft_hybrid(target, tiny(1), prior_rate=1.0)
    strategy.meter.momentum = 0.0
    seen = {"lookup": 0, "model": 0}
    copyable = None  # whether the round about to run finds a copy (the first one is not checked)
    for state, _, _, proposer in speculative_rounds(strategy, PATTERN, 30, GenerationParams(200)):
        assert copyable is None or copyable or proposer.source == "model"
        seen[proposer.source] += 1
        proposer.lookup.index.extend(state.ids)
        copyable = match_length(state.ids, proposer.lookup.index) > 0  # what the next round finds
    assert seen["lookup"] > 0 and seen["model"] > 0, seen


def test_a_drafter_below_break_even_sits_out_but_is_probed(target: LoadedModel) -> None:
    strategy = draft_hybrid(target, tiny(1), prior_rate=0.5, probe_every=3)
    strategy.meter.momentum = 0.0  # a drafter measured at half a plain step's rate
    strategy.generate(list(range(3, 40)), GenerationParams(60), 0)  # nothing in the prompt to copy
    rounds = strategy.last_proposer.rounds  # type: ignore[union-attr]
    # of every 4 rounds without a copy, 3 are plain steps and the 4th a probe by the model (the last
    # rounds, with no budget left to draft, are plain steps too)
    assert rounds["model"] > 0
    assert 3 * rounds["model"] <= rounds["none"] <= 3 * rounds["model"] + 6, rounds


def test_rate_meter_counts_a_round_in_one_token_passes() -> None:
    meter = RateMeter(rate=1.0, momentum=1.0)
    # a pass over 4 tokens took 0.12 s and costs 1.2 one-token passes, so one pass is 0.1 s; drafting
    # took 0.03 s: 1.5 units in all for 3 tokens
    meter.update(3, 0.03, 0.12, 1.2)
    assert meter.rate == pytest.approx(2.0)
    meter.momentum = 0.5
    meter.update(1, 0.0, 0.1, 1.0)
    assert meter.rate == pytest.approx(1.5)


def _first_token_counts(strategy: LookupHybrid, prompt: list[int], root: int, sp: SamplingParams,
                        n: int) -> tuple[torch.Tensor, set[str]]:
    counts = torch.zeros(strategy.target.vocab_size)
    sources = set()
    for seed in range(n):
        strategy.engine.prefill(prompt)
        state = DecodeState([*prompt, root], len(prompt), GenerationParams(8, sp),
                            torch.Generator().manual_seed(seed))
        proposer = strategy.make_proposer()
        assert isinstance(proposer, LookupFirst)
        proposer.start(state, None)  # type: ignore[arg-type]  (neither part reads the prefill here)
        proposal = proposer.propose(state)
        assert proposal is not None
        sources.add(proposer.source)
        verdict, _ = strategy._step(state, proposal)
        counts[verdict.tokens[0]] += 1
    return counts, sources


@pytest.mark.parametrize("route", ["lookup", "model"])
def test_sampling_preserves_the_target_distribution(target: LoadedModel, route: str) -> None:
    # the root repeats a prompt token, so a copy is on offer; the prior rate decides who drafts
    strategy = draft_hybrid(target, tiny(1), prior_rate=0.0 if route == "lookup" else 1e9)
    strategy.meter.momentum = 0.0
    sp = SamplingParams(temperature=0.3, top_p=0.9)
    n = 300
    counts, sources = _first_token_counts(strategy, PATTERN, PATTERN[0], sp, n)
    assert sources == {route}
    _, logits = chain_forward(target.model, [*PATTERN, PATTERN[0]])
    p = warp(logits[-1], sp)  # (V,) the target's distribution after the root
    assert_draws_follow(counts, p, min_bins=3)


HYBRIDS = {"draft_lookup": "draft", "eagle_lookup": "eagle", "hydra_lookup": "hydra"}  # hybrid: its inner strategy


def resolved(name: str, configs: Path = CONFIG_DIR) -> DictConfig:
    """strategy=NAME as a run resolves it (model=tiny-llama), from the config folder `configs`."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(configs), version_base=None):
        return strategy_config(compose("run", overrides=["model=tiny-llama", f"strategy={name}"]), name)


@pytest.mark.parametrize("name", HYBRIDS)
def test_a_hybrids_inner_strategy_is_its_base_file(name: str) -> None:
    # composed through the defaults list (`/strategy@inner: BASE`), not copied: every key the base file
    # resolves to, and nothing else
    assert resolved(name).inner == resolved(HYBRIDS[name])


def test_a_change_to_the_base_file_reaches_the_hybrid(tmp_path: Path) -> None:
    configs = tmp_path / "configs"
    shutil.copytree(CONFIG_DIR, configs)
    base = configs / "strategy" / "draft.yaml"
    base.write_text(base.read_text().replace("weights: int8", "weights: bf16"))
    schedule = configs / "strategy" / "schedule" / "cost_aware.yaml"
    schedule.write_text(schedule.read_text().replace("max_gamma: 12", "max_gamma: 5"))
    inner = resolved("draft_lookup", configs).inner
    assert inner.draft.weights == "bf16" and inner.schedule.max_gamma == 5
    assert inner == resolved("draft", configs) != resolved("draft")


def test_configs_build_the_hybrids(target: LoadedModel) -> None:
    for name, inner in (("draft_lookup", "DraftStrategy"), ("eagle_lookup", "EagleStrategy"),
                        ("hydra_lookup", "Medusa")):
        cfg = resolved(name)
        assert cfg.name == name and cfg.inner._target_.endswith(inner)
    cfg = resolved("draft_lookup")
    cfg.inner.draft = OmegaConf.load(CONFIG_DIR / "model" / "tiny-llama.yaml")  # any model sharing the tokenizer
    cfg.inner.draft.tiny.seed = 1
    built = instantiate(cfg)(target=target, max_len=128, prefill_chunk=64)
    assert isinstance(built, LookupHybrid) and isinstance(built.inner, DraftStrategy)
    assert built.engine is built.inner.engine  # one target cache


def test_bad_settings_fail_in_one_line(target: LoadedModel) -> None:
    with pytest.raises(SpecdecError) as err:
        LookupHybrid(target, "draft_lookup", partial(Greedy, name="greedy"), 128, 64, ngram_min=0)
    assert "\n" not in str(err.value)
    with pytest.raises(SpecdecError) as err:
        LookupHybrid(target, "draft_lookup", partial(Greedy, name="greedy"), 128, 64).make_proposer()
    assert "\n" not in str(err.value) and "drafts nothing" in str(err.value)
