"""A CPU linear layer that runs its matrix products through NumPy's BLAS.

Why: decoding one token is a chain of matrix-vector products that only memory bandwidth limits.
On the 2-core machines we measure on, torch's MKL GEMV streamed weights at about 13 GB/s (one core),
while OpenBLAS through NumPy reached about 20 GB/s (both cores); a SmolLM2-135M decode step went from
about 66 ms to about 46 ms. torch's own thread pool must then run single-threaded, or its spinning
OpenMP workers fight OpenBLAS for the two cores (see `LoadedModel.torch_threads`).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import Tensor, nn


class NumpyLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        # (in, out) row-major: x @ W^T becomes one contiguous GEMV/GEMM in BLAS.
        self.weight_t: np.ndarray = linear.weight.detach().t().contiguous().numpy()
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.out_features = self.weight_t.shape[1]

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1]).numpy()  # (M, in)
        rows = flat.shape[0]
        padded = padded_rows(rows)
        if padded != rows:  # an 8-row GEMM beats a 3-row one in OpenBLAS; the extra rows are discarded
            flat = np.concatenate([flat, np.zeros((padded - rows, flat.shape[1]), dtype=flat.dtype)])
        y = torch.from_numpy((flat @ self.weight_t)[:rows]).view(*x.shape[:-1], self.out_features)  # (..., out)
        return y if self.bias is None else y + self.bias


def padded_rows(rows: int) -> int:
    """Row count to run a GEMM at. Measured on this project's 2-core machines (SmolLM2-135M's
    matrices, OpenBLAS): 1 row 24 ms, 2-7 rows 48-78 ms, 8 rows 45 ms, 16 rows 61 ms, 24 rows 69 ms,
    so odd sizes are padded up to the next multiple of 8."""
    return rows if rows == 1 or rows % 8 == 0 else (rows + 7) // 8 * 8


def use_numpy_linears(module: nn.Module) -> int:
    """Swap every fp32 CPU nn.Linear below `module` for a NumpyLinear; returns how many were swapped."""
    swapped = 0
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu":
            setattr(module, name, NumpyLinear(child))
            swapped += 1
        else:
            swapped += use_numpy_linears(child)
    return swapped


def use_torch_linears(module: nn.Module) -> None:
    """Undo use_numpy_linears (rebuilding nn.Linear from the transposed copies)."""
    for name, child in module.named_children():
        if isinstance(child, NumpyLinear):
            w = torch.from_numpy(child.weight_t).t().contiguous()
            lin = nn.Linear(w.shape[1], w.shape[0], bias=child.bias is not None, device="meta")
            lin.weight = nn.Parameter(w, requires_grad=False)
            if child.bias is not None:
                lin.bias = nn.Parameter(child.bias, requires_grad=False)
            setattr(module, name, lin)
        else:
            use_torch_linears(child)


def _decode_time(model: nn.Module, threads: int, steps: int) -> float:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cache = model.new_cache(steps + 1)  # type: ignore[operator]
        tok = torch.zeros(1, 1, dtype=torch.long, device=model.device)  # type: ignore[arg-type]
        with torch.inference_mode():
            model(tok, torch.zeros_like(tok), cache)  # warm-up: first touches of buffers
            start = time.perf_counter()
            for i in range(steps):
                model(tok, torch.full_like(tok, i + 1), cache)
            return time.perf_counter() - start
    finally:
        torch.set_num_threads(before)


def pick_faster_linears(model: nn.Module, steps: int = 6) -> bool:
    """Time single-token decode steps with torch's GEMV and with NumPy's; keep NumPy only if faster.

    Measured rather than assumed: OpenBLAS's two threads win on an idle 2-core machine but lose
    badly when another process holds a core, and other CPUs and BLAS builds differ again.
    """
    t_torch = _decode_time(model, torch.get_num_threads(), steps)
    use_numpy_linears(model)
    t_numpy = _decode_time(model, 1, steps)
    if t_numpy < 0.95 * t_torch:
        return True
    use_torch_linears(model)
    return False
