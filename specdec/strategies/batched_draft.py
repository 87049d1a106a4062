"""Draft-model speculation for every slot of a batch at once (`strategy=draft` at generation.batch_size > 1).

The drafter keeps a slot per target slot in its own `BatchEngine`; a round is k drafter passes, each
over every drafting slot's rows (the first also catches each slot up on what it committed since it
last drafted), then the target verifies all slots in its one pass.

How many tokens to draft is chosen per round for the whole batch, where speculation pays: with
per-token acceptance alpha, a round of k drafted tokens commits (1 - alpha^(k+1)) / (1 - alpha)
tokens per slot in expectation, and costs c(1 + k) + k d target passes, c(n) being the measured cost
of a pass in which every slot feeds n tokens (relative to one each) and d a drafter pass against a
target pass, both measured at this batch size at start-up. k maximises their ratio; 0 (no drafting)
wins where the batch already fills the products, which is how speculation turns itself down as the
batch grows. alpha is learnt online over every slot's rounds; while k is 0, a one-token probe every
`probe_every` rounds keeps it current.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from specdec.engine.batch import BatchEngine, Feed, batch_pass_times
from specdec.engine.engine import ForwardOut
from specdec.engine.sampling import read_greedy, sample, warp
from specdec.strategies.base import DecodeState
from specdec.strategies.draft import to_target
from specdec.verify import Proposal, Verdict


@dataclass
class BatchCosts:
    """Start-up measurements at one batch size, in target passes of one token per slot."""

    verify: list[float]  # verify[n]: a target pass with n tokens per slot (verify[1] = 1; index 0 unused)
    draft: float  # a drafter pass with one token per slot

    @classmethod
    def measure(cls, target: BatchEngine, drafter: BatchEngine, longest: int, reps: int = 5) -> BatchCosts:
        t = batch_pass_times(target, list(range(1, longest + 2)), reps=reps)
        d = batch_pass_times(drafter, [1], reps=reps)[1]
        curve = [1.0]
        for n in range(1, longest + 2):  # non-decreasing: a dip is timing noise
            curve.append(max(curve[-1], t[n] / t[1]))
        return cls(curve, d / t[1])

    def round_cost(self, k: int) -> float:
        return self.verify[min(1 + k, len(self.verify) - 1)] + k * self.draft


@dataclass
class BatchedDraft:
    """A `BatchProposer` (strategies/batched.py) drafting chains for every slot with one drafter engine."""

    engine: BatchEngine  # the drafter's
    token_ids: Tensor | None  # (K,) target id of each drafter logit row; None = identity
    target_vocab: int
    costs: BatchCosts
    max_gamma: int = 8
    probe_every: int = 16
    prior_alpha: float = 0.6
    momentum: float = 0.05
    margin: float = 0.05  # the expected gain over not drafting that a round's drafting must promise
    fed: dict[int, list[int]] = field(default_factory=dict)  # what each drafter slot's cache holds
    drafted: dict[int, int] = field(default_factory=dict)  # tokens each slot drafted this round
    _hits: float = 0.0
    _tries: float = 0.0
    _idle: int = 0

    def __post_init__(self) -> None:
        self._hits, self._tries = 4 * self.prior_alpha, 4.0

    @property
    def alpha(self) -> float:
        return self._hits / self._tries

    def length(self) -> int:
        """This round's draft length for every slot: the k that maximises expected tokens per unit cost,
        if that beats not drafting by `margin` (the costs were measured on a short context at start-up,
        and a batch that drafts where it barely pays loses more than it gains when they are optimistic)."""
        a = min(self.alpha, 0.999)
        rate = [(1 - a ** (k + 1)) / (1 - a) / self.costs.round_cost(k) for k in range(self.max_gamma + 1)]
        k = max(range(len(rate)), key=rate.__getitem__)
        return k if rate[k] > (1 + self.margin) * rate[0] else 0

    def _drafting(self, limits: dict[int, int]) -> dict[int, int]:
        """Slots that draft this round and how many tokens each. While no length pays, one slot in turn
        drafts a token every `probe_every` rounds, which keeps alpha current at the cost of a few rows."""
        k = self.length()
        if k == 0:
            self._idle += 1
            if not self.probe_every or self._idle % self.probe_every or not limits:
                return {}
            b = sorted(limits)[(self._idle // self.probe_every) % len(limits)]
            return {b: 1} if limits[b] > 0 else {}
        return {b: min(k, n) for b, n in limits.items() if min(k, n) > 0}

    def start(self, b: int, state: DecodeState, out: ForwardOut, fresh: bool) -> None:
        """Keep what the slot's drafter cache shares with the prompt; the rest is fed lazily, by the first
        round that drafts (its catch-up), so a turn in which drafting never pays costs no drafter prefill."""
        held = [] if fresh else self.fed.get(b, [])
        prompt = state.ids[:-1]
        reuse = 0
        while reuse < min(len(held), len(prompt)) and held[reuse] == prompt[reuse]:
            reuse += 1
        self.engine.rollback(b, min(reuse, self.engine.length(b)))
        self.fed[b] = list(prompt[:reuse])

    def propose(self, states: dict[int, DecodeState]) -> dict[int, Proposal | None]:
        """Chains for the slots that draft this round: one catch-up pass, then one pass per drafted token."""
        limits = {b: min(s.params.max_new_tokens - s.output_len - 1, self.engine.max_len - len(s.ids) - 1)
                  for b, s in states.items()}
        drafting = self._drafting(limits)
        if not drafting:
            return {b: None for b in states}
        feeds = self._catch_up(drafting, states)
        tokens: dict[int, list[int]] = {b: [] for b in drafting}
        probs: dict[int, list[Tensor]] = {b: [] for b in drafting}
        live = dict(drafting)
        while True:
            outs = self.engine.step(feeds)
            picks = self._pick({b: outs[b].logits[-1] for b in live}, states, probs)
            for b, tok in picks.items():
                tokens[b].append(tok)
            live = {b: n for b, n in live.items() if len(tokens[b]) < n}
            if not live:
                break
            feeds = {b: self._follow(b, tokens[b][-1], outs[b]) for b in live}
        self.drafted = {b: len(t) for b, t in tokens.items()}
        return {b: Proposal(torch.tensor(tokens[b]), list(range(len(tokens[b]))),
                            torch.stack(probs[b]) if probs[b] else None) if b in drafting else None
                for b in states}

    def _catch_up(self, drafting: dict[int, int], states: dict[int, DecodeState]) -> dict[int, Feed]:
        """What each drafting slot committed since it last drafted (at least the root); logits of the last."""
        feeds = {}
        for b in drafting:
            new = states[b].ids[len(self.fed[b]):]
            feeds[b] = Feed(torch.tensor(new), logits_from=len(new) - 1)
            self.fed[b] = list(states[b].ids)
        return feeds

    def _follow(self, b: int, token: int, out: ForwardOut) -> Feed:
        """The feed after drafting `token` (out: the pass that drafted it)."""
        self.fed[b].append(token)
        return Feed(torch.tensor([token]))

    def _pick(self, rows: dict[int, Tensor], states: dict[int, DecodeState],
              probs: dict[int, list[Tensor]]) -> dict[int, int]:
        """Each slot's next draft token from its drafter row: argmax (one read for all) at temperature 0,
        else a sample from q, the drafter's distribution warped like the target's (kept for verification)."""
        sp = next(iter(states.values())).params.sampling
        if sp.greedy:
            stacked = torch.stack(list(rows.values()))  # (S, V_d)
            if self.token_ids is None:
                stacked = stacked[:, :self.target_vocab]
            ids = read_greedy(stacked)[0]
            if self.token_ids is not None:
                ids = self.token_ids[torch.tensor(ids, device=self.token_ids.device)].tolist()
            return dict(zip(rows, ids))
        out = {}
        for b, row in rows.items():
            q = warp(to_target(row, self.token_ids, self.target_vocab), sp)
            out[b] = sample(q, states[b].generator)
            probs[b].append(q)
        return out

    def commit(self, b: int, state: DecodeState, verdict: Verdict, out: ForwardOut) -> None:
        fed = self.fed[b]
        k = self.drafted.pop(b, 0)
        if k:
            self._learn(k, len(verdict.nodes))
        keep = 0
        limit = min(len(fed), len(state.ids))
        while keep < limit and fed[keep] == state.ids[keep]:
            keep += 1
        if keep < len(fed):
            self.engine.rollback(b, keep)
            del fed[keep:]

    def _learn(self, k: int, accepted: int) -> None:
        """A chain of k drafted tokens with `accepted` accepted: accepted successes out of the tokens tried
        (the first rejected one included; none after it)."""
        m = self.momentum
        self._hits = (1 - m) * self._hits + m * accepted
        self._tries = (1 - m) * self._tries + m * min(accepted + 1, k)
