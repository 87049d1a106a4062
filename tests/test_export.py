"""Spec-Bench answer files (specdec.export) and Spec-Bench's speedup (specdec.specbench).

The speedup is checked against a plain recomputation written here the way Spec-Bench's
evaluation/speed.py reads the exported files: choice 0 of every line, the method's recorded new_tokens,
the baseline's tokens recounted from its text minus one, mean over questions of tokens / wall time.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from specdec.errors import SpecdecError
from specdec.export import export_specbench, main
from specdec.metrics import summarize
from specdec.models.loader import LoadedModel
from specdec.report import write_report
from specdec.run import run
from specdec.specbench import add_specbench_speedup, specbench_speedups
from tests.run_helpers import REPO, cli_env, make_cfg, one_error_line, read_answers

CHOICE_KEYS = {"index", "turns", "decoding_steps", "new_tokens", "wall_time", "accept_lengths"}


class WordTokenizer:
    """A stand-in tokenizer: a BOS, then one id per word (so a recount is the word count)."""

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [0] + list(range(1, len(text.split()) + 1))}


# (strategy, question_id, category) -> per turn: (output_text, new_tokens, wall_time_s, accept_lengths)
Turn = tuple[str, int, float, list[int]]
ANSWERS: dict[tuple[str, Any, str], list[Turn]] = {
    ("greedy", 81, "writing"): [("a b c d", 5, 1.0, [1] * 5), (" e f\n", 3, 0.5, [1] * 3)],
    ("greedy", "q-2", "qa"): [(" x y z w v u ", 7, 2.0, [1] * 7)],
    ("greedy", 7, "math"): [("m n", 2, 0.25, [1, 1])],
    ("greedy", "late", "qa"): [("p", 1, 1.0, [1])],  # prompt_lookup never answers it: left out
    ("prompt_lookup", 81, "writing"): [("a b c d", 5, 0.4, [1, 3, 1]), (" e f\n", 3, 0.4, [1, 2])],
    ("prompt_lookup", "q-2", "qa"): [(" x y z w v u ", 7, 0.5, [1, 4, 2])],
    ("prompt_lookup", 7, "math"): [("m n", 2, 0.1, [1, 1])],
}
# By hand: the baseline's recounted speeds 6/1.5, 6/2, 2/0.25 (mean 5); prompt_lookup's 8/0.8, 7/0.5,
# 2/0.1 (mean 44/3); greedy's own recorded speeds 8/1.5, 7/2, 2/0.25 against the recount.
EXPECTED = {"prompt_lookup": 44 / 3 / 5, "greedy": (8 / 1.5 + 3.5 + 8) / 3 / 5}


def make_rows(answers: dict[tuple[str, Any, str], list[Turn]] = ANSWERS, repeat: int = 0,
              slower: float = 1.0) -> list[dict[str, Any]]:
    rows = []
    for (strategy, qid, category), turns in answers.items():
        for t, (text, tokens, wall, accepts) in enumerate(turns):
            rows.append({"question_id": qid, "category": category, "turn": t, "strategy": strategy,
                         "prompt_tokens": 10, "new_tokens": tokens, "output_ids": list(range(tokens)),
                         "output_text": text, "wall_time_s": wall * slower, "ttft_s": 0.01,
                         "decode_steps": len(accepts) - 1, "accept_lengths": accepts, "proposed_tokens": 0,
                         "accepted_tokens": 0, "draft_time_s": 0.0, "repeat": repeat})
    return rows


def write_run(path: Path, rows: list[dict[str, Any]], tokenizer: Any = None) -> Path:
    """A results folder as specdec.run writes it (answers.jsonl, summary.json)."""
    path.mkdir(parents=True)
    (path / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"model": {"name": "tiny-llama"}, "generation": {"temperature": 0.0}}
    summary = summarize(rows, "greedy", 0.0, ["greedy", "prompt_lookup"], cfg)
    add_specbench_speedup(summary, rows, tokenizer)
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def speed_py(method: Path, base: Path, tokenizer: Any) -> float:
    """Spec-Bench's speedup read off two answer files, as evaluation/speed.py computes it (task overall)."""
    speeds = []
    for line in read_jsonl(method):
        choice = line["choices"][0]
        speeds.append(sum(choice["new_tokens"]) / sum(choice["wall_time"]))
    base_speeds = []
    for line in read_jsonl(base):
        choice = line["choices"][0]
        tokens = sum(len(tokenizer(text)["input_ids"]) - 1 for text in choice["turns"])
        base_speeds.append(tokens / sum(choice["wall_time"]))
    return statistics.fmean(speeds) / statistics.fmean(base_speeds)


def test_one_file_per_strategy_in_specbench_format(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", make_rows(), WordTokenizer())
    done = export_specbench(run_dir, tmp_path / "out")
    assert set(done.files) == {"greedy", "prompt_lookup"}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["greedy.jsonl", "prompt_lookup.jsonl"]
    assert done.questions == 3 and done.left_out == ["late"]
    for strategy, path in done.files.items():
        lines = read_jsonl(path)
        # ids keep their JSON type, in the order the run answered them; the unanswered question is left out
        assert [line["question_id"] for line in lines] == [81, "q-2", 7]
        assert [line["category"] for line in lines] == ["writing", "qa", "math"]
        for line in lines:
            assert set(line) == {"question_id", "category", "model_id", "choices"}
            assert line["model_id"] == f"tiny-llama-{strategy}"
            assert len(line["choices"]) == 1 and set(line["choices"][0]) == CHOICE_KEYS
            assert line["choices"][0]["index"] == 0
        for line in lines:
            turns = ANSWERS[(strategy, line["question_id"], line["category"])]
            choice = line["choices"][0]
            assert choice["turns"] == [text.strip() for text, *_ in turns]  # Spec-Bench strips its answers
            assert choice["new_tokens"] == [n for _, n, _, _ in turns]
            assert choice["wall_time"] == [w for _, _, w, _ in turns]
            assert choice["decoding_steps"] == [len(a) for *_, a in turns]  # target passes, prefill included
            assert choice["accept_lengths"] == [x for *_, a in turns for x in a]  # one list over the turns
    multi = read_jsonl(done.files["prompt_lookup"])[0]["choices"][0]
    assert multi["turns"] == ["a b c d", "e f"] and multi["new_tokens"] == [5, 3]


def test_speedup_specbench_matches_a_plain_recomputation(tmp_path: Path) -> None:
    tok = WordTokenizer()
    run_dir = write_run(tmp_path / "run", make_rows(), tok)
    summary = json.loads((run_dir / "summary.json").read_text())
    done = export_specbench(run_dir, tmp_path / "out")
    for name in ("greedy", "prompt_lookup"):
        value = summary["strategies"][name]["speedup_specbench"]
        assert value == pytest.approx(EXPECTED[name], rel=1e-12)
        assert value == pytest.approx(speed_py(done.files[name], done.files["greedy"], tok), rel=1e-12)
    assert summary["specbench"] == {"baseline_tokens": "retokenized", "questions": 3, "questions_left_out": 1,
                                    "repeats": 1}
    # specdec's own speedup is total tokens over total time: not the same number
    assert summary["strategies"]["prompt_lookup"]["speedup"] == pytest.approx((17 / 1.4) / (18 / 4.75))


def test_without_a_tokenizer_the_recorded_counts_are_used(tmp_path: Path) -> None:
    values, _ = specbench_speedups(make_rows(), "greedy")
    assert values["greedy"] == 1.0
    assert values["prompt_lookup"] == pytest.approx(44 / 3 / ((8 / 1.5 + 3.5 + 8) / 3), rel=1e-12)
    run_dir = write_run(tmp_path / "run", make_rows())
    assert json.loads((run_dir / "summary.json").read_text())["specbench"]["baseline_tokens"] == "recorded"


def test_repeats_become_choices_and_their_speedups_are_averaged(tmp_path: Path) -> None:
    tok = WordTokenizer()
    slow = make_rows(repeat=1, slower=2.0)
    for r in slow:  # the baseline alone is slower in repeat 1: that repeat's speedup doubles
        if r["strategy"] == "prompt_lookup":
            r["wall_time_s"] /= 2.0
    run_dir = write_run(tmp_path / "run", make_rows() + slow, tok)
    done = export_specbench(run_dir, tmp_path / "out")
    lines = read_jsonl(done.files["greedy"])
    assert [[c["index"] for c in line["choices"]] for line in lines] == [[0, 1]] * 3
    assert lines[0]["choices"][1]["wall_time"] == [2.0, 1.0]
    summary = json.loads((run_dir / "summary.json").read_text())
    expected = (EXPECTED["prompt_lookup"] + 2 * EXPECTED["prompt_lookup"]) / 2  # mean over repeats
    assert summary["strategies"]["prompt_lookup"]["speedup_specbench"] == pytest.approx(expected, rel=1e-12)
    # speed.py reads choice 0, the first repeat
    assert speed_py(done.files["prompt_lookup"], done.files["greedy"], tok) == pytest.approx(EXPECTED["prompt_lookup"])


def test_report_shows_the_specbench_speedup(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", make_rows(), WordTokenizer())
    _, text = write_report([run_dir], tmp_path / "report")
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("| strategy | tokens/s"))  # the overall table
    header = [c.strip() for c in lines[at].strip("|").split("|")]
    row = next(line for line in lines[at:] if line.startswith("| prompt_lookup "))
    cells = dict(zip(header, (c.strip() for c in row.strip("|").split("|"))))
    assert cells["Spec-Bench speedup"] == f"{EXPECTED['prompt_lookup']:.2f}"
    assert "baseline's tokens retokenized" in text
    # a summary from before the field: the report computes it, from the recorded token counts
    old = tmp_path / "old"
    old.mkdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    for s in summary["strategies"].values():
        del s["speedup_specbench"]
    del summary["specbench"]
    (old / "summary.json").write_text(json.dumps(summary))
    (old / "answers.jsonl").write_text((run_dir / "answers.jsonl").read_text())
    _, text = write_report([old], tmp_path / "report-old")
    assert "baseline's tokens recorded" in text


def test_a_run_records_it_and_exports_numeric_ids_as_numbers(tmp_path: Path, tiny_target: LoadedModel,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "question.jsonl"
    questions = [{"question_id": 1, "category": "qa", "turns": ["Name a colour.", "And another one?"]},
                 {"question_id": "x2", "category": "rag", "turns": ["Say hello."]},
                 {"question_id": 3, "category": "qa", "turns": ["Count to five."]}]
    data.write_text("".join(json.dumps(q) + "\n" for q in questions))
    out = tmp_path / "run"
    summary = run(make_cfg(out, "strategies=[greedy,prompt_lookup]", "data=jsonl", f"data.path={data}",
                           "generation.max_new_tokens=8"))
    assert {r["question_id"] for r in read_answers(out)} == {"1", "x2", "3"}  # the runner keeps ids as text
    assert main(["specbench", str(out), "--out", str(tmp_path / "sb")]) == 0
    files = {name: tmp_path / "sb" / f"{name}.jsonl" for name in ("greedy", "prompt_lookup")}
    for path in files.values():
        lines = read_jsonl(path)
        assert [line["question_id"] for line in lines] == [1, "x2", 3]
        assert [len(line["choices"][0]["turns"]) for line in lines] == [2, 1, 1]
    assert summary["specbench"]["baseline_tokens"] == "retokenized"
    for name, path in files.items():
        expected = speed_py(path, files["greedy"], tiny_target.tokenizer)
        assert summary["strategies"][name]["speedup_specbench"] == pytest.approx(expected, rel=1e-9)
    # the question file moved: ids stay text, the command says so, and --questions names the file
    moved = data.rename(tmp_path / "moved.jsonl")
    capsys.readouterr()
    assert main(["specbench", str(out), "--out", str(tmp_path / "sb2")]) == 0
    assert "give --questions FILE" in capsys.readouterr().out
    assert [line["question_id"] for line in read_jsonl(tmp_path / "sb2" / "greedy.jsonl")] == ["1", "x2", "3"]
    assert main(["specbench", str(out), "--out", str(tmp_path / "sb3"), "--questions", str(moved)]) == 0
    assert [line["question_id"] for line in read_jsonl(tmp_path / "sb3" / "greedy.jsonl")] == [1, "x2", 3]


def test_bad_input_is_one_error_line(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for args, says in (([str(tmp_path / "empty")], "no answers.jsonl in"),
                       ([str(tmp_path / "missing")], "run folder not found"),
                       ([str(tmp_path / "empty"), "--out", str(tmp_path / "o")], "no answers.jsonl in")):
        res = subprocess.run([sys.executable, "-m", "specdec.export", "specbench", *args], cwd=REPO,
                             capture_output=True, text=True, env=cli_env(), timeout=120)
        assert res.returncode != 0
        assert says in one_error_line(res.stderr)
    assert not (tmp_path / "o").exists()
    # prompt_lookup answered one turn of question 81 only: no question is whole in every strategy
    rows = [r for r in make_rows() if r["strategy"] == "greedy" or (r["question_id"] == 81 and r["turn"] == 0)]
    partial = write_run(tmp_path / "partial", rows)
    with pytest.raises(SpecdecError, match="answered whole by every strategy"):
        export_specbench(partial, tmp_path / "o")
