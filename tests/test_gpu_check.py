"""specdec.gpu_check: its whole path on the CPU with the tiny shape (the GPU run is the same code), and
the runner's isolation: a case that raises, fails or overruns is recorded and the others still run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from specdec.gpu_check import correctness, runner, speed
from specdec.gpu_check.runner import Case, main, run_cases


def _read(out: Path) -> dict[str, Any]:
    assert (out / "gpu_check.md").is_file()
    return json.loads((out / "gpu_check.json").read_text())


def test_gpu_check_on_cpu_tiny_shape_passes_every_case(tmp_path: Path) -> None:
    # small counts; inductor compiles each token bucket of each model for tens of seconds on a busy CPU,
    # so the compiled cases here are greedy's (one bucket per model); the CLI's defaults run more
    rc = main(["--device", "cpu", "--shape", "tiny", "--out", str(tmp_path), "--check-tokens", "8", "--prompts", "4",
               "--new-tokens", "6", "--context", "16", "--ks", "1,2", "--reps", "2", "--samples", "600",
               "--compiled-strategies", "greedy", "--skip", "correct/bf16/compiled/*,tree/*/compiled,"
               "speed/verification/compiled/*"])
    r = _read(tmp_path)
    failed = {k: v for k, v in r["cases"].items() if v["status"] != "passed"}
    assert rc == 0 and not failed and r["finished"]
    names = correctness.strategy_names()
    for dtype in ("fp32", "bf16"):
        assert {f"correct/{dtype}/eager/{s}" for s in names} <= set(r["cases"])
        assert f"tree/{dtype}/eager" in r["cases"]
    assert {"sampling/chi_square", "sampling/turns", "speed/weights", "speed/bandwidth", "speed/verification/eager",
            "correct/fp32/compiled/greedy"} <= set(r["cases"])
    assert not any(k.startswith("tree/") and k.endswith("/compiled") for k in r["cases"])  # --skip
    assert {f"speed/decode/{d}" for d in speed.DECODERS} <= set(r["cases"])
    assert {f"speed/drafting/{d}" for d in speed.DRAFTERS} <= set(r["cases"])
    assert {f"speed/batch/b{b}" for b in (1, 4)} <= set(r["cases"])
    for s in correctness.BATCHED:  # continuous batching reproduces the CPU's greedy, slot reuse included
        assert r["cases"][f"batch/fp32/{s}"]["result"]["identical"] == 1.0
    assert r["cases"]["speed/batch/b4"]["result"]["tokens"] == 4 * 6
    distill = r["cases"]["distill/fp32/compiled"]["result"]  # the distillation's compiled loop
    assert distill["identical"] == 1.0 and distill["max_hidden_diff_vs_eager"] < 1e-2
    fp32 = r["cases"]["correct/fp32/eager/draft_random"]["result"]
    assert fp32["identical"] == 1.0 and fp32["max_deficit"] == 0.0  # on the CPU the device is the reference
    assert r["cases"]["correct/fp32/compiled/greedy"]["result"]["engine"] == "StaticEngine+compiled"
    assert r["cases"]["tree/fp32/eager"]["result"]["max_abs_logit_diff"] < 1e-4
    assert r["cases"]["speed/decode/hf_static"]["result"]["how"] == "transformers static"  # no compile on a CPU
    assert r["cases"]["speed/weights"]["result"]["weight_bytes"] > 0
    assert set(r["cases"]["speed/verification/eager"]["result"]["ratio"]) == {"1", "2"}
    text = (tmp_path / "gpu_check.md").read_text()
    assert "| draft_lookup | ok 1.00" in text and "| greedy_compiled | StaticEngine+compiled |" in text


def test_a_case_that_raises_is_recorded_and_the_rest_run(tmp_path: Path) -> None:
    seen: list[str] = []

    def ok(name: str) -> dict[str, Any]:
        seen.append(name)
        return {"passed": True, "value": 1.5}

    def boom() -> dict[str, Any]:
        raise ValueError("a broken case\nover two lines")

    cases = [Case("a", lambda: ok("a")), Case("b", boom), Case("c", lambda: {"passed": False}),
             Case("d", lambda: ok("d"))]
    r = run_cases(cases, tmp_path, {"command": "test"}, torch.device("cpu"), budget_s=60, case_timeout_s=30,
                  log=lambda line: None)
    assert seen == ["a", "d"]
    on_disk = _read(tmp_path)
    assert on_disk["summary"] == r["summary"] == {"passed": 2, "failed": 1, "error": 1, "skipped": 0}
    b = on_disk["cases"]["b"]
    assert b["status"] == "error" and b["error"] == "ValueError: a broken case over two lines"
    assert any("boom" in w for w in b["where"])
    assert on_disk["cases"]["d"]["result"]["value"] == 1.5
    assert "ValueError: a broken case" in (tmp_path / "gpu_check.md").read_text()


def test_files_are_written_as_each_case_ends(tmp_path: Path) -> None:
    def peek() -> dict[str, Any]:
        return {"passed": True, "cases_on_disk": list(_read(tmp_path)["cases"])}

    r = run_cases([Case("first", lambda: {}), Case("second", peek)], tmp_path, {}, torch.device("cpu"), 60, 30,
                  log=lambda line: None)
    assert r["cases"]["second"]["result"]["cases_on_disk"] == ["first"]
    assert _read(tmp_path)["finished"] is True


def test_overrunning_cases_time_out_and_the_budget_skips_the_rest(tmp_path: Path) -> None:
    def slow() -> dict[str, Any]:
        time.sleep(5)
        return {}

    r = run_cases([Case("slow", slow), Case("fast", lambda: {})], tmp_path, {}, torch.device("cpu"),
                  budget_s=60, case_timeout_s=0.3, log=lambda line: None)
    assert r["cases"]["slow"]["status"] == "error" and r["cases"]["slow"]["error"].startswith("CaseTimeout")
    assert r["cases"]["slow"]["seconds"] < 3 and r["cases"]["fast"]["status"] == "passed"
    r = run_cases([Case("x", lambda: {}), Case("y", lambda: {})], tmp_path, {}, torch.device("cpu"),
                  budget_s=0, case_timeout_s=1, log=lambda line: None)
    assert {c["status"] for c in r["cases"].values()} == {"skipped"} and "--cases 'y'" in r["cases"]["y"]["error"]


def test_main_records_a_raising_check_and_exits_nonzero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any) -> dict[str, Any]:
        raise RuntimeError("tree pass exploded")

    monkeypatch.setattr(runner, "check_tree", broken)  # all_cases reads it there
    rc = main(["--device", "cpu", "--out", str(tmp_path), "--cases", "tree/*/eager,speed/bandwidth"])
    r = _read(tmp_path)
    assert rc == 1 and set(r["cases"]) == {"tree/fp32/eager", "tree/bf16/eager", "speed/bandwidth"}
    assert r["cases"]["tree/bf16/eager"]["error"] == "RuntimeError: tree pass exploded"
    assert r["cases"]["speed/bandwidth"]["status"] == "passed"


def test_gpu_check_without_cuda_says_how_to_run_it(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the no-GPU message cannot be shown")
    assert main(["--out", "/nonexistent"]) == 2
    assert "--device cpu --shape tiny" in capsys.readouterr().err


def test_python_dash_m_runs_the_package() -> None:
    # the command the docs give: the package's __main__ reaches the same CLI, with its own usage line
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the no-GPU exit cannot be shown")
    help_ = subprocess.run([sys.executable, "-m", "specdec.gpu_check", "--help"], capture_output=True, text=True)
    assert help_.returncode == 0 and help_.stdout.startswith("usage: python -m specdec.gpu_check")
    assert "the one-script GPU check" in help_.stdout
    run = subprocess.run([sys.executable, "-m", "specdec.gpu_check", "--out", "/nonexistent"], capture_output=True,
                         text=True)
    assert run.returncode == 2 and "--device cpu --shape tiny" in run.stderr
