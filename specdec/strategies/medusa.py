"""Draft heads on the target's hidden state, verified as a token tree: `strategy=medusa` (Medusa-1, Cai et al.
2024: independent heads), `strategy=hydra` (Ankner et al. 2024: sequentially dependent heads) and
`strategy=hydra_copy` (Hydra's heads plus a copy branch). One class; the config names the heads and tree.

Each step the heads read the hidden state of the newest accepted token; the tree's nodes are the
heads' top-ranked guesses ("choices": one tuple of ranks per root-to-node path, head d filling depth
d + 1). The shared loop verifies the whole tree in one target pass and keeps the longest accepted
path. The tree is fixed (`strategy.tree`: `tuned`, Medusa's sparse tree from the heads' measured rank
accuracies, medusa's default; `default`, `chain` or a list of paths) or `dynamic`: rebuilt every step from
the heads' probabilities (`DynamicMedusaProposer`; hydra's default).
At temperature 0 acceptance is greedy (lossless). At temperature > 0 the default is Medusa's
typical acceptance, which is faster but NOT distribution-preserving; `acceptance=exact` uses the
exact multi-candidate rule of `specdec.verify` instead. With `copy_tokens` > 0 the context's own
continuation joins the tree as one more path (`specdec.strategies.copy_branch.CopyBranch`), except under
typical acceptance at temperature > 0.

The heads come built from the config (`heads._target_` pointing at a loader in `heads/`), called
with the target; this module only needs their `num_heads`, `topk` and `topk_logprobs`. Heads whose
guesses depend on the path above a node (`PathHeads`, heads/medusa_sequential.py) are instead asked
once per tree node, with that node's token (`PathMedusaProposer`, `MedusaProposer.path_tokens`).

At generation.batch_size > 1 a fixed tree without a copy branch runs through
`specdec.strategies.batched_heads.BatchedHeads` (one heads call for every slot, the tree's size set by the
batch's pass costs); dynamic trees, path-reading heads and the copy branch decode at batch size 1 only.
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from specdec.engine.batch import BatchEngine
from specdec.engine.engine import ForwardOut, pass_cost_curve
from specdec.errors import SpecdecError
from specdec.models.loader import LoadedModel
from specdec.ngram import as_tokens
from specdec.resolvers import REPO_ROOT
from specdec.strategies.base import DecodeState, Proposer, SpeculativeStrategy
from specdec.strategies.batched import BatchProposer
from specdec.strategies.copy_branch import CopyBranch
from specdec.trees import paths_to_parents
from specdec.verify import Proposal, Verdict, verify_typical

# A hand-made tree of 10 nodes for 4 heads, wide where the heads are surest (shallow, low ranks).
# Small on purpose: on a CPU a pass costs more the more tokens it feeds, so past about this many nodes
# extra guesses cost more than they are expected to save (python -m heads.tree_tuning measures this for
# trained heads; experiments/README.md, "Figures moved out of code and configs").
DEFAULT_TREE: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,),
    (0, 0), (0, 1), (1, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0),
    (0, 0, 0, 0),
)
ACCEPTANCE = ("typical", "exact")


@dataclass(frozen=True)
class DynamicTree:
    """`strategy.tree=dynamic`: every step, the `nodes` most probable paths under the heads' own
    probabilities (guesses per head: `width`), leaving out paths below `min_prob`. `size=cost` keeps
    only as many of them as maximise expected tokens per unit of pass time (pass costs measured at
    start-up); `size=fixed` keeps all."""

    nodes: int = 5
    width: int = 4
    min_prob: float = 0.0
    size: str = "fixed"

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.width < 1 or not 0 <= self.min_prob < 1 or self.size not in ("fixed", "cost"):
            raise SpecdecError(f"strategy.tree=dynamic needs nodes >= 1, width >= 1, 0 <= min_prob < 1 and size "
                               f"fixed or cost; got nodes={self.nodes}, width={self.width}, "
                               f"min_prob={self.min_prob}, size={self.size!r}")


class Heads(Protocol):
    """(dim,) hidden state of the newest accepted token and `root`, the token the target chose after it
    (heads that do not read it ignore it) -> (depth, k) ids, and for `topk_logprobs` their log-probabilities.
    Batched (strategies/batched_heads.py): (S, dim) states and a list of S roots -> (S, depth, k)."""

    num_heads: int

    def topk(self, hidden: Tensor, k: int, depth: int | None = None, root: int | list[int] | None = None
             ) -> Tensor: ...

    def topk_logprobs(self, hidden: Tensor, k: int, depth: int | None = None,
                      root: int | list[int] | None = None) -> tuple[Tensor, Tensor]: ...


@runtime_checkable
class PathHeads(Heads, Protocol):
    """Heads whose guesses depend on the path above them (heads/medusa_sequential.py): `tree_start` gives
    the root's node and its children's guesses, `tree_expand` a child's node and its own children's
    guesses, each as (width,) ids and (width,) log-probabilities."""

    def tree_start(self, hidden: Tensor, root: int, width: int) -> tuple[Any, Tensor, Tensor]: ...

    def tree_expand(self, parent: Any, token: int, width: int) -> tuple[Any, Tensor, Tensor]: ...


def tuned_tree_path(model_name: str, heads_name: str = "medusa") -> Path:
    """Where `python -m heads.tree_tuning` writes the tree for a model's heads (configs/tune_tree.yaml `out`);
    `heads_name`: medusa, or hydra for sequential heads."""
    return REPO_ROOT / "heads" / "trees" / f"{model_name}-{heads_name}.yaml"


def chain_tree(depth: int) -> list[tuple[int, ...]]:
    """Top-1 of each head: a chain of `depth` nodes."""
    return [(0,) * d for d in range(1, depth + 1)]


def load_tree(spec: str | Sequence[Sequence[int]], num_heads: int) -> list[tuple[int, ...]]:
    """`default`, `chain`, a YAML/JSON file (a list of paths, or a mapping with `choices`), or the paths."""
    if isinstance(spec, str):
        if spec == "default":
            paths: Any = [p for p in DEFAULT_TREE if len(p) <= num_heads]
        elif spec == "chain":
            paths = chain_tree(num_heads)
        else:
            paths = _read_tree_file(Path(spec).expanduser())
    else:
        paths = spec
    try:
        tree = [tuple(int(r) for r in p) for p in paths]
    except (TypeError, ValueError):
        raise SpecdecError(f"strategy.tree must be a list of rank lists such as [[0],[1],[0,0]]; "
                           f"got {spec!r}") from None
    if not tree or any(len(p) == 0 or min(p) < 0 for p in tree):
        raise SpecdecError("strategy.tree needs at least one path of non-negative ranks, e.g. [[0],[0,0]]")
    deepest = max(tree, key=len)
    if len(deepest) > num_heads:
        raise SpecdecError(f"tree path {list(deepest)} is {len(deepest)} deep but the heads guess only "
                           f"{num_heads} tokens ahead; use a shallower tree or heads with more heads")
    return tree


def _read_tree_file(path: Path) -> Any:
    if not path.is_absolute() and not path.is_file() and (REPO_ROOT / path).is_file():
        path = REPO_ROOT / path  # trees written by the tuner live in the repository
    if not path.is_file():
        raise SpecdecError(f"tree file {path} not found; use strategy.tree=default, chain, a file written by "
                           "python -m heads.tree_tuning, or a list of rank paths")
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    return data["choices"] if isinstance(data, dict) else data


class HeadsProposer:
    """Keeps the hidden state of the newest accepted token, which the heads read each step."""

    hidden: Tensor | None = None  # (dim,)
    heads: Heads

    def start(self, state: DecodeState, out: ForwardOut) -> None:
        self.hidden = out.hidden[-1]

    def commit(self, state: DecodeState, verdict: Verdict, out: ForwardOut) -> None:
        self.hidden = out.hidden[verdict.nodes[-1] if verdict.nodes else 0]


class MedusaProposer(HeadsProposer):
    """Turns the heads' top-k into one fixed tree; `device`: the heads' (the target's), where the node
    tokens are gathered, so that the loop reads them with the target's choices in its one transfer."""

    def __init__(self, heads: Heads, paths: list[tuple[int, ...]], room: Callable[[], int],
                 device: torch.device | str = "cpu") -> None:
        self.heads = heads
        self.parents, keys = paths_to_parents(paths)
        self.width = 1 + max(k[-1] for k in keys)  # top-k needed from every head
        # (N,) depth - 1 = the head that fills it, and the node's rank among that head's guesses
        self.head_of = torch.tensor([len(k) - 1 for k in keys], device=device)
        self.rank_of = torch.tensor([k[-1] for k in keys], device=device)
        depth = [len(k) for k in keys]
        self.depth = max(depth)  # heads the tree reads: deeper ones are not run
        self.up_to = [sum(d <= m for d in depth) for m in range(max(depth) + 1)]  # nodes of depth <= m
        self.room = room
        self.keys = keys
        self.inner = {k[:-1] for k in keys if len(k) > 1}  # paths with children in the tree

    def candidates(self, state: DecodeState) -> Tensor:
        """(depth, width) guesses: row d ranks the heads' guesses for the token d + 1 after the root."""
        assert self.hidden is not None
        return self.heads.topk(self.hidden, self.width, self.depth, root=state.ids[-1])

    def path_tokens(self, heads: PathHeads, state: DecodeState) -> Tensor:
        """(N,) node tokens from heads that read the path: each node's rank among the guesses made after
        its own parent, so a second-ranked branch gets children guessed for it."""
        assert self.hidden is not None
        start, ids, _ = heads.tree_start(self.hidden, state.ids[-1], self.width)
        kids: dict[tuple[int, ...], tuple[Any, list[int]]] = {(): (start, ids.tolist())}
        tokens = []
        for key in self.keys:  # parents first
            node, ranked = kids[key[:-1]]
            tokens.append(ranked[key[-1]])
            if key in self.inner:
                child, c_ids, _ = heads.tree_expand(node, tokens[-1], self.width)
                kids[key] = (child, c_ids.tolist())
        return as_tokens(tokens)

    def propose(self, state: DecodeState) -> Proposal | None:
        if isinstance(self.heads, PathHeads):
            tokens = self.path_tokens(self.heads, state)
        else:
            tokens = self.candidates(state)[self.head_of, self.rank_of]  # (N,) on the heads' device
        # Nodes are in (depth, rank) order with parents first, so any prefix is still a tree.
        # Past the token budget deeper nodes could never be kept: leave them out.
        useful = state.params.max_new_tokens - state.output_len - 1
        n = min(self.up_to[min(max(useful, 0), len(self.up_to) - 1)], self.room())
        if n <= 0:
            return None
        return Proposal(tokens[:n], self.parents[:n])


class Medusa(SpeculativeStrategy):
    def __init__(self, target: LoadedModel, name: str = "medusa", max_len: int = 2048, prefill_chunk: int = 512,
                 heads: Callable[..., Heads] | Heads | None = None, tree: str | Sequence[Sequence[int]] = "dynamic",
                 nodes: int = 5, width: int = 4, min_prob: float = 0.0, size: str = "fixed",
                 acceptance: str = "typical", epsilon: float = 0.09, delta: float = 0.3,
                 copy_tokens: int = 0, ngram_min: int = 1, ngram_max: int = 3) -> None:
        super().__init__(target, name, max_len, prefill_chunk)
        if copy_tokens < 0 or not 1 <= ngram_min <= ngram_max:
            raise SpecdecError(f"strategy=medusa needs copy_tokens >= 0 and 1 <= ngram_min <= ngram_max, got "
                               f"{copy_tokens}, {ngram_min}, {ngram_max}; e.g. strategy.copy_tokens=0 (no copy branch)")
        if heads is None:
            raise SpecdecError("strategy=medusa needs heads: set strategy.heads (see configs/strategy/medusa.yaml)")
        self.heads: Heads = heads(target=target) if callable(heads) and not hasattr(heads, "topk") else heads
        if acceptance not in ACCEPTANCE:
            raise SpecdecError(f"unknown strategy.acceptance={acceptance!r}; use typical or exact")
        if not (0 < epsilon <= 1 and delta > 0):
            raise SpecdecError(f"typical acceptance needs 0 < epsilon <= 1 and delta > 0, got {epsilon}, {delta}")
        if tree == "tuned":  # what heads.tree_tuning wrote for this model, else the hand-made tree
            sequential = bool(getattr(getattr(self.heads, "cfg", None), "sequential", False))
            tuned = tuned_tree_path(target.name, "hydra" if sequential else "medusa")
            tree = str(tuned) if tuned.is_file() else "default"
        self.tree_source = tree if isinstance(tree, str) else "paths"
        # nodes, width and min_prob shape only the dynamic tree; a fixed tree is its list of paths
        self.tree: list[tuple[int, ...]] | DynamicTree = (
            DynamicTree(nodes, width, min_prob, size) if tree == "dynamic" else load_tree(tree, self.heads.num_heads))
        is_chain = (self.tree.nodes == 1 if isinstance(self.tree, DynamicTree)
                    else sorted(self.tree) == chain_tree(max(map(len, self.tree))))
        if not is_chain and not getattr(self.engine, "supports_trees", False):
            raise SpecdecError(f"Medusa trees need the compact model but {target.name} runs through transformers; "
                               "use strategy.tree=chain")
        self.acceptance, self.epsilon, self.delta = acceptance, epsilon, delta
        if copy_tokens and not getattr(self.engine, "supports_trees", False):
            raise SpecdecError("strategy.copy_tokens > 0 adds a branch to the tree, which needs the compact "
                               "model; set strategy.copy_tokens=0")
        self.copy_tokens, self.ngram_min, self.ngram_max = copy_tokens, ngram_min, ngram_max
        cost_sized = isinstance(self.tree, DynamicTree) and self.tree.size == "cost"
        # pass costs relative to one token, measured once on this hardware for the tree and for the copy
        tree_nodes = self.tree.nodes if isinstance(self.tree, DynamicTree) else len(self.tree)
        self.pass_costs: dict[int, float] = {}
        if cost_sized or copy_tokens:
            self.pass_costs = {1: 1.0, **pass_cost_curve(self.engine, list(range(2, tree_nodes + copy_tokens + 2)))}
        self.costs: list[float] | None = None  # costs[n]: a pass over n tokens / one token
        if cost_sized:
            self.costs = [0.0, 1.0]
            for n in range(2, tree_nodes + 2):  # a bigger pass never counts as cheaper
                self.costs.append(max(self.costs[-1], self.pass_costs[n]))
        if getattr(self.heads, "compiled", None) is not None:
            self.warm_up_heads()

    @torch.inference_mode()  # decode steps pass inference tensors: guards tell them from plain ones
    def warm_up_heads(self) -> None:
        """Trace the heads' compiled steps now (model.compile), so that no decode step pays for it."""
        heads: Any = self.heads
        width = self.tree.width if isinstance(self.tree, DynamicTree) else 1 + max(p[-1] for p in self.tree)
        hidden = torch.zeros(heads.cfg.hidden_size, device=heads.proj.device, dtype=heads.proj.dtype)
        root = 0 if heads.reads_root else None
        heads.topk_logprobs(hidden, width, root=root)
        if isinstance(heads, PathHeads):
            node, _, _ = heads.tree_start(hidden, 0, width)
            for _ in range(1, heads.num_heads):
                node, _, _ = heads.tree_expand(node, 0, width)

    @property
    def paths(self) -> list[tuple[int, ...]]:
        """The fixed tree's paths (a dynamic tree has none until a step builds it)."""
        if isinstance(self.tree, DynamicTree):
            raise AttributeError("a dynamic tree has no fixed paths")
        return self.tree

    batchable = True  # a fixed tree without a copy branch: one heads call for every slot (strategies/batched_heads.py)

    def batch_proposer(self, engine: BatchEngine) -> BatchProposer:
        from specdec.strategies.batched_heads import BatchedHeads

        # a dynamic tree, path-reading (sequential) heads and the copy branch are per-slot work not batched yet
        if isinstance(self.heads, PathHeads):
            raise SpecdecError(f"strategy {self.name} cannot decode in batches yet; run it with "
                               "generation.batch_size=1")
        if isinstance(self.tree, DynamicTree) or self.copy_tokens:
            raise SpecdecError(f"strategy {self.name} cannot decode in batches with a dynamic tree or a copy branch "
                               "yet; run it with strategy.tree=tuned strategy.copy_tokens=0 or generation.batch_size=1")
        return BatchedHeads.build(self.heads, self.tree, engine, self.tree_source)

    def make_proposer(self) -> Proposer:
        heads = self.make_heads_proposer()
        if not self.copy_tokens:
            return heads
        return CopyBranch(heads, self.ngram_min, self.ngram_max, self.copy_tokens, self.engine.max_len,
                          self.pass_costs, sampled=self.acceptance == "exact")

    def make_heads_proposer(self) -> HeadsProposer:
        # the tree plus its root must fit the cache; the loop checks nothing else
        room = lambda: self.engine.max_len - self.engine.length - 1  # noqa: E731
        if isinstance(self.tree, DynamicTree):
            kind = PathMedusaProposer if isinstance(self.heads, PathHeads) else DynamicMedusaProposer
            return kind(self.heads, self.tree, room, self.costs)
        return MedusaProposer(self.heads, self.tree, room, self.engine.device)

    def accept(self, proposal: Proposal, logits: Tensor, state: DecodeState) -> Verdict:
        if self.acceptance == "typical" and not state.params.sampling.greedy:
            return verify_typical(proposal, logits, state.params.sampling, state.generator, self.epsilon, self.delta)
        return super().accept(proposal, logits, state)


class DynamicMedusaProposer(HeadsProposer):
    """Builds a new tree every step from the heads' probabilities instead of one fixed tree.

    A node's score is the product of its path's head probabilities (the heads guess independently
    given the root, as Medusa's tree construction assumes); the `nodes` best paths form the tree, so a
    confident first head buys depth and an unsure one buys siblings (the idea of EAGLE-2's dynamic
    trees, applied to Medusa's heads). Paths below `min_prob` are left out, so unsure steps pass fewer
    tokens. Deterministic: the same heads give the same tree, and verification keeps any tree lossless.
    Adaptive, so not device-resident: the heads' top-k are read on the host once per step, beside the
    target's one read (a fixed tree, `MedusaProposer`, stays on the device).
    """

    def __init__(self, heads: Heads, tree: DynamicTree, room: Callable[[], int],
                 costs: list[float] | None = None) -> None:
        self.heads, self.nodes, self.width, self.costs = heads, tree.nodes, tree.width, costs
        self.depth = heads.num_heads
        self.log_min = math.log(tree.min_prob) if tree.min_prob > 0 else -math.inf
        self.room = room

    def limits(self, state: DecodeState) -> tuple[int, int]:
        """(depth, nodes) this step may use: deeper nodes than the token budget could never be kept,
        and the tree plus its root must fit the cache."""
        useful = state.params.max_new_tokens - state.output_len - 1
        return min(self.depth, useful), min(self.nodes, self.room())

    def propose(self, state: DecodeState) -> Proposal | None:
        assert self.hidden is not None
        depth, budget = self.limits(state)
        if depth <= 0 or budget <= 0:
            return None
        ids, logp = self.heads.topk_logprobs(self.hidden, self.width, depth, root=state.ids[-1])  # (depth, width)
        ids_l, logp_l = ids.tolist(), logp.tolist()
        # Best-first over paths of ranks: a path's score only falls as it grows or its last rank rises,
        # so popping in score order and then offering its first child and next sibling yields the
        # best `budget` paths, every parent before its children.
        heap = [(-logp_l[0][0], (0,))]
        index: dict[tuple[int, ...], int] = {(): 0}
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []  # popped in falling order: any prefix holds the best paths
        while heap and len(tokens) < budget:
            neg, path = heapq.heappop(heap)
            if -neg < self.log_min:
                break
            scores.append(-neg)
            index[path] = len(tokens) + 1
            tokens.append(ids_l[len(path) - 1][path[-1]])
            parents.append(index[path[:-1]])
            prefix = -neg - logp_l[len(path) - 1][path[-1]]  # the parent's score
            if path[-1] + 1 < self.width:
                heapq.heappush(heap, (-(prefix + logp_l[len(path) - 1][path[-1] + 1]), path[:-1] + (path[-1] + 1,)))
            if len(path) < depth:
                heapq.heappush(heap, (neg - logp_l[len(path)][0], path + (0,)))
        return self._proposal(tokens, parents, scores)

    def _proposal(self, tokens: list[int], parents: list[int], scores: list[float]) -> Proposal | None:
        if self.costs is not None:  # the prefix with the most expected tokens (root's included) per pass time
            best, best_rate, expected = 0, 1.0, 1.0  # 1.0: no tree, a plain one-token step
            for n, score in enumerate(scores, start=1):  # host floats: a few nodes, no device work
                expected += math.exp(score)
                if expected / self.costs[n + 1] > best_rate:
                    best, best_rate = n, expected / self.costs[n + 1]
            tokens, parents = tokens[:best], parents[:best]
        if not tokens:
            return None
        return Proposal(as_tokens(tokens), parents)


class PathMedusaProposer(DynamicMedusaProposer):
    """The dynamic tree for heads that read the path above a node (`PathHeads`): a node's children are
    ranked by a head call made with that node's own token, so the score of a path is the product of
    probabilities each conditioned on the path so far, not an independence guess.

    Best-first as in `DynamicMedusaProposer`, but a node's children are only computed when they could
    still make the tree: a popped node offers a "children" entry scored with its own score (no child can
    beat its parent), and only popping that entry calls the heads. So a step makes at most `nodes`
    head calls, and fewer when siblings win. Exact: the same `nodes` best paths as computing every call.
    Adaptive: each head call's guesses are read on the host, one read per expanded node.
    """

    heads: PathHeads

    def propose(self, state: DecodeState) -> Proposal | None:
        assert self.hidden is not None
        depth, budget = self.limits(state)
        if depth <= 0 or budget <= 0:
            return None
        start, ids, logp = self.heads.tree_start(self.hidden, state.ids[-1], self.width)
        # children of each expanded path: (its node for the heads, child ids, child log-probs)
        kids: dict[tuple[int, ...], tuple[Any, list[int], list[float]]] = {(): (start, ids.tolist(), logp.tolist())}
        NODE, CHILDREN = 0, 1  # at equal scores a node goes before a promise of its children
        heap: list[tuple[float, int, tuple[int, ...]]] = [(-kids[()][2][0], NODE, (0,))]
        index: dict[tuple[int, ...], int] = {(): 0}
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        while heap and len(tokens) < budget:
            neg, kind, path = heapq.heappop(heap)
            if -neg < self.log_min:
                break
            if kind == CHILDREN:  # the best remaining bound: now the heads must say what follows `path`
                node, ids_l, _ = kids[path[:-1]]
                child, c_ids, c_logp = self.heads.tree_expand(node, ids_l[path[-1]], self.width)
                kids[path] = (child, c_ids.tolist(), c_logp.tolist())
                heapq.heappush(heap, (neg - kids[path][2][0], NODE, path + (0,)))
                continue
            _, ids_l, logp_l = kids[path[:-1]]
            scores.append(-neg)
            index[path] = len(tokens) + 1
            tokens.append(ids_l[path[-1]])
            parents.append(index[path[:-1]])
            if path[-1] + 1 < self.width:  # next sibling
                prefix = -neg - logp_l[path[-1]]
                heapq.heappush(heap, (-(prefix + logp_l[path[-1] + 1]), NODE, path[:-1] + (path[-1] + 1,)))
            if len(path) < depth:
                heapq.heappush(heap, (neg, CHILDREN, path))
        return self._proposal(tokens, parents, scores)

