"""`python -m heads.tree_tuning`: build the Medusa tree that maximises the expected accepted length.

1. Calibration: prompts of the offline suite drawn with a seed other than the benchmark's (and none
   of the benchmark's own first turns), answered greedily by the target. At every position the
   heads rank the true future tokens: `ranks[j, k]` is the rank of token j + k + 2 in head k's
   top-`width` at the hidden state of token j (`width` = not in the top-`width`).
2. Acceptance estimates: a node of the tree (a tuple of ranks, one per depth) is accepted exactly
   when every head on its path ranked the truth at the node's rank, and distinct nodes at a depth
   are exclusive, so the expected number of accepted draft tokens is the sum over nodes of their
   path probability. `product` multiplies per-head per-rank accuracies (Medusa's estimate);
   `joint` counts whole paths, so correlated heads are not underestimated.
3. Construction: path probabilities never grow along a path, so the best tree of n nodes is the n
   most probable nodes; Medusa's greedy growth (repeatedly add the frontier node of highest path
   probability) finds exactly that set. Each budget is scored with the verification cost curve
   (a pass over n tokens costs cost(n) single-token passes) and the best one is written out.
"""

from __future__ import annotations

import heapq
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from specdec.cli_checks import CONFIG_DIR
from specdec.data import default_suite
from specdec.engine.engine import StaticEngine, pass_cost_curve
from specdec.errors import SpecdecError
from specdec.models.loader import LoadedModel
from specdec.results_index import portable
from specdec.strategies.base import torch_threads

Path_ = tuple[int, ...]
ESTIMATES = ("product", "joint")


# ------------------------------------------------------------------------------------------------
# calibration
# ------------------------------------------------------------------------------------------------


def calibration_prompts(n: int, seed: int, benchmark_seed: int = 0, benchmark_per_category: int = 20) -> list[str]:
    """n first turns of the offline suite drawn with `seed`, none of them a turn of the benchmark's suite,
    interleaved across categories so a small n still covers every kind of prompt.

    The suite's pools are small, so calibration prompts may also appear in the heads' training data
    (heads.distill_data draws from the same pools); only the benchmark is kept out.
    """
    if seed == benchmark_seed:
        raise SpecdecError(f"calibration.seed={seed} is the benchmark's seed; pick another so tuning does not "
                           "see the test prompts")
    seen = {t for q in default_suite(benchmark_per_category, benchmark_seed) for t in q.turns}
    by_cat: dict[str, list[str]] = {}
    for q in default_suite(max(1, min(40, math.ceil(n / 4))), seed):
        if q.turns[0] not in seen:
            seen.add(q.turns[0])
            by_cat.setdefault(q.category, []).append(q.turns[0])
    out: list[str] = []
    for i in range(max(len(v) for v in by_cat.values())):
        out += [v[i] for v in by_cat.values() if i < len(v)]
    if len(out) < n:
        raise SpecdecError(f"the offline suite yields only {len(out)} calibration prompts; lower calibration.prompts")
    return out[:n]


@dataclass
class Calibration:
    ranks: Tensor  # (P, K) rank of the truth per position and head; `width` = not among the top `width`
    width: int
    step_s: float  # mean time of a one-token target pass
    heads_s: float  # median time of one heads call (all K heads, top-k included) right after a pass


@torch.inference_mode()
def calibrate(target: LoadedModel, heads: Any, prompts: list[list[int]], max_new_tokens: int, width: int,
              max_len: int = 2048) -> Calibration:
    """Greedy continuations of the prompts and the heads' rank of every true future token."""
    engine = StaticEngine(target.model, max_len)
    K = heads.num_heads
    eos = set(target.eos_ids)
    rows: list[Tensor] = []
    step_s = 0.0
    steps = 0
    heads_times: list[float] = []  # one per prompt; the median, as the first call pays for warming up
    with torch_threads(target.torch_threads):
        for prompt in prompts:
            out = engine.prefill(prompt)
            seq = [prompt[-1]]  # tokens whose hidden states we hold, then the continuation
            hidden = [out.hidden[-1]]
            tok = int(out.logits[-1].argmax())
            for _ in range(max_new_tokens):
                seq.append(tok)
                if tok in eos:
                    break
                t0 = time.perf_counter()
                out = engine.forward(torch.tensor([tok]))
                step_s += time.perf_counter() - t0
                steps += 1
                hidden.append(out.hidden[-1])
                tok = int(out.logits[-1].argmax())
            t0 = time.perf_counter()
            heads.topk(hidden[-1], width, root=tok)  # tok: the target's choice after hidden[-1]
            heads_times.append(time.perf_counter() - t0)
            n = len(seq) - K - 1  # positions whose K future tokens are all known
            if n <= 0:
                continue
            ids = torch.tensor(seq)
            path = ids[2:].unfold(0, n, 1)[:K - 1].t()  # (n, K - 1): the true tokens after each root
            top = _topk_ids(heads, torch.stack(hidden[:n]), width, ids[1:n + 1], path)  # (n, K, width)
            truth = torch.stack([ids[k + 2: k + 2 + n] for k in range(K)], dim=1)  # (n, K)
            hit = top == truth[..., None]  # (n, K, width)
            rank = torch.where(hit.any(-1), hit.int().argmax(-1), torch.full_like(truth, width))
            rows.append(rank)
    if not rows:
        raise SpecdecError("calibration produced no usable positions; raise calibration.max_new_tokens")
    heads_s = sorted(heads_times)[len(heads_times) // 2] if heads_times else 0.0
    return Calibration(torch.cat(rows), width, step_s / max(steps, 1), heads_s)


def _topk_ids(heads: Any, hidden: Tensor, width: int, root: Tensor | None = None,
              path: Tensor | None = None) -> Tensor:
    """(n, dim) states, (n,) root tokens (the target's choice after each) and (n, K - 1) the true tokens
    after the root -> (n, K, width) ids. Heads that read the path (sequential) see the true one, so a
    rank's hit rate is conditioned on the path above being right, which is when it counts."""
    logits = heads(hidden.float(), root, path)  # (n, K, V'); heads ignore what they do not read
    idx = logits.topk(width, dim=-1).indices
    return heads.kept_ids[idx] if hasattr(heads, "kept_ids") else idx


# ------------------------------------------------------------------------------------------------
# estimates and construction
# ------------------------------------------------------------------------------------------------


def rank_accuracy(ranks: Tensor, width: int) -> Tensor:
    """(K, width): fraction of positions where head k ranked the truth at rank r."""
    return torch.stack([torch.bincount(ranks[:, k], minlength=width + 1)[:width] for k in range(ranks.shape[1])]
                       ).double() / max(len(ranks), 1)


def product_estimate(acc: Tensor) -> Callable[[Path_], float]:
    table = acc.tolist()
    return lambda path: math.prod(table[d][r] for d, r in enumerate(path))


def joint_estimate(ranks: Tensor) -> Callable[[Path_], float]:
    n = max(len(ranks), 1)
    memo: dict[Path_, Tensor] = {(): torch.ones(len(ranks), dtype=torch.bool)}

    def match(path: Path_) -> Tensor:
        if path not in memo:
            memo[path] = match(path[:-1]) & (ranks[:, len(path) - 1] == path[-1])
        return memo[path]

    return lambda path: float(match(path).sum()) / n


def greedy_tree(prob: Callable[[Path_], float], budget: int, width: int, depth: int) -> list[Path_]:
    """Grow from the root, each time adding the frontier node of highest path probability.

    Ties go to the shallower, then lower-ranked node, so a parent always precedes its children.
    """
    frontier: list[tuple[float, int, Path_]] = []

    def push_children(parent: Path_) -> None:
        if len(parent) < depth:
            for r in range(width):
                child = (*parent, r)
                heapq.heappush(frontier, (-prob(child), len(child), child))

    push_children(())
    tree: list[Path_] = []
    while frontier and len(tree) < budget:
        _, _, node = heapq.heappop(frontier)
        tree.append(node)
        push_children(node)
    return tree


def expected_accepted(tree: Sequence[Path_], prob: Callable[[Path_], float]) -> float:
    return sum(prob(p) for p in tree)


def measured_cost_curve(target: LoadedModel, sizes: Sequence[int], context: int = 256, reps: int = 7
                        ) -> dict[int, float]:
    """Time target passes over each number of tokens (a tree plus its root) on this machine, relative to one.

    Measured rather than assumed because the curve is a property of the hardware and BLAS: on a CPU a
    pass costs more the more tokens it feeds; on a GPU it is nearly flat.
    """
    engine = StaticEngine(target.model, context + max(sizes) + 2)
    with torch_threads(target.torch_threads):
        return pass_cost_curve(engine, list(sizes), context, reps)


def pass_cost(n_tokens: int, curve: dict[int, float]) -> float:
    """Cost of one target pass over n tokens in single-token passes: piecewise linear through `curve`."""
    pts = sorted((int(k), float(v)) for k, v in curve.items())
    if n_tokens <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if n_tokens <= x1:
            return y0 + (y1 - y0) * (n_tokens - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    return y1 + (y1 - y0) * (n_tokens - x1) / (x1 - x0)


@dataclass
class Scored:
    budget: int
    tree: list[Path_]
    expected_accepted: float  # drafted tokens accepted per pass (the bonus token not included)
    speedup: float  # (1 + accepted) / (pass cost + heads cost), against one token per single-token pass


def score_budgets(prob: Callable[[Path_], float], budgets: Sequence[int], width: int, depth: int,
                  curve: dict[int, float], head_cost: float) -> list[Scored]:
    out = []
    for b in budgets:
        tree = greedy_tree(prob, b, width, depth)
        e = expected_accepted(tree, prob)
        out.append(Scored(b, tree, e, (1 + e) / (pass_cost(len(tree) + 1, curve) + head_cost)))
    return out


# ------------------------------------------------------------------------------------------------
# entry
# ------------------------------------------------------------------------------------------------


def tune(cfg: DictConfig) -> dict[str, Any]:
    target: LoadedModel = instantiate(cfg.model)
    heads = instantiate(cfg.heads)(target=target)
    t = cfg.tree
    if t.estimate not in ESTIMATES:
        raise SpecdecError(f"unknown tree.estimate={t.estimate!r}; use product or joint")
    c = cfg.calibration
    texts = calibration_prompts(int(c.prompts), int(c.seed), int(c.benchmark_seed), int(c.benchmark_per_category))
    prompts = [target.chat_ids([{"role": "user", "content": x}]) for x in texts]
    cal = calibrate(target, heads, prompts, int(c.max_new_tokens), int(t.width))
    acc = rank_accuracy(cal.ranks, cal.width)
    estimates = {"product": product_estimate(acc), "joint": joint_estimate(cal.ranks)}
    prob = estimates[t.estimate]
    budgets = [int(t.budget)] if t.budget is not None else [int(b) for b in t.budgets]
    if t.cost_curve == "measure":
        curve = measured_cost_curve(target, sorted({1, *(b + 1 for b in budgets)}))
    else:
        curve = {int(k): float(v) for k, v in OmegaConf.to_container(t.cost_curve).items()}  # type: ignore[union-attr]
    head_cost = float(t.head_cost) if t.head_cost is not None else cal.heads_s / max(cal.step_s, 1e-9)
    depth = min(int(t.max_depth or heads.num_heads), heads.num_heads)
    scored = score_budgets(prob, budgets, int(t.width), depth, curve, head_cost)
    best = max(scored, key=lambda s: s.speedup)
    result = {
        "choices": [list(p) for p in best.tree],
        "budget": best.budget,
        "estimate": t.estimate,
        "expected_accepted": round(best.expected_accepted, 4),
        "expected_accepted_joint": round(expected_accepted(best.tree, estimates["joint"]), 4),
        "expected_speedup": round(best.speedup, 4),
        "head_cost": round(head_cost, 4),
        "budgets": {s.budget: {"expected_accepted": round(s.expected_accepted, 4), "speedup": round(s.speedup, 4)}
                    for s in scored},
        "cost_curve": {k: round(v, 3) for k, v in sorted(curve.items())},
        "top1_accuracy": [round(float(a), 4) for a in acc[:, 0]],
        "rank_accuracy": [[round(float(x), 4) for x in row] for row in acc],
        "positions": len(cal.ranks),
        "model": target.name,
        "heads": portable(str(cfg.heads.get("path"))),  # a committed file names no local folder
    }
    out = Path(str(cfg.out)).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".json":
        out.write_text(json.dumps(result, indent=2))
    else:
        import yaml

        choices = result.pop("choices")
        # one flow-style path a line keeps the file readable and diffable
        body = yaml.safe_dump(result, sort_keys=False)
        out.write_text(body + "choices:\n" + "".join(f"- {list(p)}\n" for p in choices))
        result["choices"] = choices
    return result


@hydra.main(version_base=None, config_path=str(CONFIG_DIR), config_name="tune_tree")
def main(cfg: DictConfig) -> None:
    import sys

    try:
        result = tune(cfg)
    except SpecdecError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"tree of {result['budget']} nodes -> {cfg.out}: expected accepted {result['expected_accepted']} "
          f"(joint {result['expected_accepted_joint']}), estimated speedup {result['expected_speedup']}")
    for b, s in result["budgets"].items():
        print(f"  budget {b:>3}: accepted {s['expected_accepted']:.3f}  speedup {s['speedup']:.3f}")


if __name__ == "__main__":
    main()
