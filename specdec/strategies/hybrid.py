"""Copy when the text repeats, draft with a model otherwise: prompt lookup in front of any drafter.

Prompt lookup drafts for free but only where the text repeats itself; a trained drafter costs a
fraction of a target step per token but drafts everywhere. `LookupFirst` asks the lookup first and
lets it draft only when its expected rate (tokens per unit of target-step time, from this turn's
acceptance per match length and the measured pass costs) beats the rate the model drafter has been
achieving; otherwise the model drafts. Both verifications are exact (a copied chain is deterministic,
a model chain carries its q), so the strategy is as lossless as its drafter. Neither part drafts when
it expects fewer tokens per unit of time than a plain one-token step; a model drafter whose measured
rate fell below that sits out, except for a probe round now and then.

The model drafter need not propose in every round, but it commits in every one: the draft and EAGLE
proposers catch up on the committed tokens at their next proposal (EAGLE keeps the pass's hidden states
of them), Medusa's keeps the hidden state of the newest token, and none rolls back what was committed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specdec.engine.engine import Engine, ForwardOut, pass_cost_curve
from specdec.engine.timing import clock
from specdec.errors import SpecdecError
from specdec.models.loader import LoadedModel
from specdec.strategies.base import DecodeState, Proposer, SpeculativeStrategy
from specdec.strategies.prompt_lookup import PromptLookupProposer
from specdec.strategies.rate import RateMeter, SitOutGate
from specdec.verify import Proposal, Verdict


@dataclass
class LookupFirst:
    """A proposer: the lookup's chain when it expects to beat the model drafter's rate, else the model's."""

    lookup: PromptLookupProposer
    model: Proposer
    gate: SitOutGate  # the model drafter's: its measured rate, and whether it may draft this round
    source: str = ""  # who proposed this round: "lookup", "model" or ""
    device: torch.device | None = None  # the target's: times are read once its work has finished
    _t0: float = 0.0
    _proposed_at: float = 0.0
    _drafted: int = 0
    rounds: dict[str, int] = field(default_factory=lambda: {"lookup": 0, "model": 0, "none": 0})

    def start(self, state: DecodeState, out: ForwardOut) -> None:
        self.lookup.start(state, out)
        self.model.start(state, out)

    def propose(self, state: DecodeState) -> Proposal | None:
        # the gate decides from measured times: one synchronisation per round on a GPU
        self._t0 = clock(self.device)
        # a plain one-token step yields 1 token per unit: neither drafter may do worse than that
        self.lookup.floor = max(1.0, self.gate.meter.rate)
        proposal = self.lookup.propose(state)
        self.source = "lookup"
        if proposal is None:
            self.source = ""
            if self.gate.open():  # a model drafter that has been losing time sits out, bar probe rounds
                proposal = self.model.propose(state)
                self.source = "model" if proposal is not None else ""
        self._proposed_at = clock(self.device)
        self._drafted = len(proposal.tokens) if proposal is not None else 0
        self.rounds[self.source or "none"] += 1
        return proposal

    def commit(self, state: DecodeState, verdict: Verdict, out: ForwardOut) -> None:
        if self.source == "model" and self._drafted:
            self.gate.record(len(verdict.tokens), self._drafted, self._proposed_at - self._t0,
                             clock(self.device) - self._proposed_at)
        # both always commit: the lookup indexes the new tokens, the model rolls its cache back to them
        self.lookup.commit(state, verdict, out)
        self.model.commit(state, verdict, out)


class LookupHybrid(SpeculativeStrategy):
    """`strategy=draft_lookup` / `eagle_lookup` / `medusa_lookup`: prompt lookup in front of a drafter's strategy.

    `inner` builds the drafter's strategy (e.g. DraftStrategy); the hybrid uses its engine, its proposer
    and its acceptance rule, so the target's cache and the drafter exist once.
    """

    def __init__(self, target: LoadedModel, name: str, inner: Callable[..., SpeculativeStrategy],
                 max_len: int = 2048, prefill_chunk: int = 512, ngram_max: int = 3, ngram_min: int = 1,
                 num_draft_tokens: int = 7, prior_rate: float = 1.0, probe_every: int = 8) -> None:
        if not 1 <= ngram_min <= ngram_max or num_draft_tokens < 1 or probe_every < 0:
            raise SpecdecError(f"{name} needs 1 <= ngram_min <= ngram_max, num_draft_tokens >= 1 and probe_every "
                               f">= 0, got {ngram_min}, {ngram_max}, {num_draft_tokens}, {probe_every}; "
                               "e.g. strategy.ngram_max=3 strategy.probe_every=8")
        self.inner = inner(target=target, max_len=max_len, prefill_chunk=prefill_chunk)
        if not isinstance(self.inner, SpeculativeStrategy):
            raise SpecdecError(f"strategy.inner builds a {type(self.inner).__name__}; it must be a speculative "
                               "strategy with a proposer, such as specdec.strategies.draft.DraftStrategy")
        # not SpeculativeStrategy.__init__: that would build a second target engine and cache
        self.name, self.target, self.engine = name, target, self.inner.engine
        self.ngram_min, self.ngram_max, self.num_draft_tokens = ngram_min, ngram_max, num_draft_tokens
        # pass costs up to the longer of the two drafts, measured once on this hardware
        self.costs = {1: 1.0, **pass_cost_curve(self.engine, list(range(2, num_draft_tokens + 2)))}
        self.meter = RateMeter(prior_rate)
        self.probe_every = probe_every
        self.last_proposer: LookupFirst | None = None

    def engines(self) -> list[Engine]:
        return self.inner.engines()  # the target's engine is the inner strategy's

    def make_proposer(self) -> Proposer:
        model = self.inner.make_proposer()
        if model is None:
            raise SpecdecError(f"strategy.inner ({self.inner.name}) drafts nothing; give it a drafter")
        lookup = PromptLookupProposer(self.ngram_min, self.ngram_max, self.num_draft_tokens, 1, 1, False,
                                      self.engine.max_len, self.costs)
        self.last_proposer = LookupFirst(lookup, model, SitOutGate(self.meter, self.probe_every, self.costs),
                                        device=self.engine.device)
        return self.last_proposer

    def accept(self, proposal: Proposal, logits: Tensor, state: DecodeState) -> Verdict:
        return self.inner.accept(proposal, logits, state)  # Medusa's typical acceptance stays Medusa's
