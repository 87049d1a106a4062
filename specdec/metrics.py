"""Per-turn answer rows -> summary.json (CONTRACT.md), plus the breakdowns researchers ask for."""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

Row = dict[str, Any]


def _ci95(values: list[float]) -> float | None:
    """Half-width of a 95% t interval of the mean (None for fewer than two values)."""
    if len(values) < 2:
        return None
    from scipy import stats

    return float(stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values)))


def _percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    qs = statistics.quantiles(values, n=20, method="inclusive") if len(values) > 1 else [values[0]] * 19
    return {"p50": qs[9], "p90": qs[17], "p95": qs[18], "mean": statistics.fmean(values)}


def strategy_metrics(rows: list[Row]) -> dict[str, Any]:
    """The contract's fields for one strategy's rows, and extras (additions never rename)."""
    tokens = sum(r["new_tokens"] for r in rows)
    wall = sum(r["wall_time_s"] for r in rows)
    accs = [a for r in rows if r.get("accept_lengths") is not None for a in r["accept_lengths"]]
    # every turn's first entry is its prefill (always 1): the histogram counts decode passes only
    passes = [a for r in rows if r.get("accept_lengths") is not None for a in r["accept_lengths"][1:]]
    proposed = sum(r.get("proposed_tokens") or 0 for r in rows)
    accepted = sum(r.get("accepted_tokens") or 0 for r in rows)
    tpots = [(r["wall_time_s"] - r["ttft_s"]) / (r["new_tokens"] - 1) for r in rows if r["new_tokens"] > 1]
    ttfts = [r["ttft_s"] for r in rows]
    by_pos_p: list[int] = []
    by_pos_a: list[int] = []
    for r in rows:
        for i, (p, a) in enumerate(zip(r.get("proposed_by_pos") or [], r.get("accepted_by_pos") or [])):
            if i == len(by_pos_p):
                by_pos_p.append(0)
                by_pos_a.append(0)
            by_pos_p[i] += p
            by_pos_a[i] += a
    steps = sum(r["decode_steps"] for r in rows if r.get("decode_steps") is not None)
    draft_time = sum(r.get("draft_time_s") or 0.0 for r in rows)
    decode_time = sum(r["wall_time_s"] - r["ttft_s"] for r in rows if r.get("decode_steps") is not None)
    return {
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "speedup": None,  # filled in against the baseline
        "mean_accepted_tokens": statistics.fmean(accs) if accs else None,
        "acceptance_rate": accepted / proposed if proposed else None,
        # alpha for trees, named: over the longest verified path of each step (= acceptance_rate), and
        # over every verified draft node (None until the rows carry proposed_nodes); equal for chains
        "alpha_longest_path": accepted / proposed if proposed else None,
        "alpha_per_node": _per_node(rows, accepted),
        "ttft_s": statistics.fmean(ttfts) if ttfts else 0.0,
        "ttft_s_by_turn": _ttft_by_turn(rows),
        "tpot_s": statistics.fmean(tpots) if tpots else 0.0,
        "new_tokens": tokens,
        "wall_time_s": wall,
        "matches_baseline": None,
        "turns": len(rows),
        "decode_steps": steps,
        "step_time_s": decode_time / steps if steps else None,  # mean time of one decode step
        "draft_time_share": draft_time / decode_time if decode_time > 0 else None,
        "acceptance_by_position": [a / p for a, p in zip(by_pos_a, by_pos_p)] if by_pos_p else None,
        "accept_length_histogram": dict(sorted(Counter(passes).items())) or None,
        "ttft_distribution": _percentiles(ttfts),
        "tpot_distribution": _percentiles(tpots),
    } | _draft_model_metrics(proposed, by_pos_p, by_pos_a, steps, draft_time, decode_time)


def _ttft_by_turn(rows: list[Row]) -> dict[str, float] | None:
    """Mean ttft_s per turn index ("0", "1", ...): a later turn's prompt holds the conversation so far, which
    prefix reuse (generation.prefix_cache) does not prefill again, so its TTFT is where reuse shows."""
    by_turn = _group(rows, "turn") if all("turn" in r for r in rows) else {}
    return {str(t): statistics.fmean(r["ttft_s"] for r in rs) for t, rs in sorted(by_turn.items())} or None


def _per_node(rows: list[Row], accepted: int) -> float | None:
    """Accepted draft tokens over every draft node verified (all of a tree's nodes, not one path)."""
    drafting = [r for r in rows if r.get("proposed_tokens")]
    # a tree has at least as many nodes as its longest path: a row without a count says nothing
    if not drafting or any(not r.get("proposed_nodes") for r in drafting):
        return None
    nodes = sum(r["proposed_nodes"] for r in drafting)
    return accepted / nodes if nodes else None


def _draft_model_metrics(proposed: int, by_pos_p: list[int], by_pos_a: list[int], steps: int, draft_time: float,
                         decode_time: float) -> dict[str, Any]:
    """Leviathan et al.'s model beside the measurement: per-token acceptance alpha (each verified draft
    token accepted with probability alpha, independently), mean draft length gamma and cost ratio c
    (one draft step over one target step, measured) predict a speedup of
    (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)) over autoregressive decoding."""
    # a position was tested when it was proposed and every earlier one accepted
    tested = [p if i == 0 else min(p, by_pos_a[i - 1]) for i, p in enumerate(by_pos_p)]
    alpha = sum(by_pos_a) / sum(tested) if sum(tested) else None
    gamma = proposed / steps if steps and proposed else None
    target_step = (decode_time - draft_time) / steps if steps else 0.0
    cost = (draft_time / proposed) / target_step if proposed and target_step > 0 else None
    expected = None
    if alpha is not None and gamma is not None and cost is not None:
        gain = gamma + 1 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
        expected = gain / (gamma * cost + 1)
    return {"proposed_by_position": by_pos_p or None, "accepted_by_position": by_pos_a or None,
            "alpha_per_token": alpha, "mean_draft_length": gamma, "cost_ratio": cost,
            "expected_speedup": expected}


def _matches(rows: list[Row], base_rows: list[Row]) -> float | None:
    base = {(r["question_id"], r["turn"], r.get("repeat", 0)): r["output_ids"] for r in base_rows}
    pairs = [(r["output_ids"], base.get((r["question_id"], r["turn"], r.get("repeat", 0)))) for r in rows]
    pairs = [(a, b) for a, b in pairs if b is not None]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else None


def summarize(rows: Iterable[Row], baseline: str, temperature: float, order: list[str] | None = None,
              config: dict[str, Any] | None = None) -> dict[str, Any]:
    rows = list(rows)
    by_strategy: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        by_strategy[r["strategy"]].append(r)
    names = [n for n in (order or []) if n in by_strategy] + sorted(set(by_strategy) - set(order or []))
    out: dict[str, Any] = {}
    for name in names:
        s = strategy_metrics(by_strategy[name])
        s["categories"] = {c: _strip(strategy_metrics(rs))
                           for c, rs in sorted(_group(by_strategy[name], "category").items())}
        s["repeats"] = _repeat_stats(by_strategy[name])
        out[name] = s
    base = out.get(baseline)
    for name, s in out.items():
        if base and base["tokens_per_s"] > 0:
            s["speedup"] = s["tokens_per_s"] / base["tokens_per_s"]
            for c, cs in s["categories"].items():
                bc = base["categories"].get(c)
                cs["speedup"] = cs["tokens_per_s"] / bc["tokens_per_s"] if bc and bc["tokens_per_s"] else None
        if temperature == 0 and base is not None:
            s["matches_baseline"] = _matches(by_strategy[name], by_strategy[baseline])
        s["predicted_speedup"] = _predicted(s, base)
        s["speedup_ci"] = ([1.0, 1.0] if name == baseline else
                           speedup_ci(by_strategy[name], by_strategy[baseline], s["speedup"]) if base else None)
    return {"baseline": baseline, "strategies": out, "config": config or {}}


def _predicted(s: dict[str, Any], base: dict[str, Any] | None) -> float | None:
    """Speedup the measured acceptance predicts: tau / (step cost relative to a baseline step).

    Beside the realized speedup it separates what acceptance buys from what the engine costs.
    """
    if not base or not s.get("step_time_s") or not base.get("step_time_s") or not s["mean_accepted_tokens"]:
        return None
    tau_base = base["mean_accepted_tokens"] or 1.0
    return (s["mean_accepted_tokens"] / tau_base) / (s["step_time_s"] / base["step_time_s"])


def _group(rows: list[Row], key: str) -> dict[str, list[Row]]:
    groups: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        groups[r[key]].append(r)
    return groups


def _strip(m: dict[str, Any]) -> dict[str, Any]:
    keep = ("tokens_per_s", "mean_accepted_tokens", "acceptance_rate", "new_tokens", "wall_time_s", "turns")
    return {k: m[k] for k in keep}


def _repeat_stats(rows: list[Row]) -> dict[str, Any] | None:
    reps = _group(rows, "repeat") if any("repeat" in r for r in rows) else {}
    if len(reps) < 2:
        return None
    tps = [sum(r["new_tokens"] for r in rs) / sum(r["wall_time_s"] for r in rs) for rs in reps.values()]
    return {"n": len(tps), "tokens_per_s_mean": statistics.fmean(tps), "tokens_per_s_ci95": _ci95(tps),
            "tokens_per_s": tps}


def add_speedup_ci(summary: dict[str, Any]) -> None:
    """Per-repeat speedups (both strategies timed in the same repeat) with a 95% interval."""
    base = summary["strategies"].get(summary["baseline"], {}).get("repeats")
    for s in summary["strategies"].values():
        reps = s.get("repeats")
        if base and reps and len(reps["tokens_per_s"]) == len(base["tokens_per_s"]):
            ratios = [a / b for a, b in zip(reps["tokens_per_s"], base["tokens_per_s"])]
            reps["speedup_mean"] = statistics.fmean(ratios)
            reps["speedup_ci95"] = _ci95(ratios)


def speedup_ci(rows: list[Row], base_rows: list[Row], point: float | None, level: float = 0.95,
               samples: int = 2000, seed: int = 0) -> list[float] | None:
    """A `level` interval for speedup from a paired bootstrap over questions (fixed seed: reproducible).

    Each question contributes its tokens and wall time under both strategies (repeats pooled; zeros where
    one of them has no answer), and a resample recomputes speedup = (tokens/wall) / (base tokens/base wall)
    over the drawn questions, so the whole sample gives exactly `point`. Percentile interval, widened to
    hold `point` in the rare resample sets where the ratio's skew would leave it just outside.
    """
    import numpy as np

    if point is None:
        return None
    units: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for r in rows:
        u = units[str(r["question_id"])]
        u[0] += r["new_tokens"]
        u[1] += r["wall_time_s"]
    for r in base_rows:
        u = units[str(r["question_id"])]
        u[2] += r["new_tokens"]
        u[3] += r["wall_time_s"]
    values = np.array(list(units.values()), dtype=np.float64)
    n = len(values)
    if n < 2:
        return [point, point]
    rng = np.random.default_rng(seed)
    weights = rng.multinomial(n, np.full(n, 1.0 / n), size=samples).astype(np.float64)
    tok, wall, btok, bwall = (weights @ values).T
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = (tok / wall) / (btok / bwall)
    ratio = ratio[np.isfinite(ratio)]
    if ratio.size == 0:
        return [point, point]
    lo, hi = np.quantile(ratio, [(1 - level) / 2, (1 + level) / 2])
    return [min(float(lo), point), max(float(hi), point)]


def lossless(config: dict[str, Any] | None, temperature: float) -> bool:
    """Whether a strategy's output is exactly the target's: always at temperature 0 (greedy match), and above
    it unless an acceptance rule other than the exact one is configured anywhere in the strategy's config
    (Medusa's `acceptance: typical`, also inside a hybrid's `inner`). An unknown config above temperature 0
    is not claimed exact."""
    if temperature == 0:
        return True
    if config is None:
        return False
    return all(str(rule) == "exact" for rule in _values_of(config, "acceptance"))


def _values_of(node: Any, key: str) -> list[Any]:
    if isinstance(node, dict):
        found = [v for k, v in node.items() if k == key and not isinstance(v, dict | list)]
        return found + [x for v in node.values() for x in _values_of(v, key)]
    if isinstance(node, list):
        return [x for v in node for x in _values_of(v, key)]
    return []
