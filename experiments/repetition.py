"""How much each strategy's outputs repeat themselves: the share of 4-grams in an answer that occurred
earlier in it, averaged over answers, per strategy, from a run's answers.jsonl.

At temperature 0 a lossless strategy repeats exactly as much as greedy. Above it, a lossy acceptance
rule can shift the text: Medusa's typical acceptance, offered a copy of earlier text every step, took
it often enough to raise this share well above plain sampling's (experiments/README.md, "A copy branch
in Medusa's tree").

    python experiments/repetition.py RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def repeated_share(ids: list[int], n: int = 4) -> float:
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def main(run_dirs: list[str]) -> None:
    if not run_dirs:
        sys.exit("usage: python experiments/repetition.py RUN_DIR [RUN_DIR ...] (folders holding answers.jsonl)")
    for run in run_dirs:
        path = Path(run) / "answers.jsonl"
        if not path.is_file():
            sys.exit(f"{path} not found; pass a folder written by python -m specdec.run")
        shares: dict[str, list[float]] = defaultdict(list)
        for line in path.read_text().splitlines():
            row = json.loads(line)
            shares[row["strategy"]].append(repeated_share(row["output_ids"]))
        cells = ", ".join(f"{name} {sum(v) / len(v):.3f}" for name, v in shares.items())
        print(f"{run}: repeated 4-grams per answer: {cells}")


if __name__ == "__main__":
    main(sys.argv[1:])
