"""The equality checks on a CUDA device (skipped without one): every strategy on the GPU against greedy
on the CPU (fp32) or the GPU's own eager greedy (bf16), eager and compiled; a token-tree pass against
each node's path decoded on its own; sampling on the device against the target's law. The same checks
as `python -m specdec.gpu_check` (its correctness cases), through the same code."""

from __future__ import annotations

import pytest
import torch

from specdec.gpu_check import correctness
from specdec.gpu_check.models import Models, Options

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def models() -> Models:
    return Models(Options(device="cuda", check_tokens=24, check_prompts=3, samples=2000))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", correctness.strategy_names())
def test_strategy_on_cuda_matches_greedy(models: Models, name: str, dtype: str, compiled: bool) -> None:
    r = correctness.check_strategy(models, name, dtype, compiled)
    assert r["passed"], r
    if compiled:
        assert r["engine"].endswith("+compiled"), r["engine"]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_tree_pass_on_cuda_matches_each_path(models: Models, dtype: str, compiled: bool) -> None:
    r = correctness.check_tree(models, dtype, compiled)
    assert r["passed"], r


def test_sampling_on_cuda_follows_the_target(models: Models) -> None:
    r = correctness.check_sampling_rules(models)
    assert r["passed"], r
    assert correctness.check_sampled_turns(models)["passed"]
