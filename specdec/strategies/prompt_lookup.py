"""Prompt lookup decoding (Saxena 2023): draft by copying what followed the last n-gram earlier on.

The drafter is a suffix match against the prompt and the output so far; it has no model and no
probabilities, so verification is the greedy match at temperature 0 and `verify_deterministic`
(exact multi-candidate rejection sampling) above it. Several matches with different continuations
are verified together as a small token tree.
"""

from __future__ import annotations

from specdec.engine.batch import BatchEngine, batch_pass_cost_curve
from specdec.engine.engine import ForwardOut, pass_cost_curve
from specdec.errors import SpecdecError
from specdec.models.loader import LoadedModel
from specdec.ngram import NGramIndex, as_tokens, candidates_to_tree, lookup, match_length
from specdec.strategies.base import DecodeState, Proposer, SpeculativeStrategy
from specdec.strategies.batched import BatchProposer, PerSlot
from specdec.verify import Proposal, Verdict


def expected_kept(hit: list[int], tried: list[int], cap: int) -> list[float]:
    """E[copied tokens kept] for copies of 1..cap tokens, from a record per depth i (of the copies that
    reached depth i, `tried[i]` had token i tested and `hit[i]` kept it). Each factor of P(tokens 1..i
    all kept) is estimated as (hits + 2) / (tries + 3): optimistic at first, so that copying gets tried,
    and then the turn's own record (copy runs differ a lot between texts)."""
    out, survive, expected = [], 1.0, 0.0
    for i in range(1, cap + 1):
        survive *= (hit[i] + 2) / (tried[i] + 3)
        expected += survive
        out.append(expected)
    return out


class PromptLookupProposer:
    """Keeps an n-gram index of the sequence in step with the committed tokens, and a draft length
    that follows recent acceptance: doubled after a fully accepted draft, cut to one past the
    accepted prefix otherwise (copy runs are long or absent, rarely in between)."""

    def __init__(self, ngram_min: int, ngram_max: int, num_draft_tokens: int, num_candidates: int,
                 min_draft_tokens: int, adaptive: bool, max_len: int, costs: dict[int, float] | None = None) -> None:
        self.index = NGramIndex(ngram_min, ngram_max)
        self.max_k = num_draft_tokens
        self.min_k = min(min_draft_tokens, num_draft_tokens)
        self.num = num_candidates
        self.adaptive = adaptive
        self.max_len = max_len
        self.k = num_draft_tokens
        self._drafted = 0  # depth of the last proposal
        # costs: time of a pass over r tokens relative to one, measured on this hardware (None: draft
        # whatever the cap allows). With it each step drafts the length that maximises expected tokens
        # per unit of time, from this turn's acceptance statistics per match length n: of the drafts
        # that reached depth i, how many had token i accepted (tried[n][i], hit[n][i]).
        self.costs = costs
        size = num_draft_tokens + 1
        self._tried = {n: [0] * size for n in range(ngram_min, ngram_max + 1)}
        self._hit = {n: [0] * size for n in range(ngram_min, ngram_max + 1)}
        self._n = 0
        # the rate (tokens per unit) not drafting achieves: 1, or what another drafter behind it reaches
        self.floor = 1.0

    def best_length(self, n: int, cap: int) -> int:
        """Draft length in 0..cap maximising (1 + E[accepted]) / cost(pass); 0 means do not draft.

        E[accepted] for length k sums P(the first i drafted tokens are all accepted) over i <= k
        (`expected_kept`).
        """
        if self.costs is None:
            return cap
        best, best_value = 0, self.floor
        for k, expected in enumerate(expected_kept(self._hit[n], self._tried[n], cap), start=1):
            value = (1.0 + expected) / self.costs[1 + k * self.num]
            if value > best_value:
                best, best_value = k, value
        return best

    def start(self, state: DecodeState, out: ForwardOut) -> None:
        self.index.extend(state.ids)

    def propose(self, state: DecodeState) -> Proposal | None:
        self.index.extend(state.ids)
        remaining = state.params.max_new_tokens - state.output_len
        room = self.max_len - len(state.ids)  # cache slots left after the root
        # the pass also yields one target token, so drafting past remaining - 1 is wasted
        k = min(self.k, remaining - 1, room // self.num)
        self._drafted = 0
        if k < 1:
            return None
        n = match_length(state.ids, self.index)
        if n == 0:
            return None
        k = self.best_length(n, k)
        if k < 1:
            return None
        found = lookup(state.ids, self.index, k, self.num)
        if not found:
            return None
        self._n = n
        self._drafted = max(len(c) for c in found)
        tokens, parents = candidates_to_tree(found)
        return Proposal(as_tokens(tokens), parents)

    def commit(self, state: DecodeState, verdict: Verdict, out: ForwardOut) -> None:
        if self._drafted == 0:
            return
        accepted = len(verdict.nodes)
        tried, hit = self._tried[self._n], self._hit[self._n]
        for i in range(1, min(accepted + 1, self._drafted) + 1):  # depths whose token was put to the test
            tried[i] += 1
            hit[i] += i <= accepted
        if not self.adaptive:
            return
        if accepted == self._drafted:
            self.k = min(self.max_k, 2 * self.k)
        else:
            self.k = max(self.min_k, accepted + 1)


class PromptLookup(SpeculativeStrategy):
    """`strategy=prompt_lookup`: n-gram copy drafts from the sequence itself, lossless."""

    def __init__(self, target: LoadedModel, name: str = "prompt_lookup", max_len: int = 2048,
                 prefill_chunk: int = 512, ngram_max: int = 3, ngram_min: int = 1, num_draft_tokens: int = 8,
                 num_candidates: int = 1, min_draft_tokens: int = 2, adaptive: bool = True,
                 gate: bool = True) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise SpecdecError(f"prompt_lookup needs 1 <= ngram_min <= ngram_max, got {ngram_min} and {ngram_max}; "
                               "set for example strategy.ngram_min=1 strategy.ngram_max=3")
        if num_draft_tokens < 1 or num_candidates < 1:
            raise SpecdecError(f"prompt_lookup needs num_draft_tokens >= 1 and num_candidates >= 1, got "
                               f"{num_draft_tokens} and {num_candidates}")
        if min_draft_tokens < 1:
            raise SpecdecError(f"prompt_lookup needs min_draft_tokens >= 1, got {min_draft_tokens}")
        super().__init__(target, name, max_len, prefill_chunk)
        if num_candidates > 1 and not getattr(self.engine, "supports_trees", False):
            raise SpecdecError("prompt_lookup with num_candidates > 1 verifies a token tree, which needs the "
                               "compact model (model.backend=compact); set strategy.num_candidates=1")
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.num_draft_tokens = num_draft_tokens
        self.num_candidates = num_candidates
        self.min_draft_tokens = min_draft_tokens
        self.adaptive = adaptive
        # pass costs for every draft length, measured once on this hardware (see pass_cost_curve)
        rows = [1 + k * num_candidates for k in range(1, num_draft_tokens + 1)]
        self.costs = {1: 1.0, **pass_cost_curve(self.engine, rows)} if gate else None

    batchable = True  # a proposer holds only its own n-gram index

    def make_proposer(self, costs: dict[int, float] | None = None) -> Proposer:
        return PromptLookupProposer(self.ngram_min, self.ngram_max, self.num_draft_tokens, self.num_candidates,
                                    self.min_draft_tokens, self.adaptive, self.engine.max_len,
                                    costs if costs is not None else self.costs)

    def batch_proposer(self, engine: BatchEngine) -> BatchProposer:
        # in a batch a draft lengthens every slot's pass: its price is the pass with every slot drafting
        rows = [1 + k * self.num_candidates for k in range(1, self.num_draft_tokens + 1)]
        costs = {1: 1.0, **batch_pass_cost_curve(engine, rows)} if self.costs is not None else None
        return PerSlot(lambda: self.make_proposer(costs))
