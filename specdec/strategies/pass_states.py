"""Pass-cost curves that follow the host's speed: one curve per speed state, fitted from the rounds' own passes.

Some hosts switch between speed states that last seconds or longer, and the shape of the pass-cost curve
differs between them, not only its scale (on the AMD EPYC this project measures on, passes over several
tokens cost relatively more in its faster state; experiments/README.md, "A pass-cost curve that matches the
host's state"). A curve timed once at start-up prices passes for whichever state that timing met.

`PassStates` keeps, per state, the running time of a target pass over each number of tokens n. Single passes
scatter too much to tell states apart, so each state keeps its drift, a running mean of how far it
mispredicted the recent passes. While the current state's drift stays within `tolerance` each pass refines its
times; past it, the passes go to an earlier state whose drift is within tolerance, and when none has one for
`wait` passes, a new state starts, shaped like the last one until its own passes reshape it. Sizes a state
has timed often enough are fitted non-decreasing; the others follow the prior curve (the start-up timing)
from the nearest such size. The schedule prices passes from the current state's curve, relative to its
one-token pass. No extra pass is timed: the schedule already reads each round's target time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specdec.errors import SpecdecError


def curve_at(curve: list[float], n: int) -> float:
    """A pass-cost curve's entry for n tokens (curve[n], n >= 1), extended past its end by its last step."""
    last = len(curve) - 1
    return curve[min(n, last)] + max(0, n - last) * (curve[last] - curve[last - 1])


@dataclass
class SpeedState:
    """One speed state: running seconds of a pass over n tokens, with how many passes each holds."""

    times: dict[int, float] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)
    last_used: int = 0
    drift: float = 0.0  # running mean of log(measured / predicted) over recent passes
    fitted: dict[int, float] = field(default_factory=dict)  # times made non-decreasing (PassStates._fit)


class PassStates:
    """Pass times per speed state, and the current state's pass-cost curve.

    `prior[n]`: a pass over n tokens in one-token passes (prior[0] unused), the shape assumed where a state
    has no timing yet. `momentum`: the weight of a new pass in a size's running log time (a mean over its
    first passes; each pass's pull capped at `tolerance`). `recency`: the weight of the latest pass in each
    state's drift, the running mean of log(measured / predicted). `tolerance`: the largest |drift| of a state
    that still explains the passes. `wait`: passes no state explains before they start a new state (an earlier
    state's drift needs a few passes to come back within tolerance). `limit`: the most states kept (the least
    recently used gives way). `settle`: the passes a size needs before its own time enters the curve.
    """

    def __init__(self, prior: list[float], momentum: float = 0.05, tolerance: float = 0.1, recency: float = 0.25,
                 wait: int = 4, limit: int = 4, settle: int = 5) -> None:
        if len(prior) < 3 or not 0 < momentum <= 1 or not 0 < recency <= 1 or tolerance <= 0 or wait < 1 or \
                limit < 1 or settle < 1:
            raise SpecdecError("strategy.schedule follow: a prior curve over 1 and 2 tokens at least, momentum and "
                               "recency in (0, 1], tolerance > 0 and wait, limit and settle >= 1 are required")
        self.prior = prior
        self.momentum = momentum
        self.tolerance = tolerance
        self.recency = recency
        self.wait = wait
        self.limit = limit
        self.settle = settle
        self.states: list[SpeedState] = []
        self.current: SpeedState | None = None
        self.lost = 0  # passes since the current state last explained the recent ones
        self.passes = 0

    def predict(self, state: SpeedState, n: int) -> float:
        """Seconds of a pass over n tokens in `state`: its fitted time, else the nearest fitted size's scaled by
        the prior curve."""
        if n in state.fitted:
            return state.fitted[n]
        m = min(state.fitted, key=lambda k: (abs(k - n), k))
        return state.fitted[m] * curve_at(self.prior, n) / curve_at(self.prior, m)

    def observe(self, n: int, seconds: float) -> None:
        """A target pass over n tokens took `seconds`."""
        if seconds <= 0 or n < 1:
            return
        self.passes += 1
        if self.current is None:
            self.current = self._new(n, seconds)
            return
        for s in self.states:  # each state's recent bias: single passes scatter too much to judge by
            s.drift = (1 - self.recency) * s.drift + self.recency * math.log(seconds / self.predict(s, n))
        now = self.current
        if abs(now.drift) <= self.tolerance:
            self.lost = 0
            self._add(now, n, seconds)
            return
        back = [s for s in self.states if abs(s.drift) <= self.tolerance]
        if back:  # the host went back to a state it was in before
            self.current, self.lost = min(back, key=lambda s: abs(s.drift)), 0
            self._add(self.current, n, seconds)
            return
        self.lost += 1
        if self.lost >= self.wait:  # no state has explained the recent passes: a new one, shaped like the last
            if len(self.states) == self.limit:
                self.states.remove(min(self.states, key=lambda s: s.last_used))
            self.current, self.lost = self._new(n, seconds, now), 0

    def _new(self, n: int, seconds: float, like: SpeedState | None = None) -> SpeedState:
        """A state from this pass; from `like`, its times shifted by its drift are guesses until timed."""
        scale = math.exp(like.drift) if like else 1.0
        state = SpeedState({k: t * scale for k, t in like.times.items()} if like else {},
                           dict.fromkeys(like.times, 0) if like else {})
        self.states.append(state)
        self._add(state, n, seconds)
        return state

    def _add(self, state: SpeedState, n: int, seconds: float) -> None:
        state.last_used = self.passes
        count = state.counts.get(n, 0)  # a mean of the first passes, then a running one, in log time
        step = max(-self.tolerance, min(self.tolerance, math.log(seconds / state.times[n]))) if count else 0.0
        weight = max(self.momentum, 1.0 / (count + 1))  # each pass's pull capped: an interrupted one moves little
        state.times[n] = seconds if count == 0 else state.times[n] * math.exp(weight * step)
        state.counts[n] = count + 1
        self._fit(state)

    def _fit(self, state: SpeedState) -> None:
        """`state.fitted`: its sizes timed `settle` times or more (all, before any is), made non-decreasing by a
        fit weighted by their passes (pool adjacent violators, in log time): a rarely met size's time scatters."""
        sure = sorted(n for n, c in state.counts.items() if c >= self.settle) or sorted(state.times)
        blocks: list[tuple[float, float, list[int]]] = []  # (mean log time, passes, sizes)
        for n in sure:
            block = (math.log(state.times[n]), float(max(state.counts.get(n, 0), 1)), [n])
            while blocks and blocks[-1][0] > block[0]:
                x, w, k = blocks.pop()
                block = ((x * w + block[0] * block[1]) / (w + block[1]), w + block[1], k + block[2])
            blocks.append(block)
        state.fitted = {n: math.exp(x) for x, _, sizes in blocks for n in sizes}

    def curve(self, longest: int) -> list[float] | None:
        """The current state's pass over n = 0..longest tokens in its one-token passes (entry 0 as entry 1);
        None before any pass. The one-token pass, which the rounds never make, follows the prior's shape from
        the state's most timed size."""
        if self.current is None:
            return None
        state = self.current
        base = max(state.fitted, key=lambda n: (state.counts.get(n, 0), -n))
        one = state.fitted[base] * curve_at(self.prior, 1) / curve_at(self.prior, base)
        out = [1.0, 1.0]
        for n in range(2, longest + 1):
            out.append(max(out[-1], self.predict(state, n) / one))
        return out
