"""Questions of a held-apart set that share a 13-word n-gram with a drafter's training prompts.

A held-apart set chooses between two checkpoints only where it is apart from both: the training-data builder
keeps every prompt clear of it (heads/contamination.py), but a checkpoint trained before that check may not be.
Prints the overlapping question ids, one a line, for `experiments/paired.py --exclude`:

    python experiments/heldapart_overlap.py PROMPTS.jsonl experiments/heldapart/offline_clean.jsonl > overlap.txt
    python experiments/paired.py RUN_DIR draft_candidate draft --exclude overlap.txt

PROMPTS is any file `python -m heads.contamination --prompts` reads (jsonl, gzipped or not, or one a line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from heads.contamination import EvalIndex, EvalTurn, N, read_prompts
from specdec.data import load_jsonl
from specdec.errors import SpecdecError


def overlapping(prompts: list[str], questions_path: Path, n: int = N) -> list[str]:
    """Ids of the questions any of whose turns shares an n-word n-gram with a prompt, in file order."""
    index = EvalIndex([EvalTurn("training", str(i), 0, p) for i, p in enumerate(prompts)], n)
    return [q.question_id for q in load_jsonl(str(questions_path)) if any(index.hit(t) for t in q.turns)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("prompts", type=Path, help="the drafter's training prompts")
    ap.add_argument("questions", type=Path, help="a held-apart question file (Spec-Bench jsonl)")
    ap.add_argument("-n", type=int, default=N, help=f"n-gram length in words (default {N})")
    args = ap.parse_args()
    try:
        prompts = read_prompts(args.prompts)
        ids = overlapping(prompts, args.questions, args.n)
    except SpecdecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(ids))
    total = len(load_jsonl(str(args.questions)))
    print(f"{len(ids)} of {total} questions of {args.questions} share a {args.n}-word n-gram with "
          f"{len(prompts)} prompts of {args.prompts}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
