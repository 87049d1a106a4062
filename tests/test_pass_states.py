"""Pass-cost curves that follow the host's speed states (specdec.strategies.pass_states, CostAware(follow=True))."""

from __future__ import annotations

import random

import pytest

from specdec.errors import SpecdecError
from specdec.strategies.pass_states import PassStates
from specdec.strategies.schedules import CostAware, RoundStats

# Two made-up states of one host, in seconds of a pass over n = 0..9 tokens: a fast one whose passes grow
# with their size, a slow one whose passes cost the same up to 7 tokens.
FAST = [0.0, 0.014, 0.015, 0.0155, 0.0157, 0.0168, 0.0175, 0.0183, 0.0193, 0.0238]
SLOW = [0.0, 0.019, 0.0198, 0.0198, 0.0198, 0.0198, 0.0199, 0.0199, 0.0209, 0.0245]
PRIOR = [c / FAST[1] for c in FAST]  # the start-up timing met the fast state
PRIOR[0] = 1.0


def feed(states: PassStates, truth: list[float], passes: int, rng: random.Random, noise: float = 0.0) -> None:
    for _ in range(passes):
        n = rng.randint(2, 9)
        states.observe(n, truth[n] * (1 + rng.uniform(-noise, noise)))


def relative(truth: list[float]) -> list[float]:
    return [1.0] + [t / truth[1] for t in truth[1:]]


def above_two(curve: list[float]) -> list[float]:
    """The curve relative to a pass over 2 tokens: a state's one-token pass is extrapolated (the rounds
    verify two tokens or more), through the prior's shape, so only the sizes above it are measured."""
    return [c / curve[2] for c in curve[2:]]


def test_each_state_gets_its_own_curve_and_the_states_alternate() -> None:
    rng = random.Random(0)
    states = PassStates(PRIOR)
    for truth in (FAST, SLOW, FAST, SLOW):
        feed(states, truth, 150, rng, noise=0.02)
        curve = states.curve(9)
        assert curve is not None
        assert above_two(curve) == pytest.approx(above_two(truth), abs=0.03)  # 8 tokens: fast 1.29, slow 1.06
    assert len(states.states) == 2  # coming back to a state finds it, noise starts none


def test_a_state_is_recognised_within_a_few_passes() -> None:
    rng = random.Random(1)
    states = PassStates(PRIOR)
    feed(states, FAST, 80, rng)
    feed(states, SLOW, 80, rng)
    fast, slow = states.states
    feed(states, FAST, 3, rng)
    assert states.current is fast  # a few passes back and the fast state is current again
    feed(states, SLOW, 3, rng)
    assert states.current is slow


def test_one_odd_pass_starts_no_state() -> None:
    states = PassStates(PRIOR)
    for n in (3, 5, 4, 3, 5, 4, 3, 5, 4):
        states.observe(n, FAST[n])
    states.observe(5, FAST[5] * 1.4)  # a pass the OS interrupted
    states.observe(4, FAST[4])
    assert len(states.states) == 1 and states.states[0].times[5] < FAST[5] * 1.03  # it pulled by a capped step


def test_an_untimed_size_follows_the_prior_from_the_nearest_timed_one() -> None:
    states = PassStates(PRIOR)
    states.observe(4, 0.030)  # a state twice as slow as the prior's, seen at one size only
    curve = states.curve(9)
    assert curve == pytest.approx(PRIOR, rel=1e-6)  # the shape is the prior's until other sizes are timed
    assert states.predict(states.states[0], 8) == pytest.approx(0.030 * PRIOR[8] / PRIOR[4])


def test_a_size_no_state_has_timed_is_learnt_not_taken_for_a_new_state() -> None:
    states = PassStates(PRIOR)
    for n in (2, 3, 2, 3):
        states.observe(n, SLOW[n])
    for n in (9, 8, 9, 8, 2):  # the prior (fast) shape mispredicts these by 13-25%, the state is the same
        states.observe(n, SLOW[n])
    assert len(states.states) == 1
    assert states.predict(states.states[0], 9) == pytest.approx(SLOW[9], rel=0.1)


def test_old_states_give_way_and_a_drift_stays_one_state() -> None:
    states = PassStates(PRIOR, limit=2)
    for scale in (1.0, 1.5, 2.25):  # three levels, each far from the others
        for n in (2, 3, 2, 3, 2, 3, 2, 3):
            states.observe(n, FAST[n] * scale)
    assert len(states.states) == 2 and states.predict(states.states[0], 2) == pytest.approx(FAST[2] * 1.5, rel=0.02)
    drift = PassStates(PRIOR)
    for i in range(200):  # a slow drift (a growing context) stays one state
        drift.observe(3, FAST[3] * (1 + i / 400))
    assert len(drift.states) == 1


def test_bad_settings_are_refused() -> None:
    with pytest.raises(SpecdecError, match="follow"):
        PassStates([1.0, 1.0])
    with pytest.raises(SpecdecError, match="follow"):
        PassStates(PRIOR, tolerance=0)


def test_cost_aware_follow_drafts_further_in_the_flat_state() -> None:
    """Its start-up curve met the fast state; once the rounds show the slow one, the same odds draft further."""
    sched = CostAware(cost_ratio=0.02, momentum=0.05, curve=PRIOR[1:], follow=True)
    sched.calibrate(object())  # the given curve: nothing timed

    def drafted() -> int:
        sched.length()
        n = 0
        while n < sched.max_gamma and sched.keep_drafting(n + 1, 0.75):
            n += 1
        return n

    rng = random.Random(2)

    def rounds(truth: list[float]) -> None:
        for _ in range(150):
            k = rng.randint(1, 8)
            sched.update(RoundStats(k, k // 2, [0.75] * k, 0.0002 * k, truth[k + 1]))

    rounds(FAST)
    steep = drafted()
    assert sched.curve is not None and above_two(sched.curve)[:8] == pytest.approx(above_two(FAST), abs=0.03)
    rounds(SLOW)
    assert above_two(sched.curve)[:8] == pytest.approx(above_two(SLOW), abs=0.03)
    assert drafted() > steep
    rounds(FAST)
    assert drafted() == steep
    fixed = CostAware(cost_ratio=0.02, curve=PRIOR[1:])  # without follow the curve stays the start-up one
    fixed.calibrate(object())
    for _ in range(40):
        fixed.update(RoundStats(4, 2, [0.75] * 4, 0.001, SLOW[5]))
    assert fixed.pass_cost(8) == pytest.approx(PRIOR[8])
