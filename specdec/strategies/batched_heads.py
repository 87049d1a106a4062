"""Medusa's fixed tree for every slot of a batch at once (`strategy=medusa` at generation.batch_size > 1).

Terms: a *slot* is one sequence of the batch (strategies/batched.py); *node i* (1..N) is the i-th node of
the fixed tree in the order this proposer lists them: likeliest first by prior, every parent before its
children, so the first n nodes (a *prefix*) are a tree too. A node is *accepted* when it lies on the path
verification keeps.

Each round the heads run once over every drafting slot's newest accepted hidden state, stacked (S, D):
on a CPU a heads call streams the heads' output matrix, so S rows cost about what one does. Each slot's
node tokens are read from its own top-k.

How many nodes to verify is chosen per round for the whole batch: with p_i the rate at which node i is
accepted when verified, a prefix of n nodes commits 1 + p_1 + ... + p_n tokens per slot in expectation
and costs c(1 + n) + h target passes, c(m) being the measured cost of a pass in which every slot feeds m
tokens (relative to one each) and h the heads call, both measured at this batch size at start-up. n
maximises their ratio; 0 (no tree, no heads call) wins where the batch already fills the products. The
p_i are counts learnt online over every slot's rounds, starting from a prior worth `prior_weight` rounds
(the tuned tree's rank accuracies where the tree file has them). While n is 0, one slot in turn verifies
the whole tree every `probe_every` rounds, which keeps the counts current.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

import torch
from torch import Tensor

from specdec.engine.batch import BatchEngine, batch_pass_times
from specdec.engine.engine import ForwardOut
from specdec.engine.timing import clock
from specdec.resolvers import REPO_ROOT
from specdec.strategies.base import DecodeState
from specdec.trees import paths_to_parents
from specdec.verify import Proposal, Verdict

# Per-depth acceptance of a head's top guess and of any lower rank, where no tuned tree says better.
SIMPLE_PRIOR = (0.5, 0.1)


@dataclass
class TreeCosts:
    """Start-up measurements at one batch size, in target passes of one token per slot."""

    verify: list[float]  # verify[m]: a pass with m tokens per slot (verify[1] = 1; index 0 unused)
    heads: float  # one heads call over every slot's state

    @classmethod
    def measure(cls, engine: BatchEngine, heads: Any, nodes: int, width: int, depth: int,
                reps: int = 5) -> TreeCosts:
        t = batch_pass_times(engine, list(range(1, nodes + 2)), reps=reps)
        curve = [1.0]
        for m in range(1, nodes + 2):  # non-decreasing: a dip is timing noise
            curve.append(max(curve[-1], t[m] / t[1]))
        hidden = torch.zeros(engine.batch, engine.model.args.dim, device=engine.device, dtype=engine.model.dtype)
        roots = [0] * engine.batch
        times = []
        for rep in range(reps + 1):  # the first call warms up
            start = clock(engine.device)
            heads.topk(hidden, width, depth, root=roots)
            if rep:
                times.append(clock(engine.device) - start)
        return cls(curve, median(times) / t[1])

    def round_cost(self, n: int) -> float:
        """A round verifying n nodes per slot (0: a plain step, no heads call)."""
        return self.verify[min(1 + n, len(self.verify) - 1)] + (self.heads if n else 0.0)


def node_priors(paths: list[tuple[int, ...]], source: str | None = None) -> list[float]:
    """Each node's prior acceptance rate (nodes in `paths_to_parents` order): the product of its path's
    per-depth rank accuracies from a tuned tree file's `rank_accuracy` (python -m heads.tree_tuning), the
    estimate the tuner itself builds trees with; else `SIMPLE_PRIOR`'s."""
    _, keys = paths_to_parents(paths)
    acc = _rank_accuracy(source)

    def rate(depth: int, rank: int) -> float:
        if acc is not None and depth < len(acc) and rank < len(acc[depth]):
            return float(acc[depth][rank])
        return SIMPLE_PRIOR[0] if rank == 0 else SIMPLE_PRIOR[1]

    return [math.prod(rate(d, r) for d, r in enumerate(key)) for key in keys]


def _rank_accuracy(source: str | None) -> list[list[float]] | None:
    if not source:
        return None
    path = Path(source).expanduser()
    if not path.is_absolute() and not path.is_file():
        path = REPO_ROOT / path  # trees written by the tuner live in the repository
    if not path.is_file():
        return None  # `default`, `chain`, or paths given inline
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    return data.get("rank_accuracy") if isinstance(data, dict) else None


@dataclass
class BatchedHeads:
    """A `BatchProposer` (strategies/batched.py) for Medusa heads and a fixed tree of rank paths."""

    heads: Any  # specdec.strategies.medusa.Heads: `topk` takes (S, D) states and one root each
    paths: list[tuple[int, ...]]
    max_len: int  # a slot's cache size
    costs: TreeCosts
    priors: list[float]  # (N,) each node's prior acceptance rate
    device: torch.device | str = "cpu"  # the heads' (the target's), where node tokens are gathered
    prior_weight: float = 8.0  # rounds the prior counts for
    probe_every: int = 16
    hidden: dict[int, Tensor] = field(default_factory=dict)  # (D,) per slot: its newest accepted token's state
    verified: dict[int, int] = field(default_factory=dict)  # nodes each slot verifies this round
    _idle: int = 0

    @classmethod
    def build(cls, heads: Any, paths: list[tuple[int, ...]], engine: BatchEngine, source: str | None = None
              ) -> BatchedHeads:
        """For the slots of `engine`, its pass costs measured now; `source`: the tree's file, for priors."""
        _, keys = paths_to_parents(paths)
        costs = TreeCosts.measure(engine, heads, len(keys), 1 + max(k[-1] for k in keys), max(map(len, keys)))
        return cls(heads, paths, engine.max_len, costs, node_priors(paths, source), engine.device)

    def __post_init__(self) -> None:
        _, keys = paths_to_parents(self.paths)
        if len(self.priors) != len(keys):
            raise ValueError(f"{len(self.priors)} priors for a tree of {len(keys)} nodes")
        # Most likely first, every parent before its children: then each prefix holds the likeliest nodes
        # a prefix can hold (the tuned tree's rank-1 sibling may well be worth less than a top-1 grandchild).
        order: list[int] = []
        placed: set[tuple[int, ...]] = {()}
        while len(order) < len(keys):
            i = max((i for i in range(len(keys)) if keys[i] not in placed and keys[i][:-1] in placed),
                    key=lambda i: (self.priors[i], -i))
            order.append(i)
            placed.add(keys[i])
        keys, self.priors = [keys[i] for i in order], [self.priors[i] for i in order]
        index = {k: n for n, k in enumerate(keys, start=1)} | {(): 0}
        self.parents = [index[k[:-1]] for k in keys]  # (N,) in the new order
        self.width = 1 + max(k[-1] for k in keys)  # top-k needed from every head
        self.head_of = [len(k) - 1 for k in keys]  # (N,) the head that fills node i (its depth - 1) ...
        self.rank_of = [k[-1] for k in keys]  # ... and its rank among that head's guesses
        depths = [len(k) for k in keys]
        # the same on the device: gathering node tokens there leaves them for the loop's one read
        self._head_t, self._rank_t = (torch.tensor(v, device=self.device) for v in (self.head_of, self.rank_of))
        self.depth_of = [max(depths[:n], default=0) for n in range(len(depths) + 1)]  # heads a prefix reads
        # up_to[m]: the longest prefix of nodes no deeper than m
        self.up_to = [next((n for n, d in enumerate(depths) if d > m), len(depths)) for m in range(max(depths) + 1)]
        self.tries = [self.prior_weight] * len(keys)  # (N,) rounds each node was verified in, prior included
        self.hits = [self.prior_weight * p for p in self.priors]  # (N,) of which it was accepted

    @property
    def rates(self) -> list[float]:
        """(N,) each node's acceptance rate when verified."""
        return [h / t for h, t in zip(self.hits, self.tries)]

    def size(self) -> int:
        """Nodes every slot verifies this round: the prefix with the most expected committed tokens per
        unit of round cost; 0 (a plain step) when no prefix beats it."""
        best, best_rate, expected = 0, 1.0 / self.costs.round_cost(0), 1.0
        for n, p in enumerate(self.rates, start=1):
            expected += p
            if expected / self.costs.round_cost(n) > best_rate:
                best, best_rate = n, expected / self.costs.round_cost(n)
        return best

    def _limit(self, state: DecodeState) -> int:
        """The most nodes slot `state` may verify: deeper nodes than its token budget could never be kept,
        and its cache (which holds len(ids) - 1 tokens) must take the root and the nodes."""
        useful = state.params.max_new_tokens - state.output_len - 1
        return min(self.up_to[min(max(useful, 0), len(self.up_to) - 1)], self.max_len - len(state.ids))

    def _sizes(self, limits: dict[int, int]) -> dict[int, int]:
        """Slots that verify a tree this round and how many nodes each."""
        n = self.size()
        if n == 0:
            self._idle += 1
            if not self.probe_every or self._idle % self.probe_every or not limits:
                return {}
            b = sorted(limits)[(self._idle // self.probe_every) % len(limits)]  # slots take turns probing
            return {b: limits[b]} if limits[b] > 0 else {}
        return {b: min(n, m) for b, m in limits.items() if min(n, m) > 0}

    def start(self, b: int, state: DecodeState, out: ForwardOut, fresh: bool) -> None:
        self.hidden[b] = out.hidden[-1].clone()  # a row, not a view that keeps the whole prompt's states
        self.verified.pop(b, None)

    def propose(self, states: dict[int, DecodeState]) -> dict[int, Proposal | None]:
        sizes = self._sizes({b: self._limit(s) for b, s in states.items()})
        proposals: dict[int, Proposal | None] = {b: None for b in states}
        if not sizes:
            return proposals
        slots = list(sizes)
        m = max(sizes.values())  # nodes 1..m are read; heads deeper than theirs are not run
        hidden = torch.stack([self.hidden[b] for b in slots])  # (S, D)
        top = self.heads.topk(hidden, self.width, self.depth_of[m],
                              root=[states[b].ids[-1] for b in slots])  # (S, depth, width)
        tokens = top[:, self._head_t[:m], self._rank_t[:m]]  # (S, m) on the heads' device
        for i, b in enumerate(slots):
            n = sizes[b]
            proposals[b] = Proposal(tokens[i, :n], self.parents[:n])
        self.verified = dict(sizes)
        return proposals

    def commit(self, b: int, state: DecodeState, verdict: Verdict, out: ForwardOut) -> None:
        self.hidden[b] = out.hidden[verdict.nodes[-1] if verdict.nodes else 0].clone()
        n = self.verified.pop(b, 0)
        accepted = set(verdict.nodes)
        for i in range(n):  # node i + 1 was verified; accepted iff on the kept path
            self.tries[i] += 1
            self.hits[i] += (i + 1) in accepted
