"""How many tokens a chain drafter proposes each round: a `DraftSchedule`.

A fixed gamma, transformers' heuristic, a static confidence threshold, or `CostAware`, which stops when one
more token is expected to cost more than it returns (calibrated acceptance odds against the measured
draft/target cost ratio). `SitOut` wraps any of them and drafts nothing while drafting measurably loses time.
Schedules persist across turns, like transformers' "heuristic"; `ChainRound` (strategies/draft.py) feeds them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from specdec.engine.engine import Engine, pass_cost_curve
from specdec.errors import SpecdecError
from specdec.strategies.pass_states import PassStates, curve_at
from specdec.strategies.rate import RateMeter, SitOutGate


@dataclass(frozen=True)
class RoundStats:
    """What a schedule learns from one verified round."""

    drafted: int  # chain tokens drafted
    accepted: int  # leading chain tokens the target accepted
    confidences: list[float]  # the drafter's probability of each chain token
    draft_s: float  # time spent drafting
    target_s: float  # time of the target's pass
    siblings: int = 0  # second choices verified beside the chain (temperature 0)
    sibling_hit: bool = False  # the accepted path ended on a sibling: one token more than `accepted`
    # (the drafter's probability of its second choice, whether the target chose it) at each depth reached
    seconds: tuple[tuple[float, bool], ...] = ()

    @property
    def gained(self) -> int:
        """Drafted tokens committed this round (the target's own token not counted)."""
        return self.accepted + int(self.sibling_hit)

    @property
    def verified(self) -> int:
        """Proposed tokens in the target's pass, besides the root."""
        return self.drafted + self.siblings


class DraftSchedule(ABC):
    """Decides how many tokens the draft proposes; learns from what the target accepted.

    `reads_draft_probs`: whether it looks at the drafter's probabilities while drafting (keep_drafting,
    branches, update's confidences). One that does not lets greedy drafting stay on the device: no
    host read per drafted token, the tokens reaching the host with the target's verdict.
    """

    reads_draft_probs = True
    reads_times = False  # whether update() reads the round's draft and target times (then synchronised)

    @abstractmethod
    def length(self) -> int:
        """The most tokens to draft this round (called once per round; 0: no drafting, a plain step)."""

    def longest(self) -> int:
        """The most tokens any round may draft (a schedule whose length varies overrides this)."""
        return self.length()

    def calibrate(self, engine: Engine) -> None:
        """Called once with the target's engine before any round, for schedules that measure pass costs."""
        return None

    def keep_drafting(self, drafted: int, confidence: float) -> bool:
        """After drafting token number `drafted` whose draft probability was `confidence`."""
        return True

    def branches(self, confidences: list[float], seconds: list[float], room: int) -> list[int]:
        """Depths (0-based) at which the target should also check the drafter's second choice, at
        most `room` of them (temperature 0 only; a schedule that never branches drafts chains)."""
        return []

    def update(self, stats: RoundStats) -> None:
        """After verification: what was drafted and accepted, and the round's times."""
        return None  # fixed schedules learn nothing


class FixedLength(DraftSchedule):
    reads_draft_probs = False

    def __init__(self, gamma: int = 4) -> None:
        if gamma < 1:
            raise SpecdecError(f"strategy.schedule.gamma={gamma} must be at least 1")
        self.gamma = gamma

    def length(self) -> int:
        return self.gamma


class Heuristic(DraftSchedule):
    """transformers' `num_assistant_tokens_schedule="heuristic"`: +2 after a full acceptance, else -1."""

    reads_draft_probs = False

    def __init__(self, gamma: int = 4, max_gamma: int = 32) -> None:
        if not 1 <= gamma <= max_gamma:
            raise SpecdecError(f"strategy.schedule.gamma={gamma} must be in 1..max_gamma={max_gamma}")
        self.gamma = gamma
        self.max_gamma = max_gamma

    def length(self) -> int:
        return self.gamma

    def longest(self) -> int:
        return self.max_gamma

    def update(self, stats: RoundStats) -> None:
        full = stats.accepted == stats.drafted
        self.gamma = min(self.max_gamma, self.gamma + 2) if full else max(1, self.gamma - 1)


class Confidence(DraftSchedule):
    """Stop as soon as the draft's probability of its own token drops below a fixed threshold."""

    def __init__(self, threshold: float = 0.4, max_gamma: int = 8) -> None:
        if not 0 <= threshold < 1 or max_gamma < 1:
            raise SpecdecError(f"strategy.schedule: threshold={threshold} must be in [0, 1) and "
                               f"max_gamma={max_gamma} at least 1")
        self.threshold = threshold
        self.max_gamma = max_gamma

    def length(self) -> int:
        return self.max_gamma

    def keep_drafting(self, drafted: int, confidence: float) -> bool:
        return confidence >= self.threshold


class CostAware(DraftSchedule):
    """Draft one more token only while its expected return beats its cost.

    A round that drafts k tokens costs 1 + k (c + v) units of a one-token target step (c: a draft
    step; v: what one more token adds to the target's verification pass, far from free on a CPU)
    and yields 1 + accepted tokens. Drafting token k+1 adds P(tokens 1..k+1 all accepted) tokens in
    expectation for c + v more cost, so it pays iff that probability exceeds R (c + v), R being the
    rate achieved so far in tokens per unit (Dinkelbach's ratio argument, applied myopically).

    All three are measured online: P from the draft's confidences through a calibration table
    (confidence bin -> accepted fraction, the confidence itself as prior), so an over- or
    under-confident draft is corrected by what the target accepts, the next token's odds being
    predicted from the current token's (confidence is autocorrelated along a chain); c and v from a
    running linear fit of the target pass's time against the tokens it verified (or the curve below),
    and the draft's time per token. `cost_ratio` and `verify_cost` are only the starting guesses.

    At temperature 0 it may also branch: the drafter's second choice at depth j, verified beside the
    chain token, adds one token when the target picks it, which happens with probability P(tokens
    1..j-1 accepted) x P(target picks the second choice), for v more cost and no draft step. So it is
    added iff that beats R v, the second choice's odds calibrated like the chain's (a scratch check found
    the second choice the target's token far less often than the first; experiments/README.md, "Figures
    moved out of code and configs").
    `depths` > 1 keeps a calibration table per chain depth (1, 2, ..., `depths` and deeper), each with the same
    prior: a token reached only after the ones before it were accepted may be surer than its confidence says
    (experiments/schedule_calibration.py measures it).
    `siblings` caps the branches per round (0: chains only). `curve`, when given, replaces the start-up
    measurement: a pass over n = 1, 2, ... tokens in one-token passes (to study a host state the start-up
    timing did not meet; made non-decreasing, and extended past its end by its last step). `follow`: price
    passes from the rounds' own target times instead, one curve per speed state of the host, the start-up
    (or given) curve only where a state has not timed a size (`specdec.strategies.pass_states`).

    Given an engine (`calibrate`, as the strategies do), v is not one slope but the marginal cost read
    off the target's pass-cost curve, measured at start-up: on a CPU a pass over 2 or 3 tokens costs
    about what one does and each token after that a little more, so a second token or a sibling beside a
    one-token chain is nearly free while the fifth is not. The curve also turns each round's measured
    target time into a one-token step for c. Without an engine both come from the online fit.
    """

    reads_times = True

    def __init__(self, max_gamma: int = 12, cost_ratio: float = 0.1, verify_cost: float = 0.1,
                 bins: int = 10, prior_weight: float = 4.0, momentum: float = 0.05, siblings: int = 0,
                 curve: list[float] | None = None, follow: bool = False, depths: int = 1) -> None:
        if (max_gamma < 1 or cost_ratio < 0 or verify_cost < 0 or bins < 1 or not 0 < momentum <= 1 or siblings < 0
                or depths < 1):
            raise SpecdecError("strategy.schedule: max_gamma >= 1, cost_ratio >= 0, verify_cost >= 0, bins >= 1, "
                               "momentum in (0, 1], siblings >= 0 and depths >= 1 are required")
        numbers = curve is not None and not isinstance(curve, str) and all(
            isinstance(c, (int, float)) and not isinstance(c, bool) and c > 0 for c in curve)
        if curve is not None and (not numbers or len(curve) < 2):
            raise SpecdecError(f"strategy.schedule.curve={curve}: give at least two positive pass costs, for 1, "
                               "2, ... tokens in one-token passes (e.g. [1.0,1.07,1.10]), or null to time them")
        self.max_gamma = max_gamma
        self.max_siblings = siblings
        self.bins = bins
        self.cost = cost_ratio  # c
        self.verify_cost = verify_cost  # v
        self.momentum = momentum
        # Calibration counts per chain depth and confidence bin, the bin's center as prior: host floats, as the
        # confidences they are read with (a tensor here would be one more thing to keep on the target's device).
        self.hits = [[(b + 0.5) / bins * prior_weight for b in range(bins)] for _ in range(depths)]
        self.tries = [[float(prior_weight)] * bins for _ in range(depths)]
        self.second_hits = list(self.hits[0])  # the same calibration for the drafter's second choices (one table)
        self.second_tries = list(self.tries[0])
        self.rate = 1.0  # R: tokens per unit, autoregressive to start with
        self._chain = 1.0
        self._moments: list[float] | None = None  # running E[n], E[t], E[n^2], E[n t] of target passes
        self.curve: list[float] | None = None  # curve[n]: a pass over n tokens in one-token passes (n >= 1)
        self.fixed: list[float] | None = None if curve is None else [float(c) / float(curve[0]) for c in curve]
        self.follow = follow
        self.states: PassStates | None = None  # with follow: the host's speed states, from the rounds' passes

    def calibrate(self, engine: Engine) -> None:
        if self.fixed is not None:
            costs = self.fixed[1:]  # passes over 2, 3, ... tokens
        else:
            longest = min(self.max_gamma + self.max_siblings + 1, 16)  # timing every size up to a long cap is slow
            measured = pass_cost_curve(engine, list(range(2, longest + 1)))
            costs = [measured[n] for n in range(2, longest + 1)]
        curve = [1.0, 1.0]
        for c in costs:  # non-decreasing: a dip is timing noise, not a cheaper pass
            curve.append(max(curve[-1], c))
        self.curve = curve
        if self.follow:
            self.states = PassStates(curve)

    def verify_step(self, n: int) -> float:
        """What one more token adds to a target pass over n tokens, in one-token passes."""
        if self.curve is None:
            return self.verify_cost
        return curve_at(self.curve, n + 1) - curve_at(self.curve, n)  # past the measured sizes: their last step

    def pass_cost(self, n: int) -> float:
        """A target pass over n tokens, in one-token passes."""
        if self.curve is None:
            return 1 + self.verify_cost * (n - 1)
        return curve_at(self.curve, n)

    def _bin(self, p: float) -> int:
        return min(int(p * self.bins), self.bins - 1)

    def accept_prob(self, confidence: float, depth: int = 0) -> float:
        """P(the target accepts a chain token at `depth` (0: the first), given the ones before it were)."""
        d, b = min(depth, len(self.tries) - 1), self._bin(confidence)
        return self.hits[d][b] / self.tries[d][b]

    def second_prob(self, second: float) -> float:
        b = self._bin(second)
        return self.second_hits[b] / self.second_tries[b]

    def length(self) -> int:
        self._chain = 1.0
        return self.max_gamma

    def keep_drafting(self, drafted: int, confidence: float) -> bool:
        self._chain *= self.accept_prob(confidence, drafted - 1)
        a = self.accept_prob(confidence, drafted)  # the next token's odds, read off this one's confidence
        return self._chain * a > self.rate * (self.cost + self.verify_step(1 + drafted))

    def branches(self, confidences: list[float], seconds: list[float], room: int) -> list[int]:
        out: list[int] = []
        reach = 1.0  # P(every chain token before this depth accepted)
        for depth, (conf, second) in enumerate(zip(confidences, seconds)):
            if len(out) == min(self.max_siblings, room):
                break
            if reach * self.second_prob(second) > self.rate * self.verify_step(1 + len(confidences) + len(out)):
                out.append(depth)
            reach *= self.accept_prob(conf, depth)
        return out

    def update(self, stats: RoundStats) -> None:
        for i, conf in enumerate(stats.confidences[:stats.accepted + 1]):  # after the first rejection: untested
            d, b = min(i, len(self.tries) - 1), self._bin(conf)
            self.tries[d][b] += 1
            self.hits[d][b] += float(i < stats.accepted)
        for second, hit in stats.seconds:
            b = self._bin(second)
            self.second_tries[b] += 1
            self.second_hits[b] += float(hit)
        m = self.momentum
        if self.states is not None and self.curve is not None and stats.target_s > 0:
            self.states.observe(1 + stats.verified, stats.target_s)
            self.curve = self.states.curve(len(self.curve) - 1) or self.curve
        if stats.drafted and stats.target_s > 0:
            step = self._one_token_step(stats.verified + 1, stats.target_s)
            self.cost = (1 - m) * self.cost + m * (stats.draft_s / stats.drafted) / step
        units = stats.drafted * self.cost + self.pass_cost(1 + stats.verified)
        self.rate = (1 - m) * self.rate + m * (1 + stats.gained) / units

    def _one_token_step(self, n: int, t: float) -> float:
        """The one-token step time implied by a target pass over n tokens that took t seconds: from the
        measured pass-cost curve when there is one (it tied the fit below on both held-apart sets;
        experiments/README.md, "One call per pass, int8 drafter weights"), else from a fit t = a + b n
        over recent passes, which also updates
        v = b / (a + b) (the prior v while n has not varied enough)."""
        if self.curve is not None:
            return t / self.pass_cost(n)
        m = self.momentum
        x = [n, t, n * n, n * t]
        self._moments = x if self._moments is None else [(1 - m) * u + m * w for u, w in zip(self._moments, x)]
        mn, mt, mnn, mnt = self._moments
        var = mnn - mn * mn
        if var > 0.25:  # lengths vary by about a token or more: the slope is identifiable
            slope = max(0.0, (mnt - mn * mt) / var)
            step = mt - slope * (mn - 1)
            if step > 0:
                self.verify_cost = min(1.0, slope / step)
                return step
        return t / (1 + self.verify_cost * (n - 1))


class SitOut(DraftSchedule):
    """`inner`'s schedule, but no drafting at all while the drafter's rounds lose time (`specdec.strategies.rate`).

    A sat-out round is a plain one-token step and does not run the drafter; its cache catches up on the
    skipped tokens in one pass when it next drafts. That saves what `inner` cannot: the drafting itself
    and the verification's extra cost, where every guess is likely wrong. The rate counts the round's
    tokens against its measured time in one-token target passes (pass costs measured at start-up).
    """

    def __init__(self, inner: DraftSchedule, probe_every: int = 8, prior_rate: float = 1.0,
                 momentum: float = 0.05) -> None:
        if probe_every < 0 or prior_rate <= 0 or not 0 < momentum <= 1:
            raise SpecdecError(f"strategy.schedule: probe_every={probe_every} must be >= 0, prior_rate={prior_rate} "
                               f"> 0 and momentum={momentum} in (0, 1]; e.g. probe_every=8 prior_rate=1.0")
        self.inner = inner
        self.reads_draft_probs, self.reads_times = inner.reads_draft_probs, True
        self.gate = SitOutGate(RateMeter(prior_rate, momentum), probe_every)

    def calibrate(self, engine: Engine) -> None:
        self.inner.calibrate(engine)
        # longer drafts than 16 are charged as 16: timing every size up to a long cap costs start-up time
        longest = min(self.inner.longest(), 16)
        self.gate.costs = {1: 1.0, **pass_cost_curve(engine, list(range(2, longest + 2)))}

    def length(self) -> int:
        return self.inner.length() if self.gate.open() else 0

    def keep_drafting(self, drafted: int, confidence: float) -> bool:
        return self.inner.keep_drafting(drafted, confidence)

    def branches(self, confidences: list[float], seconds: list[float], room: int) -> list[int]:
        return self.inner.branches(confidences, seconds, room)

    def update(self, stats: RoundStats) -> None:
        self.inner.update(stats)
        self.gate.record(1 + stats.gained, stats.verified, stats.draft_s, stats.target_s)
