"""`python -m specdec.run -m ...`: one results folder per job, and the report reads the sweep folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from specdec.report import load_runs, sweep_axis, write_report


def test_multirun_writes_one_results_folder_per_job(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "specdec.run", "-m", "model=tiny-llama", "strategy=greedy",
         "generation.max_new_tokens=3,6", "data.limit=2", "warmup=0", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]

    for job, max_new in (("0", 3), ("1", 6)):
        folder = sweep / job
        rows = [json.loads(line) for line in (folder / "answers.jsonl").read_text().splitlines()]
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["config"]["generation"]["max_new_tokens"] == max_new
        assert summary["config"]["output_dir"] == str(folder)  # ${hydra:runtime.output_dir}, per job
        assert len(rows) >= 2 and {r["strategy"] for r in rows} == {"greedy"}
        assert all(r["new_tokens"] <= max_new for r in rows)
        assert summary["strategies"]["greedy"]["new_tokens"] == sum(r["new_tokens"] for r in rows)
        assert f"generation.max_new_tokens={max_new}" in (folder / ".hydra" / "overrides.yaml").read_text()
    assert not (tmp_path / "outputs").exists()  # nothing written outside the sweep folder

    runs = load_runs([sweep])
    assert sweep_axis(runs) == ("generation.max_new_tokens", [3.0, 6.0])
    _, text = write_report([sweep])
    assert "python -m specdec.run model=tiny-llama strategy=greedy generation.max_new_tokens=6" in text
    assert (sweep / "plots" / "sweep_generation_max_new_tokens.png").stat().st_size > 0
