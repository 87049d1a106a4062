"""How much of the target's output a reduced-vocabulary drafter could propose at all:
`python experiments/row_coverage.py RUN_DIR CHECKPOINT [--rows N ...]` prints, for the baseline's answers of
an interleaved run, the share of output tokens among the drafter's kept rows (its `kept_ids`), per category,
then with the rows widened as `drafter.rows=N` / `draft.rows=N` / `heads.rows=N` widen them
(heads.draft_model.widen_rows). A token outside the rows ends every chain that reaches it."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file

from heads.draft_model import widen_rows

WEIGHTS = ("eagle.safetensors", "model.safetensors", "medusa.safetensors")


def kept_ids(checkpoint: Path) -> list[int]:
    """The rows a saved drafter (EAGLE, draft or Medusa heads folder) was trained on, as target ids."""
    for name in WEIGHTS:
        if (checkpoint / name).is_file():
            return load_file(str(checkpoint / name))["kept_ids"].long().tolist()
    raise SystemExit(f"{checkpoint} holds none of {', '.join(WEIGHTS)}; give a drafter's folder, "
                     "e.g. heads/checkpoints/smollm2-135m-eagle")


def coverage(rows: list[dict], kept: set[int]) -> tuple[float, dict[str, float]]:
    """(overall share, share per category) of the answers' output ids that are in `kept`."""
    total, hit = Counter(), Counter()
    for r in rows:
        total[r["category"]] += len(r["output_ids"])
        hit[r["category"]] += sum(t in kept for t in r["output_ids"])
    return sum(hit.values()) / max(sum(total.values()), 1), {c: hit[c] / total[c] for c in total if total[c]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--rows", type=int, nargs="*", default=[], help="widened row counts to report too")
    ap.add_argument("--vocab", type=int, default=49152, help="the target's vocabulary size")
    args = ap.parse_args()
    answers = [json.loads(line) for line in (args.run_dir / "answers.jsonl").read_text().splitlines() if line]
    baseline = json.loads((args.run_dir / "summary.json").read_text())["baseline"]
    answers = [r for r in answers if r["strategy"] == baseline]
    kept = kept_ids(args.checkpoint)
    share, by_category = coverage(answers, set(kept))
    print(f"{baseline}'s {sum(len(r['output_ids']) for r in answers)} output tokens in {len(kept)} kept rows: "
          f"{share:.3f}; " + ", ".join(f"{c} {v:.3f}" for c, v in by_category.items()))
    for n in args.rows:
        wide = set(widen_rows(torch.tensor(kept), n, args.vocab).tolist())
        print(f"rows={n}: {coverage(answers, wide)[0]:.3f}")


if __name__ == "__main__":
    main()
