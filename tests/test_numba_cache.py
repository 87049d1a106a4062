"""numba's disk cache across processes: compiled functions that call the parallel tile products must load
in a later process and run (cpu_kernels.mm_into_nested says why this once crashed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.models import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="needs numba")

# A process that only uses the products from Python: it caches cpu_kernels.mm_into alone.
PRODUCTS_ONLY = """
import numpy as np
from specdec.models import cpu_kernels
x = np.ones((1, 64), np.float32)
cpu_kernels.matmul(x, cpu_kernels.pack(np.ones((64, 64), np.float32)), 64)
"""

# A process that runs the compiled callers: the Medusa heads' per-node calls first, before anything calls
# mm_into from Python (the order in which a caller broken in the cache crashed), then a fused decoder pass and
# a drafter's one-call pass (cpu_drafter).
CALLERS = """
import sys
import numpy as np
import torch
from heads.cpu_heads import residual_block, top_logprobs
from specdec.engine.engine import StaticEngine
from specdec.models import cpu_kernels
from specdec.models.loader import load_model

x = np.ones(64, np.float32)
panels = cpu_kernels.pack(np.ones((64, 64), np.float32))
tiles = cpu_kernels.tiles_for(panels)
residual_block(x, x, np.empty(0, np.float32), cpu_kernels.pack(np.ones((64, 128), np.float32)), x, tiles)
top_logprobs(x, panels, 64, tiles, 4)
model = load_model("tiny", sys.argv[1], matmul="numba").model
assert model.fused is not None
StaticEngine(model, 64).forward(torch.arange(5))
from specdec.models.cpu_drafter import DrafterPass
model.embed = torch.nn.Embedding.from_pretrained(model.embed.weight)  # untied: a draft's own table
DrafterPass(model)(np.arange(3), None, model.new_cache(8))
print("ran")
"""


def test_cached_callers_load_in_a_later_process(tmp_path: Path, tiny_folders: dict[str, Path]) -> None:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    root = Path(__file__).resolve().parent.parent

    def run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", code, *args], cwd=root, env=env, capture_output=True,
                              text=True, timeout=600)

    assert run(PRODUCTS_ONLY).returncode == 0
    for attempt in ("compiles the callers", "loads them from the cache"):
        done = run(CALLERS, str(tiny_folders["llama"]))
        assert done.returncode == 0 and "ran" in done.stdout, (attempt, done.returncode, done.stderr[-2000:])
