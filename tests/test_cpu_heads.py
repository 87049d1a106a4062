"""The sequential Medusa heads' compiled per-node calls (heads/cpu_heads.py) against numpy and torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.models import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="needs numba")


@pytest.mark.parametrize("kind", ["fp32", "int8"])
@pytest.mark.parametrize("extra", [0, 1, 2])  # head 1+ blocks read [x], [x, e(root)] or [x, e(root), e(prev)]
def test_residual_block_is_the_numpy_block(kind: str, extra: int) -> None:
    from heads.cpu_heads import residual_block

    rng = np.random.default_rng(extra)
    dim = 48
    x, e1, e2 = (rng.standard_normal(dim, dtype=np.float32) for _ in range(3))
    rows = [e1, e2][:extra]
    w = rng.standard_normal((dim, dim * (1 + extra)), dtype=np.float32) / 8
    bias = rng.standard_normal(dim, dtype=np.float32)
    panels = cpu_kernels.pack(w, kind=kind)
    none = np.empty(0, dtype=np.float32)
    got = residual_block(x, rows[0] if extra > 0 else none, rows[1] if extra > 1 else none, panels, bias,
                         cpu_kernels.tiles_for(panels))
    y = cpu_kernels.matmul(np.concatenate([x, *rows])[None], panels, dim)[0] + bias  # the same product, bitwise
    np.testing.assert_allclose(got, x + y / (1 + np.exp(-y)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("width", [1, 4, 7])
def test_top_logprobs_are_torch_topk_of_log_softmax(width: int) -> None:
    from heads.cpu_heads import top_logprobs

    rng = np.random.default_rng(width)
    n_out, dim = 301, 40  # a ragged last panel
    w = rng.standard_normal((n_out, dim), dtype=np.float32)
    x = rng.standard_normal(dim, dtype=np.float32)
    panels = cpu_kernels.pack(w)
    best, logp = top_logprobs(x, panels, n_out, cpu_kernels.tiles_for(panels), width)
    logits = torch.from_numpy(cpu_kernels.matmul(x[None], panels, n_out)[0])
    ref = torch.log_softmax(logits, -1).topk(width)
    assert best.tolist() == ref.indices.tolist()
    np.testing.assert_allclose(logp, ref.values.numpy(), rtol=0, atol=2e-5)


def test_top_logprobs_break_ties_towards_the_lower_index() -> None:
    from heads.cpu_heads import top_logprobs

    w = np.zeros((40, 8), dtype=np.float32)
    w[[5, 9, 30], 0] = 1.0  # three equal best logits
    panels = cpu_kernels.pack(w)
    best, logp = top_logprobs(np.ones(8, dtype=np.float32), panels, 40, cpu_kernels.tiles_for(panels), 4)
    assert best[:3].tolist() == [5, 9, 30] and best[3] not in (5, 9, 30)
    assert logp[0] == logp[1] == logp[2] > logp[3]
