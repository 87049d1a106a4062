"""experiments/results/INDEX.md is generated from the summaries (specdec/results_index.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec.resolvers import REPO_ROOT
from specdec.results_index import main, portable, render


def _summary(tmp: Path, name: str, data_path: str, lossless: bool = True) -> Path:
    run = tmp / "default" / name
    run.mkdir(parents=True)
    summary = {
        "baseline": "greedy",
        "strategies": {"greedy": {"tokens_per_s": 30.0, "speedup": 1.0, "turns": 4},
                       "medusa": {"speedup": 1.5, "speedup_ci": [1.3, 1.7], "mean_accepted_tokens": 2.1,
                                  "lossless": lossless, "turns": 4}},
        "config": {"command": f"python -m specdec.run data=jsonl data.path={data_path}",
                   "data": {"name": "jsonl", "path": data_path}},
        "environment": {"commit": "0123456789abcdef", "dirty": False, "date": "2026-12-02 10:00:00",
                        "cpu": "AMD EPYC", "cpu_count": 2},
    }
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def test_index_lists_every_run_with_portable_paths(tmp_path: Path) -> None:
    _summary(tmp_path, "a", str(REPO_ROOT / "experiments" / "data" / "specbench_style.jsonl"))
    _summary(tmp_path, "b", "/home/someone/private/questions.jsonl", lossless=False)
    text = render(tmp_path)
    rows = [line for line in text.splitlines() if line.startswith("| [")]
    assert len(rows) == 2 and rows[0].startswith("| [default/a](default/a/report.md)")
    assert "data.path=experiments/data/specbench_style.jsonl" in rows[0] and "0123456 " in rows[0] + " "
    assert "medusa 1.50x [1.30-1.70], tau 2.10" in rows[0] and "(lossy)" in rows[1]
    assert "/home/" not in text and str(REPO_ROOT) not in text and "<outside>/questions.jsonl" in rows[1]


def test_check_fails_on_a_stale_index_and_passes_once_regenerated(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    _summary(tmp_path, "a", "default")
    assert main([str(tmp_path), "--check"]) == 1 and "out of date" in capsys.readouterr().err
    assert main([str(tmp_path)]) == 0 and main([str(tmp_path), "--check"]) == 0
    _summary(tmp_path, "b", "default")  # a new run makes it stale again
    assert main([str(tmp_path), "--check"]) == 1


def test_no_summaries_is_one_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no summary.json" in err


def test_a_path_in_another_checkout_reads_relative_to_its_root() -> None:
    other = "/tmp/worktree/experiments/data/specbench_style.jsonl"
    assert portable(f"data.path={other}") == "data.path=experiments/data/specbench_style.jsonl"
    assert portable("/tmp/README.md") == "<outside>/README.md"   # one part is not enough to say it is ours


def test_portable_leaves_relative_text_alone() -> None:
    assert portable("tok/s 3/4 and a/b/c") == "tok/s 3/4 and a/b/c"


def test_reports_print_no_local_absolute_path(tmp_path: Path) -> None:
    from specdec.report import load_run, render

    run = _summary(tmp_path, "c", "/home/someone/private/questions.jsonl")
    text = render([load_run(run)], run)
    assert "/home/someone" not in text and "<outside>/questions.jsonl" in text
