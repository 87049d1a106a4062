"""Speedups split by the host's speed state: `python experiments/phase_split.py RUN_DIR A [B] [--split MS] [--by C]`.

Some hosts switch between two speeds for tens of seconds at a time (the 2-core AMD EPYC of experiments/README.md,
"The acceptance runs on an AMD EPYC"): a one-token target pass takes about 13 ms in one state and about 19 ms
in the other. A question's state is read from B's time per decode step over its turns, (wall - ttft) / steps;
B is the run's baseline unless named, and `--by C` reads the state from C's steps instead (to compare two
drafters A and B per state with the baseline's steps setting it). Questions split at `--split MS`, else at the
threshold that best separates the two groups (Otsu's: the largest between-group variance). Per state it
prints A's speedup over B with the paired 95% bootstrap interval of summary.json (specdec.metrics.speedup_ci),
both taus, and what A's decode round costs in B's steps: drafting, and the rest (the target's pass over the
proposal, verification, bookkeeping).

The state is that strategy's: it may change between the strategies' turns of one question, which blurs the split. A run
alternates the strategies' order from one question to the next, so the blur favours neither strategy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paired import paired_ratio, tau  # noqa: E402  (a sibling script, not a package)

DISTINCT = 1.15  # groups whose mean step times differ by less than this ratio are one state


def step_ms(rows: list[dict]) -> dict[str, float]:
    """Milliseconds per decode step of each question over its turns (prefill left out)."""
    wall: dict[str, float] = {}
    steps: dict[str, int] = {}
    for r in rows:
        q = str(r["question_id"])
        wall[q] = wall.get(q, 0.0) + r["wall_time_s"] - (r.get("ttft_s") or 0.0)
        steps[q] = steps.get(q, 0) + int(r.get("decode_steps") or 0)
    return {q: 1e3 * wall[q] / steps[q] for q in wall if steps[q] > 0}


def otsu(values: list[float]) -> float:
    """The threshold between two sorted neighbours that maximizes the between-group variance."""
    v = sorted(values)
    best, cut = -1.0, v[0]
    for i in range(1, len(v)):
        lo, hi = v[:i], v[i:]
        score = len(lo) * len(hi) * (sum(hi) / len(hi) - sum(lo) / len(lo)) ** 2
        if score > best:
            best, cut = score, (v[i - 1] + v[i]) / 2
    return cut


def compare(a: list[dict], b: list[dict]) -> str:
    point, lo, hi = paired_ratio(a, b)
    return f"{point:.3f} [{lo:.3f}, {hi:.3f}], tau {tau(a)} and {tau(b)}{round_costs(a, b)}"


def round_costs(a: list[dict], b: list[dict]) -> str:
    """A's decode round in B's steps: drafting (draft_time_s), and the rest (the target's pass, verification,
    the loop's bookkeeping). Empty when A records no drafting time."""
    steps_a, steps_b = sum(r.get("decode_steps") or 0 for r in a), sum(r.get("decode_steps") or 0 for r in b)
    if not steps_a or not steps_b or any(r.get("draft_time_s") is None for r in a):
        return ""
    step_b = sum(r["wall_time_s"] - (r.get("ttft_s") or 0.0) for r in b) / steps_b
    draft = sum(r["draft_time_s"] for r in a) / steps_a
    rest = sum(r["wall_time_s"] - (r.get("ttft_s") or 0.0) for r in a) / steps_a - draft
    return f"; a round costs {rest / step_b:.2f} + {draft / step_b:.2f} (drafting) steps of {b[0]['strategy']}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("a")
    ap.add_argument("b", nargs="?", default=None, help="the strategy whose step time sets the state (the baseline)")
    ap.add_argument("--split", type=float, default=None, help="ms per step between the states (default: Otsu's)")
    ap.add_argument("--by", default=None, help="the strategy whose step time sets the state (default: B)")
    args = ap.parse_args()
    answers = args.run_dir / "answers.jsonl"
    if not answers.is_file():
        raise SystemExit(f"{answers}: no such file; give a run folder of specdec.run")
    rows = [json.loads(line) for line in answers.read_text().splitlines() if line]
    b_name = args.b or json.loads((args.run_dir / "summary.json").read_text())["baseline"]
    names = sorted({r["strategy"] for r in rows})
    by = args.by or b_name
    for name in (args.a, b_name, by):
        if name not in names:
            raise SystemExit(f"{args.run_dir} has no answers of {name}; it holds {', '.join(names)}")
    per_q = step_ms([r for r in rows if r["strategy"] == by])
    if len(per_q) < 4:
        raise SystemExit(f"{args.run_dir}: {len(per_q)} questions with decode steps; a split needs at least 4")
    cut = args.split if args.split is not None else otsu(list(per_q.values()))
    groups = {"fast": [q for q, t in per_q.items() if t < cut], "slow": [q for q, t in per_q.items() if t >= cut]}
    means = {k: sum(per_q[q] for q in v) / len(v) for k, v in groups.items() if v}
    print(f"{args.run_dir}: {by}'s step time per question split at {cut:.1f} ms "
          f"({'given' if args.split is not None else 'Otsu'})")
    if len(means) == 2 and means["slow"] / means["fast"] < DISTINCT:
        print(f"  the groups' mean step times differ by {means['slow'] / means['fast'] - 1:.0%}: one state")
    print(f"  all {len(per_q)} questions: {args.a} / {b_name} {compare(*pick(rows, args.a, b_name, set(per_q)))}")
    for name, qs in groups.items():
        if qs:
            print(f"  {name} ({len(qs)} questions, {by} {means[name]:.1f} ms a step): "
                  f"{args.a} / {b_name} {compare(*pick(rows, args.a, b_name, set(qs)))}")


def pick(rows: list[dict], a: str, b: str, questions: set[str]) -> tuple[list[dict], list[dict]]:
    keep = [r for r in rows if str(r["question_id"]) in questions]
    return [r for r in keep if r["strategy"] == a], [r for r in keep if r["strategy"] == b]


if __name__ == "__main__":
    main()
