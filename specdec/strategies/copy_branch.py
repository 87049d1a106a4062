"""A copy branch in a drafter's token tree: the context's continuation of its final n-gram, merged in.

Model drafters (Medusa's heads) guess well in open text and poorly where the output copies its input
(extraction, summaries, code edits, translations that keep names and numbers) or repeats itself;
prompt lookup is the reverse. `CopyBranch` wraps a tree proposer: each step it hangs the copy as one
more path of the drafter's tree, sharing nodes where the two agree, so one target pass tests both and
the verifier keeps whichever path the target agrees with longer. Any tree verified by the target is
lossless, so this changes speed only, never the output.

The copy's length follows this turn's record per match length, as `PromptLookupProposer` does: it
grows only while the expected extra tokens pay for the bigger pass (costs measured at start-up).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.engine.engine import ForwardOut
from specdec.ngram import NGramIndex, as_tokens, lookup, match_length
from specdec.strategies.base import DecodeState, Proposer
from specdec.strategies.prompt_lookup import expected_kept
from specdec.verify import Proposal, Verdict


@dataclass
class CopyBranch:
    """A proposer: `inner`'s tree plus the copy branch (at most `max_tokens` deep)."""

    inner: Proposer
    ngram_min: int
    ngram_max: int
    max_tokens: int
    room: int  # the cache's size: the tree plus its root must fit after the sequence
    costs: dict[int, float]  # a pass over n tokens relative to one, n = 1 .. inner nodes + 1 + max_tokens
    # copy at temperature > 0 too: only under an exact acceptance rule. Medusa's typical acceptance takes
    # any token the target finds plausible enough, and offered a copy each step its sampled outputs looped
    # (experiments/README.md, "A copy branch in Medusa's tree"), so it gets the heads' tree alone.
    sampled: bool = True
    index: NGramIndex = field(init=False)
    # this turn's record per match length n: of the copies that reached depth i, how many had token i kept
    tried: dict[int, list[int]] = field(init=False)
    hit: dict[int, list[int]] = field(init=False)
    steps: int = 0  # target passes this turn, and tokens they committed: the tree's rate without the copy
    committed: int = 0
    _nodes: list[int] = field(default_factory=list)  # the copy's node per depth in the last proposal (1-based)
    _n: int = 0

    def __post_init__(self) -> None:
        self.index = NGramIndex(self.ngram_min, self.ngram_max)
        self.tried = {n: [0] * (self.max_tokens + 1) for n in range(self.ngram_min, self.ngram_max + 1)}
        self.hit = {n: [0] * (self.max_tokens + 1) for n in range(self.ngram_min, self.ngram_max + 1)}

    def start(self, state: DecodeState, out: ForwardOut) -> None:
        self.index.extend(state.ids)
        self.inner.start(state, out)

    def length(self, n: int, cap: int, tree: int) -> int:
        """Copy tokens in 0..cap maximising expected committed tokens per unit of pass time.

        Without the copy a pass over the tree's `tree` nodes commits what the tree has committed per
        pass so far this turn; the copy's token i adds P(tokens 1..i kept) (`expected_kept`). Counting
        the copy's kept tokens as all extra overstates it where the tree found the same tokens; the cost
        rule is only there to keep poor matches from growing every pass.
        """
        base = (self.committed + 2.0) / (self.steps + 1.0)  # 2: a mildly optimistic prior for the tree
        best, best_value = 0, base / self.costs[tree + 1]
        for k, expected in enumerate(expected_kept(self.hit[n], self.tried[n], cap), start=1):
            value = (base + expected) / self.costs[tree + 1 + k]
            if value > best_value:
                best, best_value = k, value
        return best

    def propose(self, state: DecodeState) -> Proposal | None:
        self.index.extend(state.ids)
        proposal = self.inner.propose(state)
        self._nodes = []
        if not (self.sampled or state.params.sampling.greedy):
            return proposal
        tokens = proposal.tokens.tolist() if proposal is not None else []
        parents = list(proposal.parents) if proposal is not None else []
        if proposal is not None and (proposal.probs is not None or proposal.mask is not None
                                     or proposal.depth is not None or -1 in parents):
            return proposal  # draft probabilities or a mask of its own: the copy would not fit them
        useful = state.params.max_new_tokens - state.output_len - 1
        cap = min(self.max_tokens, useful, self.room - len(state.ids) - len(tokens))
        n = match_length(state.ids, self.index) if cap > 0 else 0
        k = self.length(n, cap, len(tokens)) if n > 0 else 0
        found = lookup(state.ids, self.index, k, 1) if k > 0 else []
        if not found:
            return proposal
        self._n = n
        child = {(p, t): i + 1 for i, (p, t) in enumerate(zip(parents, tokens))}  # (parent, token) -> node
        node = 0
        for tok in found[0]:
            nxt = child.get((node, tok))
            if nxt is None:  # a new node, after every existing one: parents still come first
                tokens.append(tok)
                parents.append(node)
                nxt = len(tokens)
                child[(node, tok)] = nxt
            node = nxt
            self._nodes.append(node)
        return Proposal(as_tokens(tokens), parents)  # host ids, as the loop reads them

    def commit(self, state: DecodeState, verdict: Verdict, out: ForwardOut) -> None:
        self.steps += 1
        self.committed += len(verdict.tokens)
        if self._nodes:
            kept = set(verdict.nodes)
            tried, hit = self.tried[self._n], self.hit[self._n]
            for i, node in enumerate(self._nodes, start=1):
                tried[i] += 1
                if node not in kept:
                    break
                hit[i] += 1
        self.inner.commit(state, verdict, out)
