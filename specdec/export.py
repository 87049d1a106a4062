"""`python -m specdec.export specbench RUN_DIR [--out DIR]`: a results folder -> Spec-Bench answer files.

Writes `DIR/<strategy>.jsonl` for each strategy of RUN_DIR (a folder of `python -m specdec.run`) in
Spec-Bench's model-answer format, so Spec-Bench's `evaluation/speed.py` and `evaluation/equal.py` read
them unchanged (docs/specbench.md). One line per question:

    {"question_id", "category", "model_id",
     "choices": [{"index", "turns", "decoding_steps", "new_tokens", "wall_time", "accept_lengths"}]}

- `turns`, `decoding_steps`, `new_tokens`, `wall_time` hold one entry per turn; `accept_lengths` is the
  turns' per-pass lists joined into one, as Spec-Bench writes it. `decoding_steps` counts target passes
  with the prefill (len(accept_lengths) of the turn), null where a strategy does not report them.
- `choices` holds one choice per repeat of the run (`index` = repeat); Spec-Bench's scripts read choice 0.
- only questions every strategy answered whole (every turn, every repeat) are written, in the order the
  run answered them, so the files line up for equal.py; the rest are named on the command line.
- question ids keep their JSON type: an id that is a number in the run's question file (the summary's
  `data.path`, or --questions) is written as that number, though answers.jsonl stores ids as text.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.errors import SpecdecError
from specdec.resolvers import REPO_ROOT
from specdec.specbench import Questions, Row, group_questions, turn_text


@dataclass
class Exported:
    """What `export_specbench` wrote."""

    files: dict[str, Path]  # strategy -> its jsonl
    questions: int  # lines in each file
    left_out: list[str]  # str ids of questions not answered whole by every strategy
    missing_questions_file: str | None = None  # the summary's data.path, where it is not found here


def read_rows(run_dir: Path) -> list[Row]:
    """answers.jsonl's rows; a torn line (a killed run) is skipped as the runner skips it."""
    if not run_dir.is_dir():
        what = "is a file, not a folder" if run_dir.exists() else "not found"
        raise SpecdecError(f"run folder {what}: {run_dir} (give a results folder written by python -m specdec.run)")
    file = run_dir / "answers.jsonl"
    if not file.is_file():
        raise SpecdecError(f"no answers.jsonl in {run_dir}; give a results folder written by python -m specdec.run "
                           "(a multirun sweep folder holds one per job)")
    rows = []
    for line in file.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and {"strategy", "question_id", "turn"} <= set(row):
            rows.append(row)
    if not rows:
        raise SpecdecError(f"{file} holds no answers; run python -m specdec.run with output_dir={run_dir} first")
    return rows


def read_summary(run_dir: Path) -> dict[str, Any]:
    """summary.json, or {} when the run never wrote one (the export then names the model `specdec`)."""
    file = run_dir / "summary.json"
    if not file.is_file():
        return {}
    try:
        summary = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise SpecdecError(f"{file} is not valid JSON ({e.msg}, line {e.lineno}); rerun the benchmark or delete "
                           "it") from None
    return summary if isinstance(summary, dict) else {}


def source_ids(questions_file: Path | None) -> dict[str, Any]:
    """str(id) -> the id as the question file writes it (only numbers: text ids are text already).

    Missing or unreadable files give {}: the ids are then written as answers.jsonl holds them."""
    if questions_file is None or not questions_file.is_file():
        return {}
    ids: dict[str, Any] = {}
    for line in questions_file.read_text(encoding="utf-8-sig", errors="replace").splitlines():
        try:
            raw = json.loads(line).get("question_id")
        except (json.JSONDecodeError, AttributeError):
            continue
        if isinstance(raw, int | float) and not isinstance(raw, bool):
            ids[str(raw)] = raw
    return ids


def target_passes(row: Row) -> int | None:
    """A turn's target forward passes, prefill included (Spec-Bench's decoding_steps; for its
    autoregressive baseline one per token); None where the strategy does not report them."""
    if row.get("accept_lengths") is not None:
        return len(row["accept_lengths"])
    return None if row.get("decode_steps") is None else int(row["decode_steps"]) + 1


def answer_line(qs: Questions, strategy: str, qid: str, model_id: str, ids: dict[str, Any]) -> dict[str, Any]:
    """One Spec-Bench model-answer line: one question, one choice per repeat."""
    choices = []
    for rep in qs.repeats:
        turns = qs.rows(strategy, qid, rep)
        choices.append({
            "index": rep,
            "turns": [turn_text(r) for r in turns],
            "decoding_steps": [target_passes(r) for r in turns],
            "new_tokens": [int(r["new_tokens"]) for r in turns],
            "wall_time": [float(r["wall_time_s"]) for r in turns],
            "accept_lengths": [int(a) for r in turns for a in (r.get("accept_lengths") or [])],
        })
    first = qs.rows(strategy, qid, qs.repeats[0])[0]
    return {"question_id": ids.get(qid, first["question_id"]), "category": first.get("category", "general"),
            "model_id": model_id, "choices": choices}


def export_specbench(run_dir: str | Path, out: str | Path | None = None,
                     questions_file: str | Path | None = None) -> Exported:
    """Write one Spec-Bench answer file per strategy of run_dir into `out` (default run_dir/specbench)."""
    run_dir = Path(run_dir).expanduser()
    rows = read_rows(run_dir)
    summary = read_summary(run_dir)
    config = summary.get("config") if isinstance(summary.get("config"), dict) else {}
    if questions_file is not None and not Path(questions_file).expanduser().is_file():
        raise SpecdecError(f"--questions {questions_file}: file not found; give the run's question.jsonl or leave "
                           "it out")
    path = questions_file if questions_file is not None else (config.get("data") or {}).get("path")
    questions = Path(path).expanduser() if isinstance(path, str | Path) else None
    if questions is not None and questions_file is None and not questions.is_absolute():
        questions = REPO_ROOT / questions  # runs record paths inside the repository relative to its root
    ids = source_ids(questions)
    qs = group_questions(rows)
    if not qs.question_ids:
        names = ", ".join(qs.strategies)
        raise SpecdecError(f"no question in {run_dir} was answered whole by every strategy ({names}); finish the "
                           "run (the same command resumes it) and export again")
    out_dir = Path(out).expanduser() if out is not None else run_dir / "specbench"
    if out_dir.exists() and not out_dir.is_dir():
        raise SpecdecError(f"--out {out_dir} is a file; give a folder")
    model = str((config.get("model") or {}).get("name") or "specdec")
    files: dict[str, Path] = {}
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for strategy in qs.strategies:
            lines = [answer_line(qs, strategy, q, f"{model}-{strategy}", ids) for q in qs.question_ids]
            files[strategy] = out_dir / f"{strategy}.jsonl"
            files[strategy].write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    except OSError as e:
        raise SpecdecError(f"cannot write to {out_dir}: {e.strerror}; pick a writable --out") from None
    missing = str(questions) if questions is not None and not questions.is_file() else None
    return Exported(files, len(qs.question_ids), qs.left_out, missing)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.export", description=__doc__.split("\n")[0])
    formats = parser.add_subparsers(dest="format", required=True, metavar="FORMAT")
    sb = formats.add_parser("specbench", help="Spec-Bench model-answer files, one per strategy")
    sb.add_argument("run", metavar="RUN_DIR", help="a results folder of python -m specdec.run")
    sb.add_argument("--out", default=None, help="folder for <strategy>.jsonl (default: RUN_DIR/specbench)")
    sb.add_argument("--questions", default=None,
                    help="the run's question.jsonl, for numeric ids (default: the summary's data.path)")
    ns = parser.parse_args(argv)
    try:
        done = export_specbench(ns.run, ns.out, ns.questions)
    except SpecdecError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    for strategy, path in done.files.items():
        print(f"wrote {path} ({done.questions} questions, {strategy})")
    if done.missing_questions_file:
        print(f"question ids written as text: the run's question file {done.missing_questions_file} is not here "
              "(give --questions FILE to write numeric ids as numbers)")
    if done.left_out:
        shown = ", ".join(done.left_out[:10]) + (f" and {len(done.left_out) - 10} more" if len(done.left_out) > 10
                                                 else "")
        print(f"left out {len(done.left_out)} questions some strategy did not answer whole: {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
