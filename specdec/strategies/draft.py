"""Draft-model speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

A small draft model with its own KV cache proposes a chain of tokens autoregressively; the shared
loop scores them with one target pass and keeps the longest accepted prefix (greedy match at
temperature 0, speculative sampling otherwise). The draft is either a `LoadedModel` sharing the
target's tokenizer, or a trained drafter from `heads/` (reached through its config, see `TrainedDraft`).

How many tokens to draft is a `DraftSchedule`: a fixed gamma, transformers' heuristic, a static
confidence threshold, or `CostAware`, which stops when one more token is expected to cost more
than it returns (calibrated acceptance odds against the measured draft/target cost ratio).
`SitOut` wraps any of them and drafts nothing while drafting measurably loses time.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from specdec.engine.batch import BatchEngine
from specdec.engine.engine import Engine, ForwardOut, StaticEngine, pass_cost_curve
from specdec.engine.kv_cache import KVCache
from specdec.engine.sampling import sample, warp
from specdec.engine.timing import clock
from specdec.errors import SpecdecError
from specdec.models.loader import LoadedModel, check_same_tokenizer
from specdec.ngram import as_tokens
from specdec.strategies.base import DecodeState, Proposer, SpeculativeStrategy, make_engine
from specdec.strategies.batched import BatchProposer
from specdec.strategies.rate import RateMeter, SitOutGate
from specdec.verify import Proposal, Verdict

# --------------------------------------------------------------------------------------------------
# Drafters
# --------------------------------------------------------------------------------------------------


class DraftNet(Protocol):
    """A trained drafter bound to its target: the compact model's call signature over its own cache.

    Its output rows may be a reduced vocabulary; `token_ids` maps row i to the target's token id.
    """

    token_ids: Tensor | None  # (K,) target id of each logit row; None when rows are target ids
    device: torch.device

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache: ...

    def __call__(self, tokens: Tensor, positions: Tensor, cache: KVCache, mask: Tensor | None = None,
                 logits_from: int = 0) -> tuple[Tensor, Tensor]: ...

    def hf_model(self) -> Any: ...


class TrainedDraft(Protocol):
    """What a trained drafter's config builds (e.g. `heads.draft_model.load_draft`).

    `bind` checks that it was trained for this target (one-line SpecdecError otherwise) and returns
    the network, sharing the target's frozen tensors where it reuses them.
    """

    def bind(self, target: LoadedModel) -> DraftNet: ...


@dataclass
class Drafter:
    """A draft model as the proposer uses it: an engine over its own cache and the id mapping."""

    engine: Engine
    token_ids: Tensor | None  # (K,) target id of each draft logit row; None = identity
    target_vocab: int  # width of the distributions handed to the verifier
    hf: Any  # zero-argument callable: the draft as a transformers model (hf_assisted)

    @classmethod
    def build(cls, draft: LoadedModel | TrainedDraft, target: LoadedModel, max_len: int,
              prefill_chunk: int) -> Drafter:
        if isinstance(draft, LoadedModel):
            check_same_tokenizer(target, draft)
            if draft.device != target.device:  # its q meets the target's p and the loop's generator
                raise SpecdecError(f"draft {draft.name} is on {draft.device} but target {target.name} on "
                                   f"{target.device}; give the draft the target's device (strategy.draft.device)")
            return cls(make_engine(draft, max_len, prefill_chunk), None, target.vocab_size, draft.hf_model)
        if not hasattr(draft, "bind"):
            raise SpecdecError(f"strategy.draft builds a {type(draft).__name__}, which is neither a model "
                               "(specdec.models.load_model) nor a trained drafter with bind(target)")
        net = draft.bind(target)
        token_ids = None if net.token_ids is None else net.token_ids.to(net.device)
        # a trained draft is a compact model too: it runs compiled wherever the target does
        compiled = target.compile and getattr(net, "fused", None) is None
        engine = StaticEngine(net, max_len, prefill_chunk, compile=compiled)
        return cls(engine, token_ids, target.vocab_size, net.hf_model)


def pick_two(logits: Tensor, token_ids: Tensor | None,
             target_vocab: int) -> tuple[tuple[int, float], tuple[int, float]]:
    """A drafter's first and second choices over its rows (V_d,) as target ids, with their probabilities."""
    if token_ids is None:
        logits = logits[:target_vocab]
    if logits.device.type == "cpu":  # numpy: cheaper here than torch's few small ops (a scratch timing)
        x = logits.float().numpy()
        e = np.exp(x - x.max())  # (V_d,) unnormalised, 1 at the top
        first = int(e.argmax())
        total = float(e.sum())
        e[first] = -1.0
        second = int(e.argmax())
        rows, p = [first, second], [1.0 / total, float(e[second]) / total]
        toks = rows if token_ids is None else [int(token_ids[r]) for r in rows]
        return (toks[0], p[0]), (toks[1], p[1])
    probs = torch.softmax(logits.float(), -1)  # (V_d,) over the draft's own rows: cheap when reduced
    top = probs.topk(2)
    toks = top.indices.tolist() if token_ids is None else token_ids[top.indices].tolist()
    p = top.values.tolist()
    return (toks[0], p[0]), (toks[1], p[1])


def to_target(logits: Tensor, token_ids: Tensor | None, target_vocab: int) -> Tensor:
    """Drafter logits (V_d,) -> logits over the target vocabulary (V_t,), -inf where it never proposes."""
    logits = logits.float()
    if token_ids is not None:
        full = logits.new_full((target_vocab,), float("-inf"))
        return full.index_copy(0, token_ids, logits)
    if len(logits) >= target_vocab:  # padded embedding rows beyond the target's ids
        return logits[:target_vocab]
    return torch.cat([logits, logits.new_full((target_vocab - len(logits),), float("-inf"))])


# --------------------------------------------------------------------------------------------------
# Draft-length schedules (persistent across turns, like transformers' "heuristic")
# --------------------------------------------------------------------------------------------------


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
    `siblings` caps the branches per round (0: chains only).

    Given an engine (`calibrate`, as the strategies do), v is not one slope but the marginal cost read
    off the target's pass-cost curve, measured at start-up: on a CPU a pass over 2 or 3 tokens costs
    about what one does and each token after that a little more, so a second token or a sibling beside a
    one-token chain is nearly free while the fifth is not. The curve also turns each round's measured
    target time into a one-token step for c. Without an engine both come from the online fit.
    """

    reads_times = True

    def __init__(self, max_gamma: int = 12, cost_ratio: float = 0.1, verify_cost: float = 0.1,
                 bins: int = 10, prior_weight: float = 4.0, momentum: float = 0.05, siblings: int = 0) -> None:
        if max_gamma < 1 or cost_ratio < 0 or verify_cost < 0 or bins < 1 or not 0 < momentum <= 1 or siblings < 0:
            raise SpecdecError("strategy.schedule: max_gamma >= 1, cost_ratio >= 0, verify_cost >= 0, bins >= 1, "
                               "momentum in (0, 1] and siblings >= 0 are required")
        self.max_gamma = max_gamma
        self.max_siblings = siblings
        self.cost = cost_ratio  # c
        self.verify_cost = verify_cost  # v
        self.momentum = momentum
        # Calibration counts per confidence bin, the bin's center as prior: host floats, as the confidences
        # they are read with (a tensor here would be one more thing to keep on the target's device).
        self.hits = [(b + 0.5) / bins * prior_weight for b in range(bins)]
        self.tries = [float(prior_weight)] * bins
        self.second_hits = list(self.hits)  # the same calibration for the drafter's second choices
        self.second_tries = list(self.tries)
        self.rate = 1.0  # R: tokens per unit, autoregressive to start with
        self._chain = 1.0
        self._moments: list[float] | None = None  # running E[n], E[t], E[n^2], E[n t] of target passes
        self.curve: list[float] | None = None  # curve[n]: a pass over n tokens in one-token passes (n >= 1)

    def calibrate(self, engine: Engine) -> None:
        longest = min(self.max_gamma + self.max_siblings + 1, 16)  # timing every size up to a long cap is slow
        measured = pass_cost_curve(engine, list(range(2, longest + 1)))
        curve = [1.0, 1.0]
        for n in range(2, longest + 1):  # non-decreasing: a dip is timing noise, not a cheaper pass
            curve.append(max(curve[-1], measured[n]))
        self.curve = curve

    def verify_step(self, n: int) -> float:
        """What one more token adds to a target pass over n tokens, in one-token passes."""
        if self.curve is None:
            return self.verify_cost
        last = len(self.curve) - 1
        if n >= last:  # past the measured sizes: the last measured step
            return self.curve[last] - self.curve[last - 1]
        return self.curve[n + 1] - self.curve[n]

    def pass_cost(self, n: int) -> float:
        """A target pass over n tokens, in one-token passes."""
        if self.curve is None:
            return 1 + self.verify_cost * (n - 1)
        last = len(self.curve) - 1
        return self.curve[min(n, last)] + max(0, n - last) * self.verify_step(last)

    def _bin(self, p: float) -> int:
        return min(int(p * len(self.tries)), len(self.tries) - 1)

    def accept_prob(self, confidence: float) -> float:
        b = self._bin(confidence)
        return self.hits[b] / self.tries[b]

    def second_prob(self, second: float) -> float:
        b = self._bin(second)
        return self.second_hits[b] / self.second_tries[b]

    def length(self) -> int:
        self._chain = 1.0
        return self.max_gamma

    def keep_drafting(self, drafted: int, confidence: float) -> bool:
        a = self.accept_prob(confidence)
        self._chain *= a
        return self._chain * a > self.rate * (self.cost + self.verify_step(1 + drafted))

    def branches(self, confidences: list[float], seconds: list[float], room: int) -> list[int]:
        out: list[int] = []
        reach = 1.0  # P(every chain token before this depth accepted)
        for depth, (conf, second) in enumerate(zip(confidences, seconds)):
            if len(out) == min(self.max_siblings, room):
                break
            if reach * self.second_prob(second) > self.rate * self.verify_step(1 + len(confidences) + len(out)):
                out.append(depth)
            reach *= self.accept_prob(conf)
        return out

    def update(self, stats: RoundStats) -> None:
        for i, conf in enumerate(stats.confidences[:stats.accepted + 1]):  # after the first rejection: untested
            b = self._bin(conf)
            self.tries[b] += 1
            self.hits[b] += float(i < stats.accepted)
        for second, hit in stats.seconds:
            b = self._bin(second)
            self.second_tries[b] += 1
            self.second_hits[b] += float(hit)
        m = self.momentum
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


# --------------------------------------------------------------------------------------------------
# Proposer and strategy
# --------------------------------------------------------------------------------------------------


@dataclass
class ChainRound:
    """One round of chain drafting under a schedule, and what the schedule learns from it.

    Shared by every proposer that drafts a chain from a drafter's logits (a draft model, an EAGLE-style
    drafter): greedy picks at temperature 0; at temperature > 0 samples from q, the drafter's
    distribution warped like the target's p, kept for speculative sampling. At temperature 0 the
    schedule may add the drafter's second choices as siblings of chain tokens (`DraftSchedule.branches`):
    the proposal is then a small token tree, verified by greedy match like any tree (lossless); the
    drafter's cache follows whichever path the target accepted (the proposers' commit compares ids).
    """

    schedule: DraftSchedule
    token_ids: Tensor | None  # (K,) target id of each drafter logit row; None = identity
    target_vocab: int
    confidences: list[float] = field(default_factory=list)
    seconds: list[tuple[int, float]] = field(default_factory=list)  # (token, probability) of second choices
    drafted: int = 0
    siblings: int = 0
    room: int = 0
    draft_s: float = 0.0
    proposed_at: float = 0.0
    device: torch.device | None = None  # where drafter and target run: their times are read after a sync

    def now(self) -> float:
        """The clock for the round's times: synchronised with the device (a host read per round) only
        for schedules that read the times; the others record a host clock for the results alone."""
        return clock(self.device) if self.schedule.reads_times else time.perf_counter()

    def max_tokens(self, state: DecodeState, room: int) -> int:
        """How many tokens this round may draft: the schedule's, within the budget and the cache room."""
        budget = state.params.max_new_tokens - state.output_len - 1  # the target adds one token itself
        k_max = min(self.schedule.length(), budget, room)
        self.room = room
        if k_max < 1:
            self.drafted = 0
        return k_max

    def draft(self, logits: Tensor, step: Callable[[int | Tensor], Tensor], k_max: int, state: DecodeState,
              t0: float) -> Proposal:
        """Draft from `logits` (the drafter's row for the next token); `step(token)` feeds a drafted token
        (a host int, or a (1,) device tensor when drafting on the device) and returns the row after it.
        `t0`: when the round started, for the measured draft cost.

        An adaptive schedule reads the drafter's probabilities after every drafted token: one host read
        per drafted token. Greedy drafting under a schedule that does not (`reads_draft_probs`) makes
        none: see `draft_on_device`."""
        sp = state.params.sampling
        if sp.greedy and not self.schedule.reads_draft_probs:
            return self.draft_on_device(logits, step, k_max, t0)
        tokens: list[int] = []
        probs: list[Tensor] = []
        self.confidences = []
        self.seconds = []
        while True:
            if sp.greedy:
                (tok, conf), second = pick_two(logits, self.token_ids, self.target_vocab)
                self.seconds.append(second)
            else:
                q = warp(to_target(logits, self.token_ids, self.target_vocab), sp)  # (V_t,) warped like p
                tok = sample(q, state.generator)
                conf = float(q.max())
                probs.append(q)
            tokens.append(tok)
            self.confidences.append(conf)
            if len(tokens) == k_max or not self.schedule.keep_drafting(len(tokens), conf):
                break
            logits = step(tok)
        self.drafted = len(tokens)
        parents = list(range(len(tokens)))
        if sp.greedy:  # siblings: second choices beside chain tokens (node j + 1 has parent j)
            depths = self.schedule.branches(self.confidences, [p for _, p in self.seconds],
                                            self.room - len(tokens))
            tokens += [self.seconds[d][0] for d in depths]
            parents += depths
        self.siblings = len(tokens) - self.drafted
        self.proposed_at = self.now()
        self.draft_s = self.proposed_at - t0
        # the ids are host ints already (pick_two / sample read them); q stays on the drafter's device
        return Proposal(tokens=as_tokens(tokens), parents=parents, probs=torch.stack(probs) if probs else None)

    def draft_on_device(self, logits: Tensor, step: Callable[[int | Tensor], Tensor], k_max: int,
                        t0: float) -> Proposal:
        """Greedy chain of k_max tokens without reading the device: each choice (the first maximum, as
        pick_two's) is fed back as a device tensor; the host learns the tokens with the target's verdict."""
        tokens: list[Tensor] = []
        for i in range(k_max):
            row = logits if self.token_ids is not None else logits[:self.target_vocab]
            top = row.argmax(-1, keepdim=True)  # (1,)
            tokens.append(top if self.token_ids is None else self.token_ids[top])
            if i + 1 < k_max:
                logits = step(tokens[-1])
        self.drafted, self.siblings = k_max, 0
        self.confidences, self.seconds = [1.0] * k_max, []  # unread: the schedule does not use them
        self.proposed_at = self.now()
        self.draft_s = self.proposed_at - t0
        return Proposal(tokens=torch.cat(tokens), parents=list(range(k_max)))

    def learn(self, verdict: Verdict) -> None:
        """After verification (call first in commit: the time since `draft` is the target's pass)."""
        if self.drafted:
            target_s = self.now() - self.proposed_at
            accepted = 0
            while accepted < len(verdict.nodes) and verdict.nodes[accepted] == accepted + 1:
                accepted += 1
            # verdict.tokens[d] is the target's token at depth d for every depth the path reached
            reached = min(accepted + 1, self.drafted, len(self.seconds))
            seconds = tuple((p, tok == verdict.tokens[d]) for d, (tok, p) in enumerate(self.seconds[:reached]))
            self.schedule.update(RoundStats(
                self.drafted, accepted, self.confidences, self.draft_s, target_s, self.siblings,
                len(verdict.nodes) > accepted, seconds))
            self.drafted = 0


@dataclass
class DraftProposer:
    """Drafts a chain with the draft's own cache; rolls that cache back to the committed prefix.

    The draft cache holds `fed`, a prefix of the sequence plus possibly drafted tokens; each round
    first feeds the committed tokens it has not seen (the root, and after a full acceptance the
    last drafted token too), then drafts one token per draft step.
    """

    drafter: Drafter
    round: ChainRound
    fed: list[int] = field(default_factory=list)

    def start(self, state: DecodeState, out: ForwardOut) -> None:
        self.fed = list(state.ids[:-1])  # the prompt; the first generated token is fed with the first draft
        self.drafter.engine.prefill(self.fed)

    def propose(self, state: DecodeState) -> Proposal | None:
        t0 = self.round.now()
        engine = self.drafter.engine
        k_max = self.round.max_tokens(state, engine.max_len - len(state.ids))  # the target pass needs k slots
        if k_max < 1:
            return None

        def feed(tokens: list[int] | Tensor) -> Tensor:
            if isinstance(tokens, Tensor):  # a token drafted on the device: its id is learnt at commit
                out = engine.forward(tokens)
                self.fed += [UNREAD] * len(tokens)
            else:
                out = engine.forward(torch.tensor(tokens, device=_device(engine)))
                self.fed += tokens
            return out.logits[-1]

        return self.round.draft(feed(state.ids[len(self.fed):]),
                                lambda tok: feed(tok if isinstance(tok, Tensor) else [tok]), k_max, state, t0)

    def commit(self, state: DecodeState, verdict: Verdict, out: ForwardOut) -> None:
        self.round.learn(verdict)
        # drafted tokens fed unread sit at the end of `fed`, in chain order from the first one; the
        # accepted ones are now in state.ids at the same positions, the rest are rolled back below
        first = self.fed.index(UNREAD) if UNREAD in self.fed else len(self.fed)
        for j in range(first, min(first + len(verdict.nodes), len(self.fed), len(state.ids))):
            self.fed[j] = state.ids[j]
        keep = 0
        limit = min(len(self.fed), len(state.ids))
        while keep < limit and self.fed[keep] == state.ids[keep]:
            keep += 1
        if keep < len(self.fed):
            self.drafter.engine.rollback(keep)
            del self.fed[keep:]


UNREAD = -1  # a drafted token fed from the device, its id not read yet


def _device(engine: Engine) -> torch.device:
    return getattr(engine, "device", torch.device("cpu"))


class DraftStrategy(SpeculativeStrategy):
    """Draft-model speculative decoding on our engine; `draft` is a model config or a trained drafter."""

    def __init__(self, target: LoadedModel, name: str, draft: LoadedModel | TrainedDraft,
                 schedule: DraftSchedule | None = None, max_len: int = 2048, prefill_chunk: int = 512) -> None:
        super().__init__(target, name, max_len, prefill_chunk)
        self.drafter = Drafter.build(draft, target, max_len, prefill_chunk)
        self.schedule = schedule if schedule is not None else FixedLength()
        self.schedule.calibrate(self.engine)
        self.last_proposer: DraftProposer | None = None

    def engines(self) -> list[Engine]:
        return [self.engine, self.drafter.engine]  # the draft's cache reuses the prompt's prefix too

    batchable = True  # through its own batched proposer (strategies/batched_draft.py)

    def batch_proposer(self, engine: BatchEngine) -> BatchProposer:
        from specdec.strategies.batched_draft import BatchCosts, BatchedDraft

        if not isinstance(self.drafter.engine, StaticEngine):
            raise SpecdecError("batched drafting needs a compact-model draft (model.backend=compact); run "
                               "this draft with generation.batch_size=1")
        drafter = BatchEngine(self.drafter.engine.model, engine.batch, engine.max_len, engine.prefill_chunk)
        longest = min(getattr(self.schedule, "max_gamma", 8), 8)
        return BatchedDraft(drafter, self.drafter.token_ids, self.drafter.target_vocab,
                            BatchCosts.measure(engine, drafter, longest), max_gamma=longest)

    def make_proposer(self) -> Proposer:
        self.last_proposer = DraftProposer(
            self.drafter, ChainRound(self.schedule, self.drafter.token_ids, self.drafter.target_vocab,
                                     device=self.engine.device))
        return self.last_proposer
