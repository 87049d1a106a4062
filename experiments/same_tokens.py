"""`python experiments/same_tokens.py RUN_A RUN_B [STRATEGY]`: the share of turns whose output ids two
runs agree on, per strategy (e.g. compiled against eager, `model.compile=true` against `false`)."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def outputs(run: Path) -> dict[tuple[str, str, int], list[int]]:
    rows = (json.loads(line) for line in (run / "answers.jsonl").read_text().splitlines() if line.strip())
    return {(r["strategy"], str(r["question_id"]), r["turn"]): r["output_ids"] for r in rows if not r.get("repeat")}


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__.strip().splitlines()[0])
        return 2
    a, b = outputs(Path(argv[0])), outputs(Path(argv[1]))
    same: dict[str, list[bool]] = defaultdict(list)
    for key in sorted(a.keys() & b.keys()):
        if len(argv) == 3 and key[0] != argv[2]:
            continue
        same[key[0]].append(a[key] == b[key])
    for name, hits in same.items():
        print(f"{name}: {sum(hits)}/{len(hits)} turns identical ({sum(hits) / len(hits):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
