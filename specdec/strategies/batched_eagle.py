"""EAGLE-style drafting for every slot of a batch at once (`strategy=eagle` at generation.batch_size > 1).

Terms (strategies/eagle.py): the drafter reads *pairs*; pair j is (h_j, x_{j+1}), the target's final-norm
hidden state of token j and the token after it, and sits at slot and position j of the drafter's cache.
A pair is *real* when h_j came from a target pass and *guessed* when it is the drafter's own guess (the
chain it drafts feeds those back); only real pairs stay cached between rounds. *Pending*: real features
the target returned whose pairs are not cached yet.

The drafter keeps a slot per target slot in its own `BatchEngine`. A round is k drafter passes over every
drafting slot's rows: the first catches each slot up on its pending pairs (ragged: one feed per slot, rows
padded under masks on the torch path, segments on the CPU kernels) and drafts a token from the last one's
row; each of the other k - 1 feeds one guessed pair per slot. How many tokens to draft is the same
batch-wide rule as the draft model's (`BatchedDraft`, whose length choice, probing, online acceptance and
picks this proposer inherits): the k that maximises expected tokens per measured unit of cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from specdec.engine.batch import Feed
from specdec.engine.engine import ForwardOut
from specdec.strategies.base import DecodeState
from specdec.strategies.batched_draft import BatchedDraft
from specdec.verify import Verdict


@dataclass
class BatchedEagle(BatchedDraft):
    """A `BatchProposer` (strategies/batched.py) drafting chains for every slot with one EAGLE drafter.

    Per slot b, invariant between rounds: the drafter cache holds the real pairs 0..fed[b]-1 and pending[b]
    the features of pairs fed[b]..len(ids) - 2 (the root's pair needs the token after it, not known yet).
    """

    fed: dict[int, int] = field(default_factory=dict)  # type: ignore[assignment]  # real pairs cached, per slot
    pending: dict[int, Tensor] = field(default_factory=dict)  # (n, D) features of the pairs after them
    seen: dict[int, list[int]] = field(default_factory=dict)  # the ids the slot's pairs were built from

    def start(self, b: int, state: DecodeState, out: ForwardOut, fresh: bool) -> None:
        """A turn took slot b: its pairs up to the prompt's end are known, all but the last fed now.

        out.hidden holds h_r..h_{P-1} for the prompt tokens the target fed (r > 0 when it reused its cache).
        A later turn of the same conversation keeps the real pairs it shares (`finish` kept the last pass's
        features); any feature it never received would be a zero row, which can only lower acceptance,
        never change what is committed."""
        P = state.prompt_len
        hidden = out.hidden  # (P - r, D)
        reuse = P - len(hidden)
        keep, carried = 0, hidden[:0]
        if not fresh and b in self.fed:
            old, same = self.seen[b], 0
            while same < min(len(old), P) and old[same] == state.ids[same]:
                same += 1
            real = min(self.fed[b] + len(self.pending[b]), max(same - 1, 0))  # pairs whose x_0..x_{j+1} are unchanged
            keep = min(self.fed[b], real)
            carried = self.pending[b][:real - keep].to(hidden.device, hidden.dtype)
        known = keep + len(carried)
        gap = hidden.new_zeros(max(reuse - known, 0), hidden.shape[-1])
        pending = torch.cat([carried, gap, hidden[max(known - reuse, 0):]])  # (P - keep, D): pairs keep..P-1
        self.engine.rollback(b, keep)
        if keep < P - 1:  # alone, in chunks; the last pair waits for the first round, which drafts from it
            self.engine.prefill(b, state.ids[1:P], keep, features=pending[:P - 1 - keep])
        self.fed[b], self.pending[b], self.seen[b] = P - 1, pending[P - 1 - keep:], state.ids

    def _catch_up(self, drafting: dict[int, int], states: dict[int, DecodeState]) -> dict[int, Feed]:
        """Every pending pair of each drafting slot (at least the one before the root); logits of the last."""
        feeds: dict[int, Feed] = {}
        for b in drafting:
            ids, n, pending = states[b].ids, self.fed[b], self.pending[b]
            assert len(pending) == len(ids) - 1 - n >= 1, "drafter out of step"
            feeds[b] = Feed(torch.tensor(ids[n + 1:]), logits_from=len(pending) - 1, features=pending)
            self.fed[b], self.pending[b] = len(ids) - 1, pending[:0]
        return feeds

    def _follow(self, b: int, token: int, out: ForwardOut) -> Feed:
        # a guessed pair: the drafter's guess of the next feature beside the token it drafted
        return Feed(torch.tensor([token]), features=out.hidden[-1:])

    def commit(self, b: int, state: DecodeState, verdict: Verdict, out: ForwardOut) -> None:
        if k := self.drafted.pop(b, 0):
            self._learn(k, len(verdict.nodes))
        self.engine.rollback(b, self.fed[b])  # forget the guessed pairs
        # the pass fed [root, drafts]: the root and the accepted drafts now have real features; a cut
        # (EOS, budget) drops those past the committed ids
        known = out.hidden[[0, *verdict.nodes]]  # (1 + accepted, D)
        self.pending[b] = torch.cat([self.pending[b], known])[:len(state.ids) - 1 - self.fed[b]]
        self.seen[b] = state.ids

    def finish(self, b: int, state: DecodeState, verdict: Verdict, out: ForwardOut) -> None:
        """The turn's last pass: keep its real features for the conversation's next turn in this slot."""
        self.commit(b, state, verdict, out)
