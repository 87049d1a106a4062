"""Nothing lost, nothing twice: answers.jsonl turn by turn, resume, Ctrl-C."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

import specdec.run as runner
from specdec.errors import SpecdecError
from specdec.results import AnswerLog
from specdec.run import run
from tests.run_helpers import REPO, cli, cli_env, make_cfg, one_error_line, read_answers, write_questions


def _row(qid: str, turn: int = 0, strategy: str = "greedy") -> dict[str, object]:
    return {"strategy": strategy, "question_id": qid, "turn": turn, "output_ids": [1, 2]}


def test_answer_log_drops_torn_and_repeated_lines(tmp_path: Path) -> None:
    path = tmp_path / "answers.jsonl"
    whole = [json.dumps(_row("a")), json.dumps(_row("b")), json.dumps(_row("a") | {"output_ids": [9]})]
    path.write_text("\n".join(whole) + '\n{"strategy": "greedy", "question_id": "c", "tu')  # killed mid-line
    log = AnswerLog(path)
    assert log.count() == 2
    assert log.get("greedy", "a", 0)["output_ids"] == [1, 2]  # the first answer wins
    log.append(_row("c"))
    lines = path.read_text().splitlines()
    assert [json.loads(line)["question_id"] for line in lines] == ["a", "b", "c"]  # nothing glued on
    with pytest.raises(ValueError, match="already"):
        log.append(_row("b"))
    assert AnswerLog(path).count() == 3


def test_refresh_picks_up_a_line_written_just_before_an_interrupt(tmp_path: Path) -> None:
    log = AnswerLog(tmp_path / "answers.jsonl")
    log.append(_row("a"))
    with open(log.path, "a") as f:  # as if Ctrl-C landed between the write and the bookkeeping
        f.write(json.dumps(_row("b")) + "\n")
    log.refresh()
    assert log.count() == 2 and [r["question_id"] for r in log.new_rows] == ["a", "b"]


def test_resume_generates_only_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = write_questions(tmp_path / "q.jsonl", 4, turns=2)
    out = tmp_path / "out"
    overrides = ("data=jsonl", f"data.path={data}", "warmup=1")
    warmups: list[int] = []
    real_warm_up = runner._warm_up
    monkeypatch.setattr(runner, "_warm_up", lambda *a: warmups.append(1) or real_warm_up(*a))

    run(make_cfg(out, *overrides))
    first = read_answers(out)
    assert len(first) == 8 and len(warmups) == 1

    run(make_cfg(out, *overrides))  # nothing left: no warm-up, no new line
    assert read_answers(out) == first and len(warmups) == 1

    kept = [r for r in first if not (r["question_id"] == "q2" and r["turn"] == 1)]
    (out / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    summary = run(make_cfg(out, *overrides))
    again = read_answers(out)
    assert len(warmups) == 2  # a resumed run with work left is still measured warm
    assert len(again) == 8 and again[:7] == kept
    redone = again[7]
    assert (redone["question_id"], redone["turn"]) == ("q2", 1)
    original = next(r for r in first if r["question_id"] == "q2" and r["turn"] == 1)
    assert redone["output_ids"] == original["output_ids"]  # the same conversation so far, the same answer
    assert summary["strategies"]["greedy"]["new_tokens"] == sum(r["new_tokens"] for r in again)


def test_resume_refuses_other_settings(tmp_path: Path) -> None:
    data = write_questions(tmp_path / "q.jsonl", 2)
    out = tmp_path / "out"
    run(make_cfg(out, "data=jsonl", f"data.path={data}"))
    with pytest.raises(SpecdecError, match="generation.max_new_tokens: 3 then, 5 now"):
        run(make_cfg(out, "data=jsonl", f"data.path={data}", "generation.max_new_tokens=5"))
    assert len(read_answers(out)) == 2
    # another strategy may join the folder; the existing answers are kept
    run(make_cfg(out, "data=jsonl", f"data.path={data}", "strategies=[greedy,hf_generate]"))
    assert Counter(r["strategy"] for r in read_answers(out)) == {"greedy": 2, "hf_generate": 2}


def test_a_resumed_folder_names_the_code_its_answers_came_from(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    data = write_questions(tmp_path / "q.jsonl", 2)
    out = tmp_path / "out"
    overrides = ("data=jsonl", f"data.path={data}")
    state = {"now": ("a" * 40, True)}  # the code a run sees: (commit, dirty)
    monkeypatch.setattr(runner, "git_state", lambda: state["now"])
    monkeypatch.setattr("specdec.provenance.git_state", lambda: state["now"])
    env = run(make_cfg(out, *overrides))["environment"]
    assert (env["commit"], env["dirty"]) == ("a" * 40, True) and "code_states" not in env
    state["now"] = ("b" * 40, False)  # committed since; nothing left to answer: the answers are still a's
    env = run(make_cfg(out, *overrides))["environment"]
    assert (env["commit"], env["dirty"]) == ("a" * 40, True)
    # answers added by the clean run join dirty ones: no one clean commit made them all
    env = run(make_cfg(out, *overrides, "strategies=[greedy,hf_generate]"))["environment"]
    assert (env["commit"], env["dirty"]) == ("b" * 40, True)
    assert env["code_states"] == [{"commit": "a" * 40, "dirty": True}, {"commit": "b" * 40, "dirty": False}]
    # a fresh folder at one clean state says so
    env = run(make_cfg(tmp_path / "fresh", *overrides))["environment"]
    assert (env["commit"], env["dirty"]) == ("b" * 40, False)
    # answers from before states were recorded count as unknown code
    (tmp_path / "fresh" / "code_states.json").unlink()
    env = run(make_cfg(tmp_path / "fresh", *overrides, "strategies=[greedy,hf_generate]"))["environment"]
    assert env["dirty"] is True and env["code_states"][0] == {"commit": None, "dirty": None}


def test_ctrl_c_then_resume_ends_with_each_answer_once(tmp_path: Path) -> None:
    n = 200  # enough that the run cannot finish before the signal lands, even on a loaded machine
    data = write_questions(tmp_path / "q.jsonl", n)
    out = tmp_path / "out"
    args = ["data=jsonl", f"data.path={data}", "generation.max_new_tokens=2", "warmup=0", f"output_dir={out}"]
    # A child inherits an ignored SIGINT (Python then never raises KeyboardInterrupt in it); whether
    # pytest's process has it ignored depends on what ran before, so give the child the default.
    proc = subprocess.Popen([sys.executable, "-m", "specdec.run", "model=tiny-llama", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    answers = out / "answers.jsonl"
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if answers.is_file() and len(answers.read_text().splitlines()) >= 3:
            proc.send_signal(signal.SIGINT)
            break
        time.sleep(0.005)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    line = one_error_line(stderr)
    assert "interrupted" in line and f"output_dir={out}" in line and "resume" in line
    partial = read_answers(out)
    assert 3 <= len(partial) < n
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True
    assert summary["strategies"]["greedy"]["new_tokens"] == sum(r["new_tokens"] for r in partial)

    res = cli(*args, cwd=REPO)
    assert res.returncode == 0, res.stderr
    rows = read_answers(out)
    assert len(rows) == n
    assert sorted(r["question_id"] for r in rows) == sorted(f"q{i}" for i in range(n))
    assert rows[:len(partial)] == partial
