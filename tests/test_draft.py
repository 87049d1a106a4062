"""Draft-model speculative decoding: losslessness, cache rollback, schedules, sampling, peers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import assert_draws_follow, assert_kv_matches_fresh, speculative_rounds
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from specdec.cli_checks import CONFIG_DIR, strategy_config
from specdec.engine.sampling import SamplingParams, warp
from specdec.errors import SpecdecError
from specdec.metrics import strategy_metrics
from specdec.models.loader import LoadedModel, load_model
from specdec.strategies.base import DecodeState, GenerationParams
from specdec.strategies.draft import DraftStrategy
from specdec.strategies.greedy import Greedy
from specdec.strategies.hf import HFAssisted
from specdec.strategies.schedules import (
    Confidence,
    CostAware,
    DraftSchedule,
    FixedLength,
    Heuristic,
    RoundStats,
    SitOut,
)

PROMPTS = ["Summarize: the quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return"]


def tiny(seed: int = 0, **extra: Any) -> LoadedModel:
    cfg = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "model" / "tiny-llama.yaml"), resolve=True)
    assert isinstance(cfg, dict)
    cfg.pop("_target_")
    cfg["tiny"] = cfg["tiny"] | {"seed": seed} | extra
    return load_model(**cfg)


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return tiny(0)


@pytest.fixture(scope="module")
def wrong_draft() -> LoadedModel:
    return tiny(1)  # same tokenizer, other random weights: almost never agrees with the target


@pytest.fixture(scope="module")
def near_draft() -> LoadedModel:
    """The target with its matrices perturbed (5% of their spread): it agrees often, and where its first
    choice misses, its second is often the target's token."""
    model = tiny(0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g) * p.std() * 0.05)
    return model


def prompt_ids(target: LoadedModel, text: str) -> list[int]:
    return target.chat_ids([{"role": "user", "content": text}])


def greedy_ids(target: LoadedModel, prompt: list[int], n: int) -> list[int]:
    return Greedy(target, "greedy", 512, 64).generate(prompt, GenerationParams(n), 0).output_ids


@pytest.mark.parametrize("which", ["wrong", "self"])
def test_draft_reproduces_greedy(target: LoadedModel, wrong_draft: LoadedModel, which: str) -> None:
    draft = wrong_draft if which == "wrong" else target
    gamma = 4
    strategy = DraftStrategy(target, "draft", draft, FixedLength(gamma), 512, 64)
    for text in PROMPTS:
        prompt = prompt_ids(target, text)
        res = strategy.generate(prompt, GenerationParams(30), 0)
        assert res.output_ids == greedy_ids(target, prompt, 30)
        assert sum(res.accept_lengths) == len(res.output_ids) == 30
        assert len(res.accept_lengths) == res.decode_steps + 1
        if which == "self":  # the target drafting for itself is always right: tau = gamma + 1
            assert res.accept_lengths[1:-1] == [gamma + 1] * (len(res.accept_lengths) - 2)
            assert res.accepted == res.proposed
        else:
            assert res.accepted <= res.proposed // 4  # a different random model rarely agrees


def test_a_saved_draft_with_more_rows_stays_lossless(target: LoadedModel, tmp_path: Any) -> None:
    # A distilled draft trained on 64 kept rows, run on 160: its logits' rows are the kept ids, then the lowest
    # other ids; the output stays greedy's whichever rows it proposes from.
    from heads.draft_model import DraftTrainable, load_draft

    rows = [{"input_ids": list(range(100, 300)), "labels": [-100] * 10 + list(range(110, 300))}]
    trainable = DraftTrainable(layers=1, kept_vocab=64, save_dtype="fp32")
    trainable.save(trainable.build(target, rows), tmp_path, {"steps": 0})
    kept = load_draft(str(tmp_path)).bind(target).token_ids.tolist()
    net = load_draft(str(tmp_path), rows=160).bind(target)
    assert net.token_ids[:64].tolist() == kept and len(set(net.token_ids.tolist())) == 160
    strategy = DraftStrategy(target, "draft", load_draft(str(tmp_path), rows=160), FixedLength(3), 512, 64)
    outside = 0
    for text in PROMPTS:
        prompt = prompt_ids(target, text)
        assert strategy.generate(prompt, GenerationParams(30), 0).output_ids == greedy_ids(target, prompt, 30)
        for _, proposal, _, _ in speculative_rounds(strategy, prompt, 8, GenerationParams(100)):
            outside += sum(t not in kept for t in proposal.tokens.tolist())
    assert outside > 0  # the added rows are proposed


@pytest.mark.parametrize("schedule", [Heuristic(gamma=2, max_gamma=8), Confidence(threshold=0.4, max_gamma=8),
                                      CostAware(max_gamma=8, cost_ratio=0.01, verify_cost=0.0),
                                      CostAware(max_gamma=8, cost_ratio=0.01, curve=[1.0, 1.0, 1.02, 1.3, 1.6]),
                                      CostAware(max_gamma=8, cost_ratio=0.01, siblings=2, follow=True)],
                         ids=["heuristic", "confidence", "cost_aware", "cost_aware_fixed_curve", "cost_aware_follow"])
def test_every_schedule_reproduces_greedy(target: LoadedModel, wrong_draft: LoadedModel,
                                          schedule: DraftSchedule) -> None:
    for draft in (wrong_draft, target):
        strategy = DraftStrategy(target, "draft", draft, schedule, 512, 64)
        for text in PROMPTS:
            prompt = prompt_ids(target, text)
            assert strategy.generate(prompt, GenerationParams(30), 0).output_ids == greedy_ids(target, prompt, 30)
    if isinstance(schedule, CostAware) and schedule.follow:  # the rounds' passes priced the drafts, not the start-up
        assert schedule.states is not None and schedule.states.passes > 0


def test_caches_match_recomputation_after_rejections(target: LoadedModel, wrong_draft: LoadedModel) -> None:
    strategy = DraftStrategy(target, "draft", wrong_draft, FixedLength(3), 512, 64)
    rejected = 0
    for state, proposal, verdict, proposer in speculative_rounds(strategy, prompt_ids(target, PROMPTS[0]), 8,
                                                                 GenerationParams(200)):
        rejected += len(verdict.nodes) < len(proposal.tokens)
        # the target cache holds everything but the root; the draft cache a prefix of the sequence
        assert_kv_matches_fresh(strategy.engine, state.ids[:-1])
        fed = proposer.fed
        assert fed == state.ids[:len(fed)]
        assert_kv_matches_fresh(strategy.drafter.engine, fed)
    assert rejected >= 4


def test_draft_cache_catches_up_after_full_acceptance(target: LoadedModel) -> None:
    strategy = DraftStrategy(target, "draft", target, FixedLength(3), 512, 64)
    for state, _, verdict, proposer in speculative_rounds(strategy, prompt_ids(target, PROMPTS[1]), 3,
                                                          GenerationParams(100)):
        assert len(verdict.nodes) == 3
        # the last drafted token and the bonus token are fed with the next proposal
        assert len(state.ids) - len(proposer.fed) == 2
        assert_kv_matches_fresh(strategy.drafter.engine, proposer.fed)


def test_heuristic_schedule_grows_and_shrinks(target: LoadedModel, wrong_draft: LoadedModel) -> None:
    prompt = prompt_ids(target, PROMPTS[0])
    grow = DraftStrategy(target, "h", target, Heuristic(gamma=2, max_gamma=8), 512, 64)
    res = grow.generate(prompt, GenerationParams(40), 0)
    assert res.accept_lengths[1:5] == [3, 5, 7, 9]  # +2 per full acceptance, capped at 8
    shrink = Heuristic(gamma=6)
    DraftStrategy(target, "h", wrong_draft, shrink, 512, 64).generate(prompt, GenerationParams(20), 0)
    assert shrink.gamma <= 2


def test_cost_aware_schedule() -> None:
    cheap = CostAware(max_gamma=10, cost_ratio=0.01, verify_cost=0.0)
    cheap.length()
    assert all(cheap.keep_drafting(i + 1, 0.97) for i in range(5))  # confident and cheap: keep going
    dear = CostAware(max_gamma=10, cost_ratio=2.0)
    dear.length()
    assert not dear.keep_drafting(1, 0.97)  # a draft step dearer than a target step never pays
    calib = CostAware(max_gamma=10, cost_ratio=0.5, verify_cost=0.0, prior_weight=1.0)
    for _ in range(100):  # the draft is confident but the target never agrees
        calib.update(RoundStats(1, 0, [0.95], 0.001, 0.02))
    assert calib.accept_prob(0.95) < 0.05
    calib.length()
    assert not calib.keep_drafting(1, 0.95)
    assert calib.cost == pytest.approx(0.05, rel=0.1)  # measured draft/target time ratio


def test_cost_aware_calibrates_each_chain_depth_apart_when_asked() -> None:
    # Rounds of two tokens at confidence 0.3: the first accepted a fifth of the time, the second (reached only
    # after the first) always. One table blends the two; depths=2 learns each.
    pooled, by_depth = CostAware(cost_ratio=0.1, verify_cost=0.0), CostAware(cost_ratio=0.1, verify_cost=0.0, depths=2)
    for i in range(500):
        for sched in (pooled, by_depth):
            sched.update(RoundStats(2, 2 if i % 5 == 0 else 0, [0.3, 0.3], 0.001, 0.02))
    assert by_depth.accept_prob(0.3, 0) == pytest.approx(0.2, abs=0.02)
    assert by_depth.accept_prob(0.3, 1) > 0.95 and by_depth.accept_prob(0.3, 5) == by_depth.accept_prob(0.3, 1)
    assert pooled.accept_prob(0.3, 1) == pooled.accept_prob(0.3, 0) == pytest.approx(1 / 3, abs=0.03)
    for sched in (pooled, by_depth):
        sched.length()
        sched.rate, sched.cost = 1.0, 0.08  # a draft step at 0.08 of a target step, verification free
    # the second token: 0.2 x 0.98 (by depth) and 0.33 x 0.33 (pooled) both pay for a step
    assert pooled.keep_drafting(1, 0.3) and by_depth.keep_drafting(1, 0.3)
    # the third token: 0.2 x 0.98 x 0.98 = 0.19 pays, 0.33^3 = 0.04 does not
    assert by_depth.keep_drafting(2, 0.3) and not pooled.keep_drafting(2, 0.3)
    with pytest.raises(SpecdecError, match="depths >= 1"):
        CostAware(depths=0)


def test_cost_aware_reads_marginal_costs_off_the_pass_curve() -> None:
    sched = CostAware(cost_ratio=0.05, siblings=2)
    sched.curve = [1.0, 1.0, 1.0, 1.02, 1.10, 1.18]  # a CPU's: 2-3 tokens as cheap as one, then ~0.08 each
    assert sched.verify_step(2) == pytest.approx(0.02) and sched.verify_step(3) == pytest.approx(0.08)
    assert sched.verify_step(9) == pytest.approx(0.08) and sched.pass_cost(7) == pytest.approx(1.34)
    # a second choice with a 5% chance (the prior at 0.06) pays beside a one-token chain, not beside three
    assert sched.branches([0.3], [0.06], room=10) == [0]
    assert sched.branches([0.9, 0.9, 0.3], [0.0, 0.0, 0.06], room=10) == []
    # the curve also converts a round's target time into a one-token step: 11.8 ms over 5 tokens (4 verified
    # plus the root) is 11.8 / 1.18 = 10 ms a step, so 1.5 ms per drafted token is a draft cost of 0.15
    for _ in range(400):
        sched.update(RoundStats(4, 1, [0.5] * 4, 0.006, 0.0118))
    assert sched.cost == pytest.approx(0.15, rel=0.02)


def test_cost_aware_takes_a_fixed_curve_instead_of_timing_one() -> None:
    steep = CostAware(cost_ratio=0.02, curve=[1.0, 1.07, 1.10, 1.05, 1.20])
    steep.calibrate(object())  # nothing timed: an engine's pass_cost_curve would fail on this object
    assert steep.pass_cost(4) == pytest.approx(1.10)  # a dip is made non-decreasing, as in a measured curve
    assert steep.verify_step(4) == pytest.approx(0.10) and steep.pass_cost(7) == pytest.approx(1.40)
    flat = CostAware(cost_ratio=0.02, curve=[2.0, 2.0, 2.0, 2.0, 2.02])  # normalised to its first entry
    flat.calibrate(object())
    # the same odds (0.6, then 0.6 x 0.6 ...) draft further where passes are cheaper
    def drafted(s: CostAware) -> int:
        s.length()
        n = 0
        while n < s.max_gamma and s.keep_drafting(n + 1, 0.65):
            n += 1
        return n
    assert drafted(flat) > drafted(steep)
    for bad in ([1.0], [1.0, 0.0], [1.0, "fast"], "fast"):
        with pytest.raises(SpecdecError, match="schedule.curve"):
            CostAware(curve=bad)  # type: ignore[arg-type]


def test_cost_aware_measures_verification_cost() -> None:
    sched = CostAware(cost_ratio=1.0, verify_cost=0.0, momentum=0.1)
    for i in range(300):  # target pass: 20 ms + 4 ms per verified token; draft: 2.4 ms per token
        k = 1 + i % 6
        sched.update(RoundStats(k, 0, [0.5] * k, 0.0024 * k, 0.020 + 0.004 * (k + 1)))
    assert sched.verify_cost == pytest.approx(0.004 / 0.024, rel=0.05)
    assert sched.cost == pytest.approx(0.0024 / 0.024, rel=0.05)


def test_cost_aware_branches_where_a_second_choice_pays() -> None:
    cheap = CostAware(cost_ratio=0.05, verify_cost=0.01, siblings=2)
    # a likely second choice at the first depth pays for one more verified token; depth 3 is rarely reached
    assert cheap.branches([0.1, 0.1, 0.1], [0.45, 0.45, 0.45], room=10) == [0, 1]
    assert cheap.branches([0.1, 0.1, 0.1], [0.45, 0.45, 0.45], room=1) == [0]  # no room for a second sibling
    assert CostAware(verify_cost=0.5, siblings=2).branches([0.9], [0.05], room=10) == []  # dear: chains
    assert CostAware(verify_cost=0.0).branches([0.1], [0.45], room=10) == []  # siblings=0: chains
    calib = CostAware(verify_cost=0.01, siblings=2, prior_weight=1.0)
    for _ in range(200):  # second choices at 0.45 that the target never takes
        calib.update(RoundStats(1, 0, [0.5], 0.001, 0.02, siblings=1, seconds=((0.45, False),)))
    assert calib.second_prob(0.45) < 0.02
    assert calib.branches([0.5], [0.45], room=10) == []


@pytest.mark.parametrize("which", ["wrong", "near", "self"])
def test_sibling_trees_reproduce_greedy_and_keep_caches_exact(target: LoadedModel, wrong_draft: LoadedModel,
                                                              near_draft: LoadedModel, which: str) -> None:
    draft = {"wrong": wrong_draft, "near": near_draft, "self": target}[which]
    class Recording(CostAware):
        seen: list[RoundStats] = []

        def update(self, stats: RoundStats) -> None:
            self.seen.append(stats)
            super().update(stats)

    # free verification (a flat pass-cost curve in place of the measured one): a sibling at every depth
    schedule = Recording(max_gamma=3, cost_ratio=0.0, verify_cost=0.0, siblings=3)
    strategy = DraftStrategy(target, "draft", draft, schedule, 512, 64)
    assert schedule.curve is not None and len(schedule.curve) == 8  # measured at start-up, sizes 1..7
    schedule.curve = [1.0] * 8
    prompt = prompt_ids(target, PROMPTS[0])
    trees = sibling_wins = 0
    for state, proposal, verdict, proposer in speculative_rounds(strategy, prompt, 20, GenerationParams(300)):
        drafted = next((i for i, p in enumerate(proposal.parents) if p != i), len(proposal.parents))  # chain nodes
        trees += not proposal.is_chain
        won = bool(verdict.nodes) and verdict.nodes[-1] > drafted
        sibling_wins += won
        stats = schedule.seen[-1]  # what the schedule learnt from this round
        assert stats.drafted == drafted and stats.siblings == len(proposal.parents) - drafted
        assert stats.sibling_hit == won and stats.gained == len(verdict.nodes)
        assert stats.accepted == len(verdict.nodes) - won  # the chain tokens before the sibling
        assert len(stats.seconds) == min(stats.accepted + 1, drafted)  # the depths the target reached
        if won:  # the target took the second choice at the depth where the chain failed
            assert stats.seconds[-1][1]
        assert_kv_matches_fresh(strategy.engine, state.ids[:-1])
        assert proposer.fed == state.ids[:len(proposer.fed)]
        assert_kv_matches_fresh(strategy.drafter.engine, proposer.fed)
    if which != "wrong":  # (the wrong draft's second choices calibrate towards 0 and stop paying)
        assert trees >= 6
    if which == "near":
        assert sibling_wins >= 3  # where its first choice misses, the second is often the target's token
    for text in PROMPTS:
        p = prompt_ids(target, text)
        res = strategy.generate(p, GenerationParams(30), 0)
        assert res.output_ids == greedy_ids(target, p, 30)
        assert sum(res.accept_lengths) == 30


@pytest.mark.parametrize("schedule", ["draft_heuristic", "draft_confidence", "draft_cost_aware", "draft_sitout"])
def test_adaptive_schedules_stay_lossless(target: LoadedModel, wrong_draft: LoadedModel, schedule: str) -> None:
    # the schedules as experiment=draft_schedules defines them (configs/strategy/schedule/ and its overrides)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = strategy_config(compose("run", overrides=["experiment=draft_schedules"]), schedule)
    sched = instantiate(cfg.schedule)
    prompt = prompt_ids(target, PROMPTS[1])
    for draft in (target, wrong_draft):
        res = DraftStrategy(target, schedule, draft, sched, 512, 64).generate(prompt, GenerationParams(25), 0)
        assert res.output_ids == greedy_ids(target, prompt, 25)


def sit_out_rounds(strategy: DraftStrategy, prompt: list[int], n: int) -> tuple[list[int], int, int]:
    """The greedy loop for n tokens, checking both caches after every round; (output, drafting rounds, rounds)."""
    out = strategy.engine.prefill(prompt)
    state = DecodeState(list(prompt), len(prompt), GenerationParams(n + 8), None)
    state.ids.append(int(out.logits[-1].argmax()))
    proposer = strategy.make_proposer()
    proposer.start(state, out)
    drafted = rounds = 0
    while len(state.ids) - len(prompt) < n:
        rounds += 1
        proposal = proposer.propose(state)
        drafted += proposal is not None
        verdict, out = strategy._step(state, proposal)
        state.ids.extend(verdict.tokens)
        proposer.commit(state, verdict, out)
        assert_kv_matches_fresh(strategy.engine, state.ids[:-1])
        # a draft that sat out lags behind; what it holds is still a prefix of the sequence, exactly
        assert proposer.fed == state.ids[:len(proposer.fed)]
        assert_kv_matches_fresh(strategy.drafter.engine, proposer.fed)
    return state.ids[len(prompt):len(prompt) + n], drafted, rounds


def test_sit_out_skips_a_losing_draft_but_probes_it(target: LoadedModel, wrong_draft: LoadedModel) -> None:
    schedule = SitOut(FixedLength(3), probe_every=3, prior_rate=0.5, momentum=0.01)
    strategy = DraftStrategy(target, "draft_sitout", wrong_draft, schedule, 512, 64)
    assert set(schedule.gate.costs) == {1, 2, 3, 4}  # measured at start-up on this engine
    prompt = prompt_ids(target, PROMPTS[0])
    output, drafted, rounds = sit_out_rounds(strategy, prompt, 40)
    assert output == greedy_ids(target, prompt, 40)
    assert schedule.gate.meter.rate < 1.0  # a random draft never earns its keep
    assert rounds // 4 <= drafted <= rounds // 4 + 1, (drafted, rounds)  # one round in probe_every + 1


def test_sit_out_never_benches_a_draft_that_pays(target: LoadedModel, wrong_draft: LoadedModel) -> None:
    # a rate held at twice a plain step's (the meter all but frozen): every round drafts, even a wrong draft
    schedule = SitOut(FixedLength(3), probe_every=3, prior_rate=2.0, momentum=1e-6)
    strategy = DraftStrategy(target, "draft_sitout", wrong_draft, schedule, 512, 64)
    prompt = prompt_ids(target, PROMPTS[1])
    output, drafted, rounds = sit_out_rounds(strategy, prompt, 30)
    assert output == greedy_ids(target, prompt, 30)
    assert drafted == rounds
    with pytest.raises(SpecdecError, match="probe_every"):
        SitOut(FixedLength(3), probe_every=-1)
    growing = SitOut(Heuristic(gamma=2, max_gamma=6))
    DraftStrategy(target, "h", wrong_draft, growing, 512, 64)
    assert max(growing.gate.costs) == 7  # up to the heuristic's longest draft, not its first one


def _first_token_counts(strategy: DraftStrategy, prompt: list[int], sp: SamplingParams, n: int) -> torch.Tensor:
    """Counts of the first token the speculative step commits after a fixed root, over n seeds."""
    counts = torch.zeros(strategy.target.vocab_size)
    params = GenerationParams(8, sp)
    base = len(prompt) - 1  # the last prompt token is the root
    out = strategy.engine.prefill(prompt[:-1])
    proposer = strategy.make_proposer()
    proposer.start(DecodeState(list(prompt), base, params, None), out)
    for seed in range(n):
        state = DecodeState(list(prompt), base, params, torch.Generator().manual_seed(seed))
        proposal = proposer.propose(state)
        assert proposal is not None and proposal.probs is not None
        verdict, _ = strategy._step(state, proposal)
        counts[verdict.tokens[0]] += 1
        strategy.engine.rollback(base)  # both caches back to the prompt for the next draw
        strategy.drafter.engine.rollback(base)
        del proposer.fed[base:]
    return counts


@pytest.mark.parametrize("draft_kind", ["close", "far"])
def test_speculative_sampling_preserves_target_distribution(target: LoadedModel, wrong_draft: LoadedModel,
                                                            draft_kind: str) -> None:
    if draft_kind == "close":  # the target with slightly perturbed weights
        draft = tiny(0)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in draft.model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.01)
    else:
        draft = wrong_draft
    # a low temperature concentrates the target on a few tokens, so 300 draws can see a biased rule
    sp = SamplingParams(temperature=0.3, top_p=0.9)  # both warps must apply to q as they do to p
    strategy = DraftStrategy(target, "draft", draft, FixedLength(3), 256, 64)
    prompt = prompt_ids(target, "Hello")
    n = 300
    counts = _first_token_counts(strategy, prompt, sp, n)
    p = warp(strategy.engine.prefill(prompt).logits[-1], sp)  # (V,) the target's distribution
    assert_draws_follow(counts, p)
    q = warp(strategy.drafter.engine.prefill(prompt).logits[-1], sp)
    tv = 0.5 * float((p - q).abs().sum())
    assert (tv < 0.5) if draft_kind == "close" else (tv > 0.9)  # the two cases really differ


def test_mismatched_tokenizer_fails_before_running(target: LoadedModel) -> None:
    other = tiny(0, vocab_size=600)
    with pytest.raises(SpecdecError, match="tokenizer|vocabulary"):
        DraftStrategy(target, "draft", other, FixedLength(4), 512, 64)


def test_missing_trained_draft_is_one_clear_line() -> None:
    from heads.draft_model import load_draft

    with pytest.raises(SpecdecError, match=r"python -m heads.train head=draft model=nosuch") as err:
        load_draft("heads/checkpoints/nosuch-draft")
    assert "\n" not in str(err.value)


def test_hf_assisted_matches_greedy(target: LoadedModel, wrong_draft: LoadedModel) -> None:
    prompt = prompt_ids(target, PROMPTS[0])
    peer = HFAssisted(target, "hf_assisted", wrong_draft, num_assistant_tokens=3)
    assert peer.assistant_model().generation_config.num_assistant_tokens == 3
    assert peer.generate(prompt, GenerationParams(20), 0).output_ids == greedy_ids(target, prompt, 20)


def test_summary_reports_leviathan_prediction(target: LoadedModel) -> None:
    strategy = DraftStrategy(target, "draft", target, FixedLength(4), 512, 64)
    res = strategy.generate(prompt_ids(target, PROMPTS[0]), GenerationParams(26), 0)
    row = {"new_tokens": len(res.output_ids), "wall_time_s": res.wall_time_s, "ttft_s": res.ttft_s,
           "decode_steps": res.decode_steps, "accept_lengths": res.accept_lengths,
           "proposed_tokens": res.proposed, "accepted_tokens": res.accepted,
           "proposed_by_pos": res.proposed_by_pos, "accepted_by_pos": res.accepted_by_pos,
           "draft_time_s": res.draft_time_s}
    m = strategy_metrics([row])
    assert m["alpha_per_token"] == 1.0 and m["acceptance_rate"] == 1.0
    assert m["accepted_by_position"] == res.accepted_by_pos
    assert m["mean_draft_length"] == pytest.approx(res.proposed / res.decode_steps)
    # c is one draft step over one target step, both from the row's own clock (no speed threshold here)
    target_step = (res.wall_time_s - res.ttft_s - res.draft_time_s) / res.decode_steps
    assert m["cost_ratio"] == pytest.approx((res.draft_time_s / res.proposed) / target_step)
    g, c = m["mean_draft_length"], m["cost_ratio"]
    assert m["expected_speedup"] == pytest.approx((g + 1) / (g * c + 1))
