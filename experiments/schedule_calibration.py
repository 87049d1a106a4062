"""Is a chain drafter's confidence what the target accepts, at every depth? And what does a drafted token cost?

Runs `python -m specdec.run` with the given Hydra overrides while logging every round the cost-aware schedule
(`specdec.strategies.schedules.CostAware`) learns from, then prints per strategy:
- for each depth of the chain (4 = 4 and deeper) and confidence bin, the tokens the target tested (those up to the
  first rejection), their mean confidence and the fraction it accepted: a calibrated drafter has the two equal;
- second choices verified a round (the schedule's `siblings` caps them);
- the median drafting time of the rounds that drafted 1, 2, ... tokens: the first holds the catch-up pass over the
  last round's tokens, each step after it what one more drafted token costs.

    python experiments/schedule_calibration.py /tmp/rounds.jsonl experiment=heldapart \\
        'data.path=${specdec.repo:experiments/heldapart/human_heldapart.jsonl}' "strategies=[greedy,draft,eagle]"

The first argument is where the rounds are written (jsonl); the run's own results go where the overrides say.
Warm-up turns are logged too. A benchmark of a kind: run it on an idle machine. `--tables ROUNDS.jsonl[.gz]`
prints the tables of rounds logged before (the committed runs keep theirs as rounds.jsonl.gz).
"""

from __future__ import annotations

import gzip
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BINS = 5  # confidence bins of 0.2
DEPTHS = 4  # the last row holds depth 4 and deeper


def record(log_path: Path, overrides: list[str]) -> None:
    """Run specdec.run under `overrides`, appending one json line per round each CostAware schedule learns from."""
    sys.path.insert(0, str(ROOT))  # this checkout's specdec, not whichever one the environment installed
    from specdec import run
    from specdec.strategies import base, schedules

    log = log_path.open("w")
    current = {"name": ""}
    generate, update = base.SpeculativeStrategy.generate, schedules.CostAware.update

    def named_generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        current["name"] = self.name
        return generate(self, *args, **kwargs)

    def logged_update(self: Any, stats: schedules.RoundStats) -> None:
        log.write(json.dumps({"strategy": current["name"], "confidences": stats.confidences,
                              "accepted": stats.accepted, "drafted": stats.drafted, "siblings": stats.siblings,
                              "draft_s": stats.draft_s}) + "\n")
        update(self, stats)

    base.SpeculativeStrategy.generate = named_generate  # type: ignore[method-assign]
    schedules.CostAware.update = logged_update  # type: ignore[method-assign]
    sys.argv = [sys.argv[0], *overrides]
    try:
        run.main()
    finally:
        base.SpeculativeStrategy.generate = generate  # type: ignore[method-assign]
        schedules.CostAware.update = update  # type: ignore[method-assign]
        log.close()


def tables(log_path: Path) -> None:
    rounds: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for text in (gzip.open(log_path, "rt") if log_path.suffix == ".gz" else log_path.open()):
        row = json.loads(text)
        rounds[row["strategy"]].append(row)
    for name, rows in rounds.items():
        cells: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0, 0.0, 0])  # tested, sum conf, accepted
        for r in rows:
            for i, conf in enumerate(r["confidences"][:r["accepted"] + 1]):  # after the first rejection: untested
                cell = cells[min(i, DEPTHS - 1), min(int(conf * BINS), BINS - 1)]
                cell[0] += 1
                cell[1] += conf
                cell[2] += int(i < r["accepted"])
        by_length: dict[int, list[float]] = defaultdict(list)
        for r in rows:
            by_length[min(r["drafted"], 6)].append(1e3 * r["draft_s"])
        times = ", ".join(f"{k}{'+' if k == 6 else ''}: {statistics.median(v):.2f}"
                          for k, v in sorted(by_length.items()))
        siblings = sum(r["siblings"] for r in rows) / len(rows)
        drafted = sum(r["drafted"] for r in rows) / len(rows)
        print(f"\n{name}: {len(rows)} rounds, {drafted:.2f} chain tokens and {siblings:.2f} second choices a round; "
              f"drafting ms a round by tokens drafted: {times}")
        heads = (f"conf {b / BINS:.1f}-{(b + 1) / BINS:.1f}: n, conf, accepted" for b in range(BINS))
        print("| depth | " + " | ".join(heads) + " |")
        print("|---" * (BINS + 1) + "|")
        for d in range(DEPTHS):
            row_cells = []
            for b in range(BINS):
                n, total, hits = cells[d, b]
                row_cells.append(f"{n}, {total / n:.2f}, {hits / n:.2f}" if n else "-")
            label = f"{d + 1}" if d < DEPTHS - 1 else f"{d + 1}+"
            print(f"| {label} | " + " | ".join(row_cells) + " |")


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python experiments/schedule_calibration.py ROUNDS.jsonl [specdec.run overrides] "
                         "| --tables ROUNDS.jsonl[.gz]")
    if sys.argv[1] == "--tables" and len(sys.argv) == 3:
        tables(Path(sys.argv[2]))
        return
    log_path = Path(sys.argv[1]).resolve()  # before Hydra can change the working directory
    record(log_path, sys.argv[2:])
    tables(log_path)


if __name__ == "__main__":
    main()
