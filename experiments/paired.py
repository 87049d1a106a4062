"""Paired comparison of two strategies of one interleaved run: `python experiments/paired.py RUN_DIR A B`
prints A's speedup over B (tokens/s ratio) with a 95% paired bootstrap interval over questions
(specdec.metrics.speedup_ci, as summary.json's `speedup_ci` against the baseline). An interval holding
1 is a tie: choose defaults on held-apart runs only (experiments/heldapart/)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec.metrics import speedup_ci


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("a")
    ap.add_argument("b")
    args = ap.parse_args()
    rows = [json.loads(line) for line in (args.run_dir / "answers.jsonl").read_text().splitlines() if line]
    a = [r for r in rows if r["strategy"] == args.a]
    b = [r for r in rows if r["strategy"] == args.b]
    if not a or not b:
        names = sorted({r["strategy"] for r in rows})
        raise SystemExit(f"{args.run_dir} has no answers of {args.a if not a else args.b}; it holds {', '.join(names)}")
    point = (sum(r["new_tokens"] for r in a) / sum(r["wall_time_s"] for r in a)) / (
        sum(r["new_tokens"] for r in b) / sum(r["wall_time_s"] for r in b))
    lo, hi = speedup_ci(a, b, point) or (point, point)
    verdict = "a tie" if lo <= 1 <= hi else ("better" if lo > 1 else "worse")
    print(f"{args.a} / {args.b}: {point:.3f} [{lo:.3f}, {hi:.3f}] ({verdict})")


if __name__ == "__main__":
    main()
