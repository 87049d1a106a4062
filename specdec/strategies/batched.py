"""Continuous batching: B slots decode at once, one target pass per step for all of them.

Each slot answers one conversation, turn after turn; when it finishes, the slot takes the next
conversation at once. Every step gathers each busy slot's root and proposal (a `BatchProposer`:
per-slot proposers, the ones the batch-1 loop runs, or one drafter pass for every slot), runs one
`BatchEngine.step`, verifies each slot on its own (ragged acceptance) and rolls back or compacts
each slot's cache on its own.

Admission: a newcomer's prompt is fed a chunk per step, within the others' decode pass on the CPU
kernels (chunked prefill mixed with decode) or beside it on the torch path, so admitting it never
stalls them for a whole prompt.

Prefix reuse (generation.prefix_cache): a slot keeps the conversation's cache between turns, so a
later turn prefills only what its cache does not already hold. A conversation's first turn prefills
whole, as in the batch-1 loop, so first-turn TTFTs compare fairly.

Time accounting (answers.jsonl): a step's elapsed time (proposing, its passes, verifying) is shared
equally by the answers in it, prompt chunks included, so the answers' wall times add up to the run's
elapsed time and tokens/s over a run is its new tokens over that time. `ttft_s` is, in the same
currency, the answer's share of the steps from the moment it took a slot to its first token (so
ttft_s <= wall_time_s and TPOT stay as CONTRACT.md defines them); `ttft_wall_s` is the wall-clock
time of those steps, the latency a user waits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from specdec.engine.batch import BatchEngine, Feed
from specdec.engine.engine import ForwardOut
from specdec.engine.sampling import check_finite, new_generator, read_greedy
from specdec.engine.timing import clock
from specdec.errors import SpecdecError
from specdec.strategies.base import DecodeState, GenerationParams, Proposer, TurnResult, pick_token, stop_cut
from specdec.trees import tree_depth, tree_mask
from specdec.verify import Proposal, Verdict


@dataclass
class Job:
    """One conversation: `prompt(turn)` builds a turn's prompt ids once the earlier turns are answered
    (`done(turn, prompt_ids, result)` is called for each, in order); turns first..turns-1 are answered."""

    turns: int
    prompt: Callable[[int], list[int]]
    seed: Callable[[int], int]
    done: Callable[[int, list[int], TurnResult], None]
    first: int = 0
    fail: Callable[[int, Exception], None] | None = None  # a turn that cannot run ends its job (else: raised)


@dataclass
class Slot:
    job: Job
    turn: int
    state: DecodeState  # ids: the prompt until its prefill ends, then prompt + committed output
    result: TurnResult
    admitted: float  # clock when the turn took the slot (TTFT counts from here)
    fresh: bool  # the conversation's first turn in this slot
    pending: list[int] = field(default_factory=list)  # prompt tokens not fed yet
    hidden: list[torch.Tensor] = field(default_factory=list)  # the fed prompt chunks' hidden states
    stopped: bool = False  # a stop string ended the turn


class BatchProposer(Protocol):
    """Proposes for every busy slot at once (a `Proposer` per slot, or one drafter pass for all slots).

    The batch-1 contract per slot (strategies/base.py, `Proposer`): `start` once per turn after its
    prefill, `propose` for the slots of a step, `commit` after every pass that leaves a turn going on.
    """

    def start(self, b: int, state: DecodeState, out: ForwardOut, fresh: bool) -> None: ...

    def propose(self, states: dict[int, DecodeState]) -> dict[int, Proposal | None]: ...

    def commit(self, b: int, state: DecodeState, verdict: Verdict, out: ForwardOut) -> None: ...

    # Optional: `finish(b, state, verdict, out)` after a turn's last pass (state cut at EOS, budget or
    # stop), for a proposer that keeps what the pass made known for the slot's next turn.


class PerSlot:
    """A BatchProposer of independent per-slot proposers (fresh for every turn), e.g. prompt lookup's."""

    def __init__(self, make_proposer: Callable[[], Proposer | None]) -> None:
        self.make_proposer = make_proposer
        self.proposers: dict[int, Proposer | None] = {}

    def start(self, b: int, state: DecodeState, out: ForwardOut, fresh: bool) -> None:
        self.proposers[b] = self.make_proposer()
        if self.proposers[b] is not None:
            self.proposers[b].start(state, out)  # type: ignore[union-attr]

    def propose(self, states: dict[int, DecodeState]) -> dict[int, Proposal | None]:
        return {b: p.propose(states[b]) if (p := self.proposers.get(b)) is not None else None for b in states}

    def commit(self, b: int, state: DecodeState, verdict: Verdict, out: ForwardOut) -> None:
        if (p := self.proposers.get(b)) is not None:
            p.commit(state, verdict, out)


class BatchDecoder:
    """Runs jobs through `engine`'s slots, `proposer` proposing for them (None: plain decoding).

    `accept(proposal, logits, state)` is the strategy's acceptance rule (`SpeculativeStrategy.accept`).
    """

    def __init__(self, engine: BatchEngine, params: GenerationParams, tokenizer: Any,
                 proposer: BatchProposer | None,
                 accept: Callable[[Proposal, torch.Tensor, DecodeState], Verdict], prefix_cache: bool = True) -> None:
        self.engine, self.params, self.tokenizer = engine, params, tokenizer
        self.proposer, self.accept, self.prefix_cache = proposer, accept, prefix_cache
        self.held: list[list[int]] = [[] for _ in range(engine.batch)]  # token ids each slot's cache holds

    def run(self, jobs: Iterable[Job]) -> None:
        self.held = [[] for _ in range(self.engine.batch)]  # a run starts cold, whatever ran before
        queue: Iterator[Job] = iter(jobs)
        slots: list[Slot | None] = [None] * self.engine.batch
        with torch.inference_mode():
            while True:
                for b in range(len(slots)):  # fill free slots; finished turns (even at once) hand over
                    while True:
                        s = slots[b]
                        if s is None:
                            if (job := next(queue, None)) is None:
                                break
                            slots[b] = self._admit(b, job, job.first)
                        elif self._finished(s):
                            slots[b] = self._finish(b, s)
                        else:
                            break
                busy = {b: s for b, s in enumerate(slots) if s is not None}
                if not busy:
                    return
                self._step(busy)

    def _admit(self, b: int, job: Job, turn: int) -> Slot | None:
        """Turn `turn` of job takes slot b; None if the job has no turns left (or its turn cannot run).

        Only what the slot's cache does not hold is prefilled, a chunk per step (`_step`), so admitting
        a turn never stalls the other slots for a whole prompt."""
        if turn >= job.turns:
            return None
        device = self.engine.device
        start = clock(device)
        fresh = turn == job.first or not self.prefix_cache  # a conversation's first turn prefills whole
        try:
            prompt = job.prompt(turn)
            held = [] if fresh else self.held[b]
            reuse = 0
            limit = min(len(held), len(prompt) - 1)
            while reuse < limit and held[reuse] == prompt[reuse]:
                reuse += 1
            if len(prompt) >= self.engine.max_len:
                raise SpecdecError(f"prompt of {len(prompt)} tokens does not fit the cache of {self.engine.max_len}; "
                                   "shorten the prompt or raise generation.max_len")
        except SpecdecError as e:
            if job.fail is None:
                raise
            self.held[b] = []
            job.fail(turn, e)
            return None
        gen = None if self.params.sampling.greedy else new_generator(device, job.seed(turn))
        slot = Slot(job, turn, DecodeState(list(prompt), len(prompt), self.params, gen),
                    TurnResult([], 0.0, 0.0, 0, [1]), start, fresh)
        self.engine.rollback(b, reuse)
        slot.pending = prompt[reuse:]
        return slot

    @property
    def mixed(self) -> bool:
        """Whether prompt chunks share the decode pass (the CPU kernels' ragged rows) or, on the torch
        path, where padding every slot to a chunk would cost more, get a pass of their own in the step."""
        return self.engine.fused is not None

    def _started(self, b: int, s: Slot, out: ForwardOut) -> None:
        """The prompt is in the cache: the first token, TTFT, and the proposer's start."""
        s.state.ids.append(pick_token(out.logits[-1], s.state))
        s.result.ttft_wall_s = clock(self.engine.device) - s.admitted
        s.stopped = stop_cut(self.tokenizer, s.state.ids, s.state.prompt_len, s.state.prompt_len,
                             self.params.stop) is not None
        if not self._finished(s) and self.proposer is not None:
            self.proposer.start(b, s.state, out, s.fresh)

    def _finish(self, b: int, s: Slot) -> Slot | None:
        """Record the slot's turn; the slot then takes the conversation's next turn or is free."""
        s.result.output_ids = s.state.ids[s.state.prompt_len:]
        # the cache holds every committed token but the last (and maybe nodes past a stop cut): keep those
        self.held[b] = s.state.ids[:-1]
        self.engine.rollback(b, min(self.engine.length(b), len(self.held[b])))
        del self.held[b][self.engine.length(b):]
        s.job.done(s.turn, s.state.ids[:s.state.prompt_len], s.result)
        return self._admit(b, s.job, s.turn + 1)

    def _finished(self, s: Slot) -> bool:
        st, p = s.state, self.params
        if s.pending:
            return False
        return s.stopped or st.output_len >= p.max_new_tokens or st.ids[-1] in p.eos_ids

    def _step(self, slots: dict[int, Slot]) -> None:
        """Propose for every decoding slot, one pass for all (prompt chunks of admitted slots included),
        then verify and commit each decoding slot on its own."""
        device = self.engine.device
        start = clock(device)
        decoding = {b: s for b, s in slots.items() if not s.pending}
        proposals: dict[int, Proposal | None] = {b: None for b in decoding}
        if self.proposer is not None and decoding:
            proposals |= self.proposer.propose({b: s.state for b, s in decoding.items()})
        feeds: dict[int, Feed] = {}
        for b, s in slots.items():
            if s.pending:  # the next prompt chunk; logits only after the prompt's last token
                chunk = s.pending[:self.engine.prefill_chunk]
                last = len(chunk) == len(s.pending)
                feeds[b] = Feed(torch.tensor(chunk), logits_from=len(chunk) - 1 if last else len(chunk))
                continue
            p = proposals[b]
            root = torch.tensor([s.state.ids[-1]])
            if p is None or len(p.tokens) == 0:
                proposals[b] = None
                feeds[b] = Feed(root)
                continue
            tokens = torch.cat([root.to(p.tokens.device), p.tokens])
            if p.is_chain and p.mask is None:
                feeds[b] = Feed(tokens)
            else:
                mask = p.mask if p.mask is not None else tree_mask(p.parents)
                depth = p.depth if p.depth is not None else tree_depth(p.parents)
                feeds[b] = Feed(tokens, depth, mask)
        bases = {b: self.engine.length(b) for b in decoding}
        if self.mixed:
            outs = self.engine.step(feeds)
        else:
            outs = self.engine.step({b: feeds[b] for b in decoding}) if decoding else {}
            for b in slots.keys() - decoding.keys():
                outs |= self.engine.step({b: feeds[b]})
        verdicts = self._verdicts(decoding, proposals, outs)
        for b, s in decoding.items():
            keep = [0, *verdicts[b].nodes]
            if keep == list(range(len(keep))):
                self.engine.rollback(b, bases[b] + len(keep))
            else:
                self.engine.compact(b, bases[b], [bases[b] + n for n in keep])
            self._commit(b, s, proposals[b], verdicts[b], outs[b])
        for b, s in slots.items():
            if b not in decoding:
                del s.pending[:len(feeds[b].tokens)]
                s.hidden.append(outs[b].hidden)
                if not s.pending:
                    self._started(b, s, ForwardOut(outs[b].logits, torch.cat(s.hidden)))
                    s.hidden = []
        share = (clock(device) - start) / len(slots)
        for b, s in slots.items():
            s.result.wall_time_s += share
            if b not in decoding:  # still prefilling at this step's start: part of its time to first token
                s.result.ttft_s += share

    def _verdicts(self, slots: dict[int, Slot], proposals: dict[int, Proposal | None],
                  outs: dict[int, Any]) -> dict[int, Verdict]:
        """Each slot's verdict; at temperature 0 the plain steps' tokens come in one read for all."""
        verdicts: dict[int, Verdict] = {}
        plain = [b for b in slots if proposals[b] is None]
        if plain and self.params.sampling.greedy:
            picks = read_greedy(torch.stack([outs[b].logits[-1] for b in plain]))[0]
            verdicts |= {b: Verdict([], [t]) for b, t in zip(plain, picks)}
        for b, s in slots.items():
            p = proposals[b]
            if b in verdicts:
                continue
            if p is None:
                verdicts[b] = Verdict([], [pick_token(outs[b].logits[-1], s.state)])
            else:
                if not self.params.sampling.greedy:
                    check_finite(outs[b].logits)
                verdicts[b] = self.accept(p, outs[b].logits, s.state)
        return verdicts

    def _commit(self, b: int, s: Slot, proposal: Proposal | None, verdict: Verdict, out: Any) -> None:
        """The batch-1 loop's bookkeeping for one slot: budget, EOS, stop strings, counts, proposer."""
        from specdec.strategies.base import SpeculativeStrategy

        st, p, res = s.state, self.params, s.result
        res.decode_steps = (res.decode_steps or 0) + 1
        new = verdict.tokens[:p.max_new_tokens - st.output_len]
        for j, tok in enumerate(new):
            if tok in p.eos_ids:
                new = new[:j + 1]
                break
        first = len(st.ids)
        st.ids.extend(new)
        cut = stop_cut(self.tokenizer, st.ids, st.prompt_len, first, p.stop)
        if cut is not None:
            del st.ids[cut:]
            new = new[:cut - first]
            s.stopped = True
        res.accept_lengths.append(len(new))  # type: ignore[union-attr]
        if proposal is not None:
            SpeculativeStrategy._count(res, proposal, verdict)
        if self.proposer is not None and not self._finished(s):
            self.proposer.commit(b, st, verdict, out)
        elif (finish := getattr(self.proposer, "finish", None)) is not None:
            finish(b, st, verdict, out)  # the turn's last pass: what a later turn of the slot may reuse
