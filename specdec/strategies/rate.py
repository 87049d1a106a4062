"""When a drafter should sit out: its measured rate against a plain one-token step's.

A speculative round costs a target pass over 1 + k tokens plus the drafting, and yields 1 + accepted
tokens; a plain step costs one one-token pass and yields one. Where a drafter's guesses keep failing
(prose for a draft trained mostly on code and math, say) its rounds yield fewer tokens per unit of
time than plain steps, and the best it can do is not draft at all. `RateMeter` measures that rate
over the drafter's own rounds; `SitOutGate` lets the drafter draft only while the rate beats a plain
step's, plus a probe round now and then so that the meter can see the text turn its way again.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RateMeter:
    """Running tokens per unit of cost (one unit: a one-token target pass) of a drafter's rounds.

    Kept by the strategy, so it carries over between turns like the draft-length schedules do.
    """

    rate: float = 1.0
    momentum: float = 0.05

    def update(self, produced: int, draft_s: float, target_s: float, pass_cost: float) -> None:
        """A round that produced `produced` tokens, drafted in `draft_s` and verified in `target_s` by a pass
        costing `pass_cost` one-token passes."""
        if target_s <= 0:
            return
        one_step = target_s / pass_cost  # the seconds of a one-token pass, from this pass's time
        units = (draft_s + target_s) / one_step
        self.rate = (1 - self.momentum) * self.rate + self.momentum * produced / units


@dataclass
class SitOutGate:
    """Open while the meter's rate is at least a plain step's (1), else once every `probe_every` closed rounds.

    Call `open()` once per round, and `record` after each round the drafter drafted.
    """

    meter: RateMeter = field(default_factory=RateMeter)
    probe_every: int = 8
    # pass over n tokens / pass over one, from pass_cost_curve; until measured, every pass counts as one step
    costs: dict[int, float] = field(default_factory=lambda: {1: 1.0})
    idle: int = 0  # rounds the drafter sat out since it last drafted

    def record(self, produced: int, drafted: int, draft_s: float, target_s: float) -> None:
        """A round that drafted `drafted` tokens and produced `produced`; drafts longer than the measured
        costs reach are charged the longest one's cost."""
        self.meter.update(produced, draft_s, target_s, self.costs[min(1 + drafted, max(self.costs))])

    def open(self) -> bool:
        if self.meter.rate >= 1.0 or self.idle >= self.probe_every:
            self.idle = 0
            return True
        self.idle += 1
        return False
