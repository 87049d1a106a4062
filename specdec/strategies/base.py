"""The strategy protocol and the one decode loop every speculative strategy runs through.

A strategy is anything that turns prompt ids into output ids (`Strategy.generate`). Speculative
strategies only supply a `Proposer`; the loop owns prefill, the target pass, verification and the
target cache, so every method is measured with the same engine and the same token accounting.

Terms (docs/adding-a-strategy.md walks through writing one):

- *target*: the model whose output is reproduced (`LoadedModel`); *draft*/*proposal*: tokens guessed
  for it, cheaper than running it token by token.
- *committed*: part of the output, never taken back. `DecodeState.ids` is the prompt plus everything
  committed.
- *root*: the newest committed token, `state.ids[-1]`. The target has not seen it yet: its KV cache
  holds every committed token except the root.
- *node*: one position of a proposal. Node 0 is the root; nodes 1..N are the proposed tokens, each
  with a parent (a chain: node i follows node i - 1; a tree: several children may share a parent).
- *target pass* (one decode step): one forward of the target over [root, node 1, ..., node N].
  Row i of its logits is the target's prediction for the token after node i.
- *verdict*: what verification keeps: the accepted nodes (a path from the root) and their tokens
  plus one more token from the target, so every pass commits at least one token.

One turn of `SpeculativeStrategy.generate`:

    proposer = strategy.make_proposer()            # fresh for every turn (None: plain decoding)
    out = prefill(prompt); ids = prompt + [target's next token]
    proposer.start(state, out)                     # once, if the turn goes on
    loop until EOS, a stop string or max_new_tokens:
        proposal = proposer.propose(state)         # None or no tokens: a one-token step
        out = target pass over [root, *proposal.tokens]; verdict = verify(...)
        target cache keeps root + accepted nodes; ids += verdict.tokens
        proposer.commit(state, verdict, out)       # every round, proposed or not, if the turn goes on

At temperature 0 every verified token equals the target's argmax after its prefix, so the output is
the target's greedy output whatever is proposed (lossless); above 0, `specdec.verify` samples exactly
from the target's distribution provided a proposal's `probs` are the ones its tokens were drawn from.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from specdec.engine.batch import BatchEngine
from specdec.engine.engine import Engine, ForwardOut, HFEngine, StaticEngine
from specdec.engine.sampling import SamplingParams, check_finite, new_generator, read_greedy, sample, warp
from specdec.engine.timing import SpanTimer, clock
from specdec.errors import SpecdecError
from specdec.models.loader import LoadedModel
from specdec.trees import depth_list, tree_depth, tree_mask
from specdec.verify import Proposal, Verdict, verify

if TYPE_CHECKING:
    from specdec.strategies.batched import BatchDecoder, BatchProposer


@dataclass(frozen=True)
class GenerationParams:
    """How one turn is generated: at most `max_new_tokens`, sampled with `sampling` (temperature 0:
    greedy), ending after any token in `eos_ids` or the token that completes a `stop` string."""

    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings: the turn ends with the token that completes one


def stop_cut(tokenizer: Any, ids: list[int], start: int, first_new: int, stop: tuple[str, ...]) -> int | None:
    """The length to keep ids at: through the first token of ids[first_new:] that completes a stop
    string (one that is in the text with that token and not without it), or None.

    Text is matched only after `start` (the prompt's end). Each token is checked by decoding a short
    window ending at it, wide enough for the longest stop string (every token decodes to at least
    one character), so the cost does not grow with the output.
    """
    if not stop:
        return None
    window = max(len(s) for s in stop) + 2
    for end in range(max(first_new, start) + 1, len(ids) + 1):
        lo = max(start, end - window)
        text = tokenizer.decode(ids[lo:end], skip_special_tokens=False)
        hits = [s for s in stop if s in text]
        if hits:
            before = tokenizer.decode(ids[lo:end - 1], skip_special_tokens=False)
            if any(s not in before for s in hits):
                return end
    return None


@dataclass
class TurnResult:
    """What one turn produced and how: the rows of answers.jsonl are made of it (CONTRACT.md).

    `SpeculativeStrategy` fills every field; a strategy of its own must keep the invariants the
    results checker asserts: sum(accept_lengths) == len(output_ids) and len(accept_lengths) ==
    decode_steps + 1 (prefill yields the first token), unless both are None (a peer that hides them).
    """

    output_ids: list[int]
    ttft_s: float
    wall_time_s: float
    decode_steps: int | None  # target passes after prefill (None where a peer hides them)
    accept_lengths: list[int] | None  # tokens committed per target pass, prefill first
    proposed: int = 0  # draft tokens proposed (the longest path, for trees)
    proposed_nodes: int = 0  # draft nodes verified (every node of a tree; = proposed for chains)
    accepted: int = 0  # draft tokens accepted
    proposed_by_pos: list[int] = field(default_factory=list)  # per draft position
    accepted_by_pos: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0  # time spent proposing, for the measured cost ratio
    # batched decoding: the wall-clock time from the question taking a slot to its first token (ttft_s
    # is then the answer's share of the passes until then, in the currency of wall_time_s)
    ttft_wall_s: float | None = None


@dataclass
class DecodeState:
    """What a proposer may read: the whole sequence so far and how the turn is sampled.

    Owned by the loop: a proposer reads it and never changes it. `ids[-1]` is the root, the only
    committed token the target's cache does not hold yet; `generator` is None at temperature 0 and
    otherwise the turn's seeded generator (draw from it, on its device, so runs repeat exactly).
    """

    ids: list[int]  # prompt + committed output; ids[-1] is the root of the next proposal
    prompt_len: int
    params: GenerationParams
    generator: torch.Generator | None

    @property
    def output_len(self) -> int:
        return len(self.ids) - self.prompt_len


class Strategy(ABC):
    """Anything that answers a turn: prompt token ids in, a `TurnResult` out.

    A config builds it as `_partial_: true` and the runner calls the partial with
    `target=LoadedModel, max_len=int, prefill_chunk=int` (generation.max_len: the KV cache size in
    tokens, prompt included; generation.prefill_chunk: prompt tokens per prefill forward), so a
    strategy's `__init__` takes those three, `name` (the config's `name`, the key results are filed
    under) and its own settings as keyword arguments. Errors in the settings are one-line
    `specdec.errors.SpecdecError`s naming the key and a valid value.

    Speculative strategies subclass `SpeculativeStrategy` and supply a `Proposer` instead.
    """

    name: str
    prefix_cache: bool = False  # whether turns reuse the cached prefix of the last one (`reuse_prefix`)

    @abstractmethod
    def generate(self, prompt_ids: list[int], params: GenerationParams, seed: int) -> TurnResult:
        """Answer one turn. `seed` makes sampling repeatable (each turn gets its own); at temperature 0 it
        is unused. Called many times on one instance: nothing of one turn may leak into the next (a cached
        prefix reused under `reuse_prefix` is the same K/V a full prefill would compute)."""

    def reuse_prefix(self, on: bool) -> None:
        """generation.prefix_cache: whether a turn may keep the cached prefix its prompt shares with what
        the last turn left in the caches, prefilling only the rest (`prefix_cache` says whether it does).
        A strategy without engines of ours (transformers' own generate, strategies/hf.py) never does."""
        return None

    def new_conversation(self) -> None:
        """Called before a conversation's first turn: its prompt is then prefilled in full, so turn 0 is
        timed alike with and without reuse (a warm-up turn on the same prompt would otherwise be reused)."""
        return None


class Proposer(Protocol):
    """Guesses the next tokens of one turn; `SpeculativeStrategy` verifies them with the target.

    A fresh proposer serves one turn (`SpeculativeStrategy.make_proposer`). Shapes: N proposed nodes,
    V the target's vocabulary, D its hidden size, P the prompt length.

    The cache contract. The target's KV cache belongs to the loop: a proposer never runs, rolls back
    or compacts the target's engine. What the proposer keeps of its own (a draft model's KV cache, an
    n-gram index, hidden states) it must keep in step with `state.ids`: after `commit`, anything built
    on proposed tokens that were not accepted has to be dropped (e.g. a draft cache rolled back to the
    longest prefix it shares with `state.ids`), and anything committed that it has not seen yet (the
    verdict's tokens, the root) it catches up on, at the latest in the next `propose`. The loop never
    skips a `commit`, so a proposer may rely on seeing every round.
    """

    def start(self, state: DecodeState, out: ForwardOut) -> None:
        """Once per turn, after prefill, when the turn goes on. `state.ids` is the prompt plus the first
        output token (the root); `out` is the prefill's: `out.logits` (1, V) for the last prompt
        token only, `out.hidden` (P, D) the target's final-norm hidden states of the prompt tokens."""
        ...

    def propose(self, state: DecodeState) -> Proposal | None:
        """The tokens to verify after the root, or None (or no tokens) for a plain one-token step.

        A `Proposal` holds `tokens` (N,) long; `parents` (N,), `parents[i - 1]` the parent of node i:
        0 is the root, each parent is smaller than its child, -1 marks a node fed but never verified
        (lookahead's window); a chain is `list(range(N))`. `probs` (N, V): the distribution each token
        was drawn from, for exact speculative sampling above temperature 0 (chains only; warp the draft's
        logits with `specdec.engine.sampling.warp` like the target's); None for deterministic guesses.
        `mask` (N+1, N+1) and `depth` (N+1,) override the tree's attention mask and position offsets.

        Room: the pass writes N + 1 positions into a cache that holds len(state.ids) - 1, so keep
        len(state.ids) + N <= the engine's max_len; more than max_new_tokens - state.output_len - 1
        tokens can never be kept. Trees (parents other than a chain) need an engine with
        `supports_trees` (the compact model). The time spent here counts as drafting time.
        """
        ...

    def commit(self, state: DecodeState, verdict: Verdict, out: ForwardOut) -> None:
        """After every target pass that leaves the turn going on, proposal or not.

        `state.ids` already ends with all of `verdict.tokens` (the accepted nodes' tokens, then the
        target's own next token, the new root). `verdict.nodes` are the accepted node indices (1..N,
        root excluded) in path order. `out` is the pass's: `out.logits` (1 + N, V) and `out.hidden`
        (1 + N, D), row 0 the root and row i node i, in the order the proposal listed them (one row
        after a one-token step). Update what the proposer learns from the outcome here.
        """
        ...


def pick_token(logits: torch.Tensor, state: DecodeState) -> int:
    """The target's token after logits (V,): at temperature 0 one read that also checks finiteness."""
    sp = state.params.sampling
    if sp.greedy:
        return read_greedy(logits[None])[0][0]
    check_finite(logits)
    return sample(warp(logits, sp), state.generator)


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


_batch_engines: dict[tuple[int, int, int, int], BatchEngine] = {}


def shared_batch_engine(target: LoadedModel, batch: int, max_len: int, prefill_chunk: int) -> BatchEngine:
    """One batched cache per target and size, shared by the strategies of a run (they take turns):
    B slots of max_len tokens each are the largest buffers of a run."""
    key = (id(target.model), batch, max_len, prefill_chunk)
    if key not in _batch_engines:
        _batch_engines.clear()  # one size at a time
        _batch_engines[key] = BatchEngine(target.model, batch, max_len, prefill_chunk)
    return _batch_engines[key]


def make_engine(target: LoadedModel, max_len: int, prefill_chunk: int) -> Engine:
    if target.backend == "compact":
        return StaticEngine(target.model, max_len, prefill_chunk, compile=target.compile)
    return HFEngine(target.model, max_len, prefill_chunk)


class SpeculativeStrategy(Strategy):
    """Prefill, then propose -> one target pass -> verify -> commit, until EOS or the budget."""

    def __init__(self, target: LoadedModel, name: str, max_len: int = 2048, prefill_chunk: int = 512) -> None:
        self.name = name
        self.target = target
        self.engine = make_engine(target, max_len, prefill_chunk)

    def engines(self) -> list[Engine]:
        """Every engine of this strategy (the target's, and a drafter's where it has its own)."""
        return [self.engine]

    def reuse_prefix(self, on: bool) -> None:
        for engine in self.engines():
            engine.reuse_prefix(on)
        self.prefix_cache = on

    def new_conversation(self) -> None:
        for engine in self.engines():
            engine.reset()

    def make_proposer(self) -> Proposer | None:
        """A fresh proposer for a turn; None decodes one token per target pass. State that should
        outlive a turn (trained weights, measured pass costs, a draft model's caches, reused) lives
        on the strategy and is handed to the proposer here."""
        return None

    def generate(self, prompt_ids: list[int], params: GenerationParams, seed: int) -> TurnResult:
        with torch_threads(self.target.torch_threads), torch.inference_mode():
            return self._generate(prompt_ids, params, seed)

    # Whether make_proposer's proposers may serve several slots at once: they keep nothing shared (a
    # draft model's cache, the target engine's length) outside themselves. Plain decoding always may.
    batchable = False

    def batch_decoder(self, batch: int, params: GenerationParams) -> BatchDecoder:
        """This strategy over `batch` slots of one cache (generation.batch_size, specdec.strategies.batched)."""
        from specdec.strategies.batched import BatchDecoder

        plain = type(self).make_proposer is SpeculativeStrategy.make_proposer
        if not (plain or self.batchable):
            raise SpecdecError(f"strategy {self.name} cannot decode in batches yet; run it with "
                               "generation.batch_size=1 (batched: greedy, prompt_lookup, draft, eagle, medusa)")
        if self.target.backend != "compact":
            raise SpecdecError("generation.batch_size > 1 needs the compact Llama-family model "
                               "(model.backend=compact)")
        engine = shared_batch_engine(self.target, batch, self.engine.max_len, self.engine.prefill_chunk)
        return BatchDecoder(engine, params, self.target.tokenizer, None if plain else self.batch_proposer(engine),
                            self.accept, prefix_cache=self.prefix_cache)

    def batch_proposer(self, engine: BatchEngine) -> BatchProposer:
        """What proposes for the slots of `engine` (default: this strategy's proposers, one per slot and
        turn; a strategy whose proposers read pass costs re-measures them there, at the batch's size)."""
        from specdec.strategies.batched import PerSlot

        return PerSlot(self.make_proposer)

    def _pick(self, logits: torch.Tensor, state: DecodeState) -> int:
        return pick_token(logits, state)

    def _generate(self, prompt_ids: list[int], params: GenerationParams, seed: int) -> TurnResult:
        gen = None if params.sampling.greedy else new_generator(self.engine.device, seed)
        device = self.engine.device
        start = clock(device)
        out = self.engine.prefill(prompt_ids)
        state = DecodeState(list(prompt_ids), len(prompt_ids), params, gen)
        state.ids.append(self._pick(out.logits[-1], state))
        ttft = clock(device) - start
        result = TurnResult([], ttft, 0.0, 0, [1])
        proposer = self.make_proposer()
        drafting = SpanTimer(device)  # device time of proposing, for the measured cost ratio
        tokenizer = self.target.tokenizer
        done = stop_cut(tokenizer, state.ids, state.prompt_len, state.prompt_len, params.stop) is not None
        done = done or self._finished(state)
        if proposer is not None and not done:
            proposer.start(state, out)
        while not done:
            drafting.start()
            proposal = proposer.propose(state) if proposer is not None else None
            drafting.stop()
            verdict, out = self._step(state, proposal)
            result.decode_steps = (result.decode_steps or 0) + 1
            budget = params.max_new_tokens - state.output_len
            new = verdict.tokens[:budget]
            for j, tok in enumerate(new):
                if tok in params.eos_ids:
                    new = new[:j + 1]
                    break
            first = len(state.ids)
            state.ids.extend(new)
            cut = stop_cut(tokenizer, state.ids, state.prompt_len, first, params.stop)
            if cut is not None:
                del state.ids[cut:]
                new = new[:cut - first]
            result.accept_lengths.append(len(new))  # type: ignore[union-attr]
            if proposal is not None:
                self._count(result, proposal, verdict)
            done = cut is not None or self._finished(state)
            if proposer is not None and not done:
                proposer.commit(state, verdict, out)
        result.output_ids = state.ids[state.prompt_len:]
        result.wall_time_s = clock(device) - start
        result.draft_time_s = drafting.total()
        return result

    def _step(self, state: DecodeState, proposal: Proposal | None) -> tuple[Verdict, ForwardOut]:
        """One target pass over the root and the proposal, verified and committed to the cache.

        At temperature 0 the host reads the device once (read_greedy: the target's choices with the
        proposal's tokens); everything else it needs (lengths, parents, the accepted path) it holds.
        """
        root = torch.tensor([state.ids[-1]])
        base = self.engine.length
        if proposal is None or len(proposal.tokens) == 0:
            out = self.engine.forward(root)
            verdict = Verdict([], [self._pick(out.logits[-1], state)])
        else:
            tokens = proposal.tokens
            feed = torch.cat([root.to(tokens.device), tokens])
            if proposal.is_chain and proposal.mask is None:
                mask, depth = None, None
            else:
                mask = proposal.mask if proposal.mask is not None else tree_mask(proposal.parents)
                depth = proposal.depth if proposal.depth is not None else tree_depth(proposal.parents)
            out = self.engine.forward(feed, depth, mask)
            if not state.params.sampling.greedy:
                check_finite(out.logits)
            verdict = self.accept(proposal, out.logits, state)
        keep = [0, *verdict.nodes]
        if keep == list(range(len(keep))):
            self.engine.rollback(base + len(keep))
        else:
            self.engine.compact(base, [base + n for n in keep])
        return verdict, out

    def accept(self, proposal: Proposal, logits: torch.Tensor, state: DecodeState) -> Verdict:
        """The acceptance rule; a strategy with its own (Medusa's typical acceptance) overrides this."""
        return verify(proposal, logits, state.params.sampling, state.generator)

    @staticmethod
    def _count(result: TurnResult, proposal: Proposal, verdict: Verdict) -> None:
        depth = depth_list([p if p >= 0 else 0 for p in proposal.parents])
        verified = [d for d, p in zip(depth[1:], proposal.parents) if p >= 0]
        longest = max(verified, default=0)
        result.proposed += longest
        result.proposed_nodes += len(verified)
        result.accepted += len(verdict.nodes)
        for pos in range(longest):
            if pos == len(result.proposed_by_pos):
                result.proposed_by_pos.append(0)
                result.accepted_by_pos.append(0)
            result.proposed_by_pos[pos] += 1
            result.accepted_by_pos[pos] += int(pos < len(verdict.nodes))

    @staticmethod
    def _finished(state: DecodeState) -> bool:
        p = state.params
        return state.output_len >= p.max_new_tokens or state.ids[-1] in p.eos_ids

