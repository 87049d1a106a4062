"""EAGLE-style drafting (Li et al. 2024): a drafter that reads the target's own features.

The drafter (heads/eagle.py) turns the pair (target hidden state h_t, token x_{t+1}) into a guess of
h_{t+1} and of the token after. Every target pass already returns the hidden states of the tokens it
verified, so the drafter first catches up on the pairs the last pass made known (real features), then
drafts a chain by feeding back its own guessed features. The shared loop verifies the chain like any
draft: greedy match at temperature 0, speculative sampling with the drafter's q otherwise, so the
output is exactly the target's either way. How many tokens to draft is a `DraftSchedule`.

The drafter's cache is indexed by pair: slot j holds (h_j, x_{j+1}) at position j. Slots built on real
target features are kept; those built on guessed features are rolled back after each round.
At generation.batch_size > 1 one drafter drafts for every slot at once (strategies/batched_eagle.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch import Tensor

from specdec.engine.batch import BatchEngine
from specdec.engine.engine import ForwardOut
from specdec.engine.kv_cache import KVCache
from specdec.engine.static_step import BUCKETS, StaticStep
from specdec.errors import SpecdecError
from specdec.models.cpu_drafter import DrafterPass
from specdec.models.cpu_layer import FUSED_ROWS
from specdec.strategies.base import DecodeState, Proposer, SpeculativeStrategy
from specdec.strategies.draft import ChainRound
from specdec.strategies.request_rows import RequestRows, output_rows
from specdec.strategies.schedules import Confidence, DraftSchedule
from specdec.verify import Proposal, Verdict

if TYPE_CHECKING:
    from specdec.strategies.batched import BatchProposer


class EagleDraftNet(Protocol):
    """A bound drafter: (B, T) tokens and (B, T, D) features at (B, T) positions -> logits over its rows
    (B, T - logits_from, K) and guessed next features (B, T, D), appending to its own cache."""

    token_ids: Tensor | None  # (K,) target id of each logit row; None when rows are target ids
    device: torch.device

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache: ...

    def __call__(self, tokens: Tensor, features: Tensor, positions: Tensor, cache: KVCache,
                 mask: Tensor | None = None, logits_from: int = 0) -> tuple[Tensor, Tensor]: ...


class TrainedEagle(Protocol):
    """What configs/strategy/eagle.yaml builds (heads.eagle.load_eagle): checks and binds to a target."""

    def bind(self, target: Any) -> EagleDraftNet: ...


@dataclass
class EagleProposer:
    net: EagleDraftNet
    cache: KVCache
    round: ChainRound
    fed: int = 0  # pairs in the cache built on the target's real features
    pending: Tensor | None = None  # (n, D) target features of pairs fed.. not yet in the cache
    static: StaticStep | None = None  # the drafter's compiled static-shape step, when the target compiles
    kernel: DrafterPass | None = None  # the drafter's pass as one call, when it runs on the CPU kernels
    rows: RequestRows | None = None  # the request's own tokens scored beside the kept rows (request_rows)
    seen: int = 0  # tokens of the sequence already offered to `rows`

    @property
    def token_ids(self) -> Tensor | None:
        """(K [+ n],) the target id of each row of the logits `_run` returns; None when rows are target ids."""
        return self.rows.token_ids if self.rows is not None else self.net.token_ids

    def _offer(self, ids: list[int]) -> None:
        """Give `rows` the sequence's tokens it has not seen; the chain's round maps rows to ids with them."""
        if self.rows is None:
            return
        if self.seen:
            self.rows.add(ids[self.seen:])
        else:
            self.rows.reset(ids)
        self.seen = len(ids)
        if isinstance(self.round, ChainRound):
            self.round.token_ids = self.rows.token_ids

    def features(self, out: ForwardOut) -> Tensor:
        """What the drafter reads of a target pass, a row per fed token: the tapped layers' inputs for an
        EAGLE-3 drafter (`target_layers`, the engine taps them), else the final-norm hidden states."""
        if getattr(self.net, "target_layers", None):
            assert out.taps is not None, "the target engine does not tap the drafter's layers"
            return out.taps
        return out.hidden

    def start(self, state: DecodeState, out: ForwardOut) -> None:
        self.cache.rollback(0)
        self.fed = 0
        self.pending = self.features(out)  # (P, F): h_0 .. h_{P-1}, the pairs' features up to the first new token
        self.seen = 0
        self._offer(state.ids)

    def _run(self, tokens: list[int] | Tensor, features: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """Feed pairs at positions start..; the last one's logits (K [+ n],) and guessed next feature (D,).
        tokens: host ids, or ids drafted on the device (1,)."""
        logits, guess = self._pass(tokens, features, start)
        return (logits if self.rows is None else self.rows.extend(logits, guess)), guess

    def _pass(self, tokens: list[int] | Tensor, features: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """The drafter's pass behind `_run`: logits over its own rows (K,)."""
        if self.kernel is not None and len(tokens) <= FUSED_ROWS:
            ids = tokens.numpy() if isinstance(tokens, Tensor) else np.array(tokens, dtype=np.int64)
            logits, guess = self.kernel(ids, features.float().numpy(), self.cache)
            return logits[-1], guess[-1]
        device = self.net.device
        ids = tokens.to(device) if isinstance(tokens, Tensor) else torch.tensor(tokens, device=device)  # (n,)
        n = len(ids)
        if self.static is not None and n <= BUCKETS[-1]:
            self.cache.reserve(n)
            logits, guess = self.static(ids, None, None, start, features.to(device))
            self.cache.advance(n)
            return logits[-1], guess[-1]
        pos = torch.arange(start, start + n, device=device)[None]  # (1, n)
        logits, guess = self.net(ids[None], features.to(device)[None], pos,
                                 self.cache, self.cache.attention_mask(None, n), logits_from=n - 1)
        return logits[0, -1], guess[0, -1]

    def propose(self, state: DecodeState) -> Proposal | None:
        t0 = self.round.now()
        L = len(state.ids)
        spare = BUCKETS[-1] if self.static is not None else 0  # slots only a padded step writes to
        k_max = self.round.max_tokens(state, self.cache.max_len - spare - L)
        assert self.pending is not None and len(self.pending) == L - 1 - self.fed, "drafter out of step"
        if k_max < 1:
            return None
        # catch up: pairs fed .. L-2 carry real features; the last one's guess drafts token L
        logits, guess = self._run(state.ids[self.fed + 1:L], self.pending, self.fed)
        self.fed, self.pending = L - 1, self.pending[:0]
        at = L - 1  # the next pair, (guessed h_at, drafted token), sits at position at

        def step(tok: int | Tensor) -> Tensor:
            nonlocal guess, at
            logits, guess = self._run(tok if isinstance(tok, Tensor) else [tok], guess[None], at)
            at += 1
            return logits

        return self.round.draft(logits, step, k_max, state, t0)

    def commit(self, state: DecodeState, verdict: Verdict, out: ForwardOut) -> None:
        self.round.learn(verdict)
        self.cache.rollback(self.fed)  # forget pairs built on guessed features
        # the pass fed [root, drafts]; the root and the accepted drafts now have real features
        assert self.pending is not None
        known = self.features(out)[[0, *verdict.nodes]]  # (1 + accepted, F)
        self.pending = torch.cat([self.pending, known])[:len(state.ids) - 1 - self.fed]
        self._offer(state.ids)


class EagleStrategy(SpeculativeStrategy):
    """Speculative decoding with an EAGLE-style drafter on the target's features (compact or hf target)."""

    def __init__(self, target: Any, name: str, drafter: TrainedEagle | EagleDraftNet,
                 schedule: DraftSchedule | None = None, max_len: int = 2048, prefill_chunk: int = 512,
                 request_rows: bool = False) -> None:
        super().__init__(target, name, max_len, prefill_chunk)
        # a saved drafter is checked against the target and bound to it; a network is used as given
        self.net: EagleDraftNet = drafter.bind(target) if hasattr(drafter, "bind") else drafter  # type: ignore[assignment]
        layers = getattr(self.net, "target_layers", None)
        if request_rows and layers:
            raise SpecdecError(f"{name}: request_rows scores target rows against the drafter's guessed final-norm "
                               "feature, which an EAGLE-3 drafter does not make; set request_rows=false")
        # scored beside the kept rows from each request's tokens (strategies/request_rows.py); nothing to add
        # when the drafter already scores every target row
        self.rows = (RequestRows(self.net.token_ids, output_rows(target))
                     if request_rows and self.net.token_ids is not None else None)
        if layers:  # EAGLE-3 (heads/eagle3.py): the target's passes return those layers' inputs too
            self.engine.use_taps(layers)
        # compiled with the target, on the torch path (a drafter on the CPU kernels stays eager)
        compiled = bool(getattr(target, "compile", False)) and getattr(self.net, "fused", None) is None
        self.cache = self.net.new_cache(max_len + (BUCKETS[-1] if compiled else 0))
        self.static = StaticStep(self.net, self.cache) if compiled else None  # type: ignore[arg-type]
        if self.static is not None:  # the drafter's own features, and EAGLE-3's target taps (fc's width)
            widths = [self.net.args.dim] + ([self.net.fc.in_features] if layers else [])  # type: ignore[attr-defined]
            for width in widths:
                self.static.warm_up(features=torch.zeros(width, device=self.net.device))
        # on the CPU kernels the drafter's pass runs as one compiled call (models/cpu_drafter.py), bitwise the same
        self.kernel = DrafterPass(self.net) if DrafterPass.fits(self.net) else None  # type: ignore[arg-type]
        self.schedule = schedule if schedule is not None else Confidence(0.4, 3)
        self.schedule.calibrate(self.engine)
        self.last_proposer: EagleProposer | None = None

    @property
    def batchable(self) -> bool:  # type: ignore[override]
        """Through its own batched proposer (strategies/batched_eagle.py); not yet with EAGLE-3's target taps."""
        return not getattr(self.net, "target_layers", None)

    def batch_proposer(self, engine: BatchEngine) -> BatchProposer:
        """One drafter engine of `engine.batch` slots (eager, like the target's), its draft length chosen from
        pass costs measured at this batch size."""
        from specdec.strategies.batched_draft import BatchCosts
        from specdec.strategies.batched_eagle import BatchedEagle

        if self.rows is not None:
            raise SpecdecError(f"strategy {self.name}: request_rows=true scores each request's own rows at "
                               "generation.batch_size=1 only; set request_rows=false to decode in batches")
        if not getattr(self.net, "reads_features", False):
            raise SpecdecError(f"batched EAGLE drafting needs a saved drafter (heads.eagle), not a "
                               f"{type(self.net).__name__}; run it with generation.batch_size=1")
        drafter = BatchEngine(self.net, engine.batch, engine.max_len, engine.prefill_chunk)  # type: ignore[arg-type]
        longest = min(getattr(self.schedule, "max_gamma", 8), 8)
        token_ids = None if self.net.token_ids is None else self.net.token_ids.to(self.net.device)
        return BatchedEagle(drafter, token_ids, self.target.vocab_size, BatchCosts.measure(engine, drafter, longest),
                            max_gamma=longest)

    def make_proposer(self) -> Proposer:
        self.last_proposer = EagleProposer(
            self.net, self.cache, ChainRound(self.schedule, self.net.token_ids, self.target.vocab_size,
                                               device=self.engine.device),
            static=self.static, kernel=self.kernel, rows=self.rows)
        return self.last_proposer
