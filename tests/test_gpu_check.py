"""specdec.gpu_check runs its whole path on the CPU with a tiny shape (the GPU run is the same code)."""

from __future__ import annotations

import json
from pathlib import Path

from specdec.gpu_check import main


def test_gpu_check_on_cpu_tiny_shape(tmp_path: Path) -> None:
    rc = main(["--device", "cpu", "--shape", "tiny", "--new-tokens", "8", "--rounds", "1", "--ks", "1,2,4",
               "--context", "16", "--out", str(tmp_path)])
    r = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rc == 0 and r["correctness"]["passed"]
    c = r["correctness"]
    assert c["greedy_gpu_vs_cpu"] == c["draft_random"] == c["medusa_tree"] == c["eagle_random"] == 1.0
    assert c["draft_lookup_random"] == 1.0
    assert c["tree_logits_max_abs_diff"] < 1e-4
    s = r["speed"]
    assert set(s["greedy_vs_hf"]) == {"greedy", "hf_generate"} and s["weight_bytes"] > 0
    assert set(s["verification_ratio"]) == {"1", "2", "4"} and s["verification_ratio"]["1"] == 1.0
    assert "greedy / hf_generate" in (tmp_path / "gpu_check.md").read_text()


def test_gpu_check_without_cuda_says_how_to_run_it(capsys) -> None:  # type: ignore[no-untyped-def]
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the no-GPU message cannot be shown")
    assert main(["--out", "/nonexistent"]) == 2
    assert "--device cpu --shape tiny" in capsys.readouterr().err
