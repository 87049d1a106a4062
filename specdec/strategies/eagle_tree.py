"""EAGLE-2's dynamic draft tree (Li et al. 2024b): `strategy=eagle2`.

The drafter is EAGLE's (specdec/strategies/eagle.py, heads/eagle.py); what changes is what it drafts.
Each round grows a tree one depth per drafter pass: the `topk` nodes of the newest depth with the highest
score are expanded together in one pass (each reads its parent's guessed feature and its own token, and
attends to the real prefix and its own ancestors only), and each gives `topk` children. A node's score
is the product of the drafter's probabilities along its path, which EAGLE-2 found tracks the chance the
target accepts it. After `depth` passes every node drafted is reranked by score and the best ones are
verified in one target pass: `nodes` of them, or (`size=cost`) the prefix with the most expected tokens
per unit of the measured verification cost. Children never score above their parents, so the kept set
is a tree. `grow=useful` stops growing at the first depth whose surest node would not be verified (not in
the set just described): no descendant scores higher, so under `size=fixed` the tree verified is the
same with fewer drafter passes; under `size=cost` the set could grow with better candidates, so there it
is a close approximation. `estimate=observed` rescales the path probabilities in that expected-token
count by what the target has accepted so far in the run (at temperature 0 it accepts a drafter that
matches its distribution more often than that distribution's probability of the drafted token).
`curve=run` replaces the start-up pass-cost curve in the `size=cost` rule by a line fitted to the run's own
target passes once enough have been seen (`RunCosts`): the start-up curve is a few seconds' timing on a
machine whose speed drifts.

Lossless: greedy tree verification at temperature 0; above it the tree's nodes are fixed choices, not
draws, so verification uses the exact rule for deterministic candidates (`specdec.verify.verify_deterministic`:
recursive rejection over siblings, the target's distribution preserved).

Adaptive, so not device-resident: each depth's scores and tokens are read on the host once (one read
per drafter pass), and the expansion passes run eager, since their mask spans the drafter's cache. On the CPU
kernels each drafter pass, catch-up or expansion, is one compiled call (models/cpu_drafter.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from specdec.engine.engine import ForwardOut, pass_cost_curve
from specdec.engine.kv_cache import KVCache
from specdec.engine.static_step import BUCKETS, StaticStep
from specdec.engine.timing import clock
from specdec.errors import SpecdecError
from specdec.models.cpu_drafter import DrafterPass
from specdec.models.cpu_layer import FUSED_ROWS
from specdec.ngram import as_tokens
from specdec.strategies.base import DecodeState, Proposer
from specdec.strategies.eagle import EagleDraftNet, EagleProposer, EagleStrategy, TrainedEagle
from specdec.strategies.request_rows import RequestRows
from specdec.strategies.schedules import FixedLength
from specdec.verify import Proposal, Verdict


@dataclass
class Node:
    token: int  # target id
    parent: int  # index in the round's node list, -1 for a child of the root
    score: float  # log-probability of the path under the drafter
    depth: int  # 1 for the root's children
    slot: int | None = None  # drafter cache slot once expanded
    feature: Tensor | None = field(default=None, repr=False)  # (D,) guessed feature after it, once expanded


@dataclass
class Observed:
    """Accepted tokens against the sum of the verified nodes' path probabilities, over a run; `scale` is their
    ratio, kept within [0.5, 2]. Both start at 20 tokens, so the first rounds take probabilities at face value."""

    accepted: float = 20.0
    predicted: float = 20.0

    def scale(self) -> float:
        return min(2.0, max(0.5, self.accepted / self.predicted))

    def update(self, predicted: float, accepted: int) -> None:
        self.predicted += predicted
        self.accepted += accepted


@dataclass
class RunCosts:
    """A target pass over n tokens in one-token passes, `startup[n]` (the start-up curve) corrected by the
    run's own rounds: running means of n, t, n^2 and n t over the rounds' target passes (n tokens fed, t
    seconds from the proposal to its commit: the pass and its verification) fit t = a + b (n - 1). Once
    `least` rounds are in and n has varied by about a token (variance > 0.25), cost(n) = 1 + (b / a)(n - 1);
    before, the start-up curve. Plain means over the first 1 / `momentum` rounds, then exponential ones."""

    startup: list[float]
    least: int = 30
    momentum: float = 0.01
    rounds: int = 0
    means: list[float] = field(default_factory=lambda: [0.0] * 4)  # E[n], E[t], E[n^2], E[n t]
    slope: float | None = None  # b / a once fitted

    def observe(self, n: int, seconds: float) -> None:
        self.rounds += 1
        m = max(1.0 / self.rounds, self.momentum)
        self.means = [(1 - m) * u + m * w for u, w in zip(self.means, (n, seconds, n * n, n * seconds))]
        mn, mt, mnn, mnt = self.means
        var = mnn - mn * mn
        if self.rounds >= self.least and var > 0.25:
            b = max(0.0, (mnt - mn * mt) / var)
            a = mt - b * (mn - 1)
            self.slope = b / a if a > 0 else self.slope

    def cost(self, n: int) -> float:
        if self.slope is None:
            return self.startup[min(n, len(self.startup) - 1)]
        return 1.0 + self.slope * (n - 1)


class EagleTreeProposer(EagleProposer):
    """EAGLE's pair bookkeeping (catch-up on real features, rollback of guesses) with a dynamic tree."""

    def __init__(self, net: EagleDraftNet, cache: KVCache, depth: int, topk: int, nodes: int,
                 room: Callable[[], int], costs: list[float] | None, static: StaticStep | None = None,
                 grow: str = "all", observed: Observed | None = None, run_costs: RunCosts | None = None,
                 kernel: DrafterPass | None = None, rows: RequestRows | None = None) -> None:
        super().__init__(net, cache, _NO_ROUND, static=static, kernel=kernel, rows=rows)  # type: ignore[arg-type]
        self.depth, self.topk, self.nodes, self.costs, self.grow = depth, topk, nodes, costs, grow
        self.observed = observed  # None: path probabilities at face value
        self.run_costs = run_costs  # None: the start-up curve `costs` throughout
        self.fed_nodes, self.proposed_at = 0, 0.0  # the last proposal's size and when it was made
        self.predicted = 0.0  # the last proposal's summed path probabilities
        self.passes = 0  # drafter passes over the tree (catch-up passes not counted)
        self.room_fn = room
        self.root_feature: Tensor | None = None  # (D,) the drafter's guess of the root's feature

    def _ids(self, rows: Tensor) -> Tensor:
        ids = self.token_ids
        return rows if ids is None else ids.to(rows.device)[rows]

    def _children(self, logits: Tensor) -> tuple[list[list[int]], list[list[float]]]:
        """(n, K) drafter logits -> each row's top-k target ids and log-probs, read on the host together."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        top = logp.topk(min(self.topk, logp.shape[-1]), dim=-1)
        both = torch.cat([self._ids(top.indices).double(), top.values.double()], dim=-1).tolist()
        k = top.indices.shape[-1]
        return [[int(t) for t in r[:k]] for r in both], [r[k:] for r in both]

    def _expand(self, frontier: list[Node], tree: list[Node], start: int, prefix: int) -> Tensor:
        """One drafter pass over `frontier` (same depth), each attending to the prefix's `prefix` slots, its
        expanded ancestors and itself; writes their slots and guessed features; (n, K) logits."""
        device, n = self.net.device, len(frontier)
        length = self.cache.lengths[0]
        # built on the host, where the tree is known, and moved in one copy (no kernel per element)
        mask = np.zeros((n, length + n), dtype=np.bool_)
        mask[:, :prefix] = True
        for i, node in enumerate(frontier):
            a = node.parent
            while a >= 0:
                mask[i, tree[a].slot] = True  # type: ignore[index]
                a = tree[a].parent
            mask[i, length + i] = True
        features = torch.stack([self._parent_feature(node, tree) for node in frontier])  # (n, D)
        position = start + frontier[0].depth - 1
        if self.kernel is not None and n <= FUSED_ROWS:  # the CPU kernels' one call (models/cpu_drafter.py)
            tokens = np.array([node.token for node in frontier], dtype=np.int64)
            logits, guess = self.kernel(tokens, features.float().numpy(), self.cache, mask, np.full(n, position), 0)
        else:
            tokens = torch.tensor([node.token for node in frontier], device=device)[None]  # (1, n)
            positions = torch.full((1, n), position, device=device)
            logits, guess = self.net(tokens, features[None], positions, self.cache,
                                     torch.from_numpy(mask)[None, None].to(device))
            logits, guess = logits[0], guess[0]
        for i, node in enumerate(frontier):
            node.slot, node.feature = length + i, guess[i]
        return logits if self.rows is None else self.rows.extend(logits, guess)

    def _parent_feature(self, node: Node, tree: list[Node]) -> Tensor:
        feature = self.root_feature if node.parent < 0 else tree[node.parent].feature
        assert feature is not None
        return feature

    def propose(self, state: DecodeState) -> Proposal | None:
        L = len(state.ids)
        spare = BUCKETS[-1] if self.static is not None else 0
        useful = state.params.max_new_tokens - state.output_len - 1  # deeper nodes could never be kept
        depth = min(self.depth, useful, self.cache.max_len - spare - L - self.topk * self.depth)
        budget = min(self.nodes, self.room_fn())
        assert self.pending is not None and len(self.pending) == L - 1 - self.fed, "drafter out of step"
        if depth < 1 or budget < 1:
            return None
        logits, self.root_feature = self._run(state.ids[self.fed + 1:L], self.pending, self.fed)  # catch up
        self.fed, self.pending = L - 1, self.pending[:0]
        ids, logps = self._children(logits[None])
        tree = [Node(t, -1, lp, 1) for t, lp in zip(ids[0], logps[0])]
        frontier = list(range(len(tree)))  # indices of the newest depth's nodes
        for _ in range(depth - 1):
            best = sorted(frontier, key=lambda i: -tree[i].score)[:self.topk]  # EAGLE-2: expand the surest
            if self.grow == "useful" and best[0] not in self._kept(tree, budget):
                break  # nothing below the surest frontier node would be verified
            self.passes += 1
            ids, logps = self._children(self._expand([tree[i] for i in best], tree, L - 1, self.fed))
            frontier = []
            for at, kid_ids, kid_lps in zip(best, ids, logps):
                parent = tree[at]
                for t, lp in zip(kid_ids, kid_lps):
                    frontier.append(len(tree))
                    tree.append(Node(t, at, parent.score + lp, parent.depth + 1))
        return self._proposal(tree, budget)

    def _kept(self, tree: list[Node], budget: int) -> list[int]:
        """Indices of the nodes to verify, best first: the `budget` best by score (a child never outscores
        its parent and ties go to the shallower node, so any prefix is a tree), cut (`size=cost`) to the
        prefix with the most expected tokens per measured pass cost."""
        order = sorted(range(len(tree)), key=lambda i: (-tree[i].score, tree[i].depth))[:budget]
        if self.costs is not None:
            scale = self.observed.scale() if self.observed is not None else 1.0
            best, best_rate, expected = 0, 1.0, 1.0
            cost = self.run_costs.cost if self.run_costs is not None else self.costs.__getitem__
            for n, i in enumerate(order, start=1):
                expected += min(1.0, scale * math.exp(tree[i].score))
                if expected / cost(n + 1) > best_rate:
                    best, best_rate = n, expected / cost(n + 1)
            order = order[:best]
        return order

    def _proposal(self, tree: list[Node], budget: int) -> Proposal | None:
        order = self._kept(tree, budget)
        if self.observed is not None:
            self.predicted = sum(math.exp(tree[i].score) for i in order)
        if not order:
            return None
        order.sort(key=lambda i: (tree[i].depth, -tree[i].score))  # parents before children
        if self.run_costs is not None:  # (a clock waits for the device: only when the time is used)
            self.fed_nodes, self.proposed_at = len(order), clock(self.net.device)
        index = {i: k + 1 for k, i in enumerate(order)}
        parents = [index[tree[i].parent] if tree[i].parent >= 0 else 0 for i in order]
        return Proposal(as_tokens([tree[i].token for i in order]), parents)

    def commit(self, state: DecodeState, verdict: Verdict, out: ForwardOut) -> None:
        if self.run_costs is not None and self.fed_nodes:
            self.run_costs.observe(1 + self.fed_nodes, clock(self.net.device) - self.proposed_at)
            self.fed_nodes = 0
        if self.observed is not None and self.predicted > 0:
            self.observed.update(self.predicted, len(verdict.nodes))
        super().commit(state, verdict, out)


class _NoRound:
    """EagleProposer's chain round, unused by the tree proposer (its commit still calls `learn`)."""

    def learn(self, verdict: object) -> None:
        return None


_NO_ROUND = _NoRound()


class Eagle2(EagleStrategy):
    """EAGLE's drafter with EAGLE-2's dynamic tree: `depth` drafter passes, `topk` nodes expanded per depth
    and children per node, the best `nodes` verified (`size=cost`: as many of them as pay for their pass;
    `grow=useful`: no pass for a depth none of whose nodes could be verified)."""

    def __init__(self, target: object, name: str, drafter: TrainedEagle | EagleDraftNet, depth: int = 4,
                 topk: int = 4, nodes: int = 8, size: str = "fixed", max_len: int = 2048,
                 prefill_chunk: int = 512, grow: str = "all", estimate: str = "drafter",
                 curve: str = "startup", request_rows: bool = False) -> None:
        if (depth < 1 or topk < 1 or nodes < 1 or size not in ("fixed", "cost") or grow not in ("all", "useful")
                or estimate not in ("drafter", "observed") or curve not in ("startup", "run")):
            raise SpecdecError(f"strategy=eagle2 needs depth >= 1, topk >= 1, nodes >= 1, size fixed or cost, grow "
                               f"all or useful, estimate drafter or observed and curve startup or run; got "
                               f"depth={depth}, topk={topk}, nodes={nodes}, size={size!r}, grow={grow!r}, "
                               f"estimate={estimate!r}, curve={curve!r}")
        if curve == "run" and size != "cost":
            raise SpecdecError("strategy=eagle2 curve=run corrects the pass costs that size trees; add size=cost")
        super().__init__(target, name, drafter, FixedLength(depth), max_len, prefill_chunk, request_rows)
        if not getattr(self.engine, "supports_trees", False):
            raise SpecdecError(f"strategy=eagle2 verifies token trees, which needs the compact model; {name} runs "
                               "through transformers: use strategy=eagle (chains)")
        self.depth, self.topk, self.nodes, self.grow = depth, topk, nodes, grow
        self.observed = Observed() if estimate == "observed" else None  # shared by the run's proposers
        self.costs: list[float] | None = None
        if size == "cost":
            measured = pass_cost_curve(self.engine, list(range(2, nodes + 2)))
            self.costs = [0.0, 1.0]
            for n in range(2, nodes + 2):  # a bigger pass never counts as cheaper
                self.costs.append(max(self.costs[-1], measured[n]))
        # shared by the run's proposers, so the fit spans turns
        self.run_costs = RunCosts(self.costs) if curve == "run" and self.costs is not None else None

    def make_proposer(self) -> Proposer:
        room = lambda: self.engine.max_len - self.engine.length - 1  # noqa: E731
        self.last_proposer = EagleTreeProposer(self.net, self.cache, self.depth, self.topk, self.nodes, room,
                                               self.costs, static=self.static, grow=self.grow,
                                               observed=self.observed, run_costs=self.run_costs, kernel=self.kernel,
                                               rows=self.rows)
        return self.last_proposer
