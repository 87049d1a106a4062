"""Paired comparison of two strategies of one interleaved run: `python experiments/paired.py RUN_DIR A B`
prints A's speedup over B (tokens/s ratio) with a 95% paired bootstrap interval over questions
(specdec.metrics.speedup_ci, as summary.json's `speedup_ci` against the baseline). An interval holding
1 is a tie: choose defaults on held-apart runs only (experiments/heldapart/). `--exclude FILE` leaves out the
questions it lists (one id a line, `#` comments), e.g. those of a held-apart set that a checkpoint was trained
on (experiments/heldapart_overlap.py); `--only FILE` keeps just those, to read the overlapping part itself.
Several run folders (`paired.py RUN1 RUN2 ... A B`) pool their questions into one ratio and one bootstrap:
the same comparison over several held-apart sets, each question counted once. Where the runs name the two
strategies differently, give one name per run, comma-separated: `paired.py R1 R2 a1,a2 b1,b2`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec.metrics import speedup_ci


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dirs", type=Path, nargs="+", metavar="run_dir", help="one run, or several to pool")
    ap.add_argument("a", help="a strategy of every run, or one per run: name1,name2,...")
    ap.add_argument("b", help="the strategy to compare with, likewise")
    ids = ap.add_mutually_exclusive_group()
    ids.add_argument("--exclude", type=Path, default=None, help="question ids to leave out, one a line")
    ids.add_argument("--only", type=Path, default=None, help="question ids to keep, one a line")
    args = ap.parse_args()
    flag, listed = ("--exclude", args.exclude) if args.exclude is not None else ("--only", args.only)
    runs = {run_dir: read_answers(run_dir) for run_dir in args.run_dirs}
    names_a, names_b = (per_run(n, len(runs)) for n in (args.a, args.b))
    chosen = None if listed is None else read_ids(flag, listed, [r for rows in runs.values() for r in rows],
                                                  ", ".join(map(str, runs)))
    a: list[dict] = []
    b: list[dict] = []
    for (run_dir, rows), name_a, name_b in zip(runs.items(), names_a, names_b):
        if chosen is not None:
            rows = [r for r in rows if (str(r["question_id"]) in chosen) == (flag == "--only")]
        ra = [r for r in rows if r["strategy"] == name_a]
        rb = [r for r in rows if r["strategy"] == name_b]
        if not ra or not rb:
            names = sorted({r["strategy"] for r in rows})
            raise SystemExit(f"{run_dir} has no answers of {name_a if not ra else name_b}; it holds {', '.join(names)}")
        if len(args.run_dirs) > 1:  # one bootstrap unit per question of each run: ids may repeat across runs
            ra, rb = ([dict(r, question_id=f"{run_dir}:{r['question_id']}") for r in x] for x in (ra, rb))
        a += ra
        b += rb
    point, lo, hi = paired_ratio(a, b)
    verdict = "a tie" if lo <= 1 <= hi else ("better" if lo > 1 else "worse")
    left = f", {len(a)} answers after {flag}" if listed is not None else ""
    pooled = f", pooled over {len(args.run_dirs)} runs" if len(args.run_dirs) > 1 else ""
    print(f"{args.a} / {args.b}: {point:.3f} [{lo:.3f}, {hi:.3f}] ({verdict}{left}{pooled}); tau {tau(a)} and {tau(b)}")


def per_run(names: str, runs: int) -> list[str]:
    """`a` or `a1,...,aN`: the strategy's name in each of the N runs."""
    listed = names.split(",")
    if len(listed) == 1:
        return listed * runs
    if len(listed) != runs:
        raise SystemExit(f"{names!r} names {len(listed)} strategies for {runs} runs; give one name, or one per run")
    return listed


def read_answers(run_dir: Path) -> list[dict]:
    path = run_dir / "answers.jsonl"
    if not path.is_file():
        raise SystemExit(f"{run_dir}: no answers.jsonl; give the folder of a finished run (python -m specdec.run ...)")
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def paired_ratio(a: list[dict], b: list[dict]) -> tuple[float, float, float]:
    """A's tokens/s over B's, pooled over the answers, with its 95% paired bootstrap interval over questions."""
    point = (sum(r["new_tokens"] for r in a) / sum(r["wall_time_s"] for r in a)) / (
        sum(r["new_tokens"] for r in b) / sum(r["wall_time_s"] for r in b))
    lo, hi = speedup_ci(a, b, point) or (point, point)
    return point, lo, hi


def read_ids(flag: str, path: Path, rows: list[dict], run_dir: str) -> set[str]:
    """The question ids listed in `path` (one a line, `#` comments); each must be a question of the runs."""
    if not path.is_file():
        raise SystemExit(f"{flag} {path}: no such file; give a file of question ids, one a line")
    listed = {ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")}
    unknown = listed - {str(r["question_id"]) for r in rows}
    if unknown:
        raise SystemExit(f"{flag} {path}: {len(unknown)} ids are not in this run "
                         f"(e.g. {sorted(unknown)[0]!r}); list question ids of {run_dir}")
    return listed


def tau(rows: list[dict]) -> str:
    """Mean accepted tokens per target pass over the answers (what summary.json calls mean_accepted_tokens)."""
    steps = sum(len(r.get("accept_lengths") or []) for r in rows)
    return f"{sum(sum(r['accept_lengths']) for r in rows if r.get('accept_lengths')) / steps:.2f}" if steps else "-"


if __name__ == "__main__":
    main()
