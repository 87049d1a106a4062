"""Draft-model speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

A small draft model with its own KV cache proposes a chain of tokens autoregressively; the shared
loop scores them with one target pass and keeps the longest accepted prefix (greedy match at
temperature 0, speculative sampling otherwise). The draft is either a `LoadedModel` sharing the
target's tokenizer, or a trained drafter from `heads/` (reached through its config, see `TrainedDraft`).

How many tokens to draft is a `DraftSchedule` (strategies/schedules.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from specdec.engine.batch import BatchEngine
from specdec.engine.engine import Engine, ForwardOut, StaticEngine
from specdec.engine.kv_cache import KVCache
from specdec.engine.sampling import sample, warp
from specdec.engine.timing import clock
from specdec.errors import SpecdecError
from specdec.models.loader import LoadedModel, check_same_tokenizer
from specdec.ngram import as_tokens
from specdec.strategies.base import DecodeState, Proposer, SpeculativeStrategy, make_engine
from specdec.strategies.batched import BatchProposer
from specdec.strategies.schedules import DraftSchedule, FixedLength, RoundStats
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
                logits = engine.next_logits(tokens)
                self.fed += [UNREAD] * len(tokens)
            else:
                logits = engine.next_logits(torch.tensor(tokens, device=_device(engine)))
                self.fed += tokens
            return logits

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
