"""How much of the target's output a reduced-vocabulary drafter could propose at all:
`python experiments/row_coverage.py RUN_DIR CHECKPOINT [--rows N ...]` prints, for the baseline's answers of
an interleaved run, the share of output tokens among the drafter's kept rows (its `kept_ids`), per category,
then with the rows widened as `drafter.rows=N` / `draft.rows=N` / `heads.rows=N` widen them
(heads.draft_model.widen_rows). A token outside the rows ends every chain that reaches it.

`--requests`: also the share among the kept rows and the request's own tokens, then those and the answer's earlier
tokens, as EAGLE's `request_rows=true` scores them (strategies/request_rows.py). The prompts are rebuilt as the run
built them: the run's data file and model (its summary.json) and the baseline's earlier answers."""

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


def request_coverage(run_dir: Path, rows: list[dict], kept: set[int]) -> list[tuple[str, int, float, float, float]]:
    """Per category (and "all"): tokens, then the share in `kept`, in kept + the prompt's ids, and in those + the
    answer's earlier ids."""
    from omegaconf import OmegaConf

    from specdec.data import load_jsonl
    from specdec.models.loader import load_model
    from specdec.resolvers import register

    register()
    cfg = OmegaConf.create(json.loads((run_dir / "summary.json").read_text())["config"])
    model = {k: v for k, v in OmegaConf.to_container(cfg.model, resolve=True).items() if k != "_target_"}
    target = load_model(**model)
    questions = {str(q.question_id): q for q in load_jsonl(str(cfg.data.path))}
    said = {(str(r["question_id"]), r["turn"]): r["output_text"] for r in rows}
    counts: dict[str, list[int]] = {}
    for r in rows:
        q, turn = questions[str(r["question_id"])], r["turn"]
        messages = []
        for k in range(turn):
            messages += [{"role": "user", "content": q.turns[k]},
                         {"role": "assistant", "content": said[(str(r["question_id"]), k)]}]
        prompt = set(target.chat_ids(messages + [{"role": "user", "content": q.turns[turn]}]))
        seen: set[int] = set()
        for c in (r["category"], "all"):
            counts.setdefault(c, [0, 0, 0, 0])
        for t in r["output_ids"]:
            hits = (1, t in kept, t in kept or t in prompt, t in kept or t in prompt or t in seen)
            for c in (r["category"], "all"):
                counts[c] = [a + b for a, b in zip(counts[c], hits)]
            seen.add(t)
    return [(c, n, a / n, b / n, d / n) for c, (n, a, b, d) in counts.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--rows", type=int, nargs="*", default=[], help="widened row counts to report too")
    ap.add_argument("--vocab", type=int, default=49152, help="the target's vocabulary size")
    ap.add_argument("--requests", action="store_true", help="also count the request's own tokens (loads the model)")
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
    if args.requests:
        print("category, tokens: in kept rows / + the request's tokens / + the answer's earlier tokens")
        for c, n, a, b, d in request_coverage(args.run_dir, [r for r in answers if r.get("repeat", 0) == 0], set(kept)):
            print(f"{c}, {n}: {a:.3f} / {b:.3f} / {d:.3f}")


if __name__ == "__main__":
    main()
