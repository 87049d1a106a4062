"""CPU linear layers that run their matrix products outside torch: NumPy's BLAS, or numba kernels.

Why: decoding one token is a chain of matrix-vector products that only memory bandwidth limits.
On the 2-core machines we measure on, torch's MKL GEMV streamed weights at about 13 GB/s (one core),
while OpenBLAS through NumPy reached about 20 GB/s (both cores); a SmolLM2-135M decode step went from
about 66 ms to about 46 ms. torch's own thread pool must then run single-threaded, or its spinning
OpenMP workers fight OpenBLAS for the two cores (see `LoadedModel.torch_threads`).
BLAS is still slow for 2 to 24 rows (verification passes); `NumbaLinear` fixes that (see cpu_kernels).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor, nn

from specdec.models import cpu_kernels
from specdec.models.cpu_layer import use_fused_stacks, use_layer_by_layer


class NumpyLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        # (in, out) row-major: x @ W^T becomes one contiguous GEMV/GEMM in BLAS.
        self.weight_t: np.ndarray = linear.weight.detach().t().contiguous().numpy()
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.out_features = self.weight_t.shape[1]

    @property
    def weight(self) -> Tensor:
        """(out, in), as nn.Linear has it: a view of weight_t, no copy."""
        return torch.from_numpy(self.weight_t).t()

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1]).numpy()  # (M, in)
        rows = flat.shape[0]
        padded = padded_rows(rows)
        if padded != rows:  # an 8-row GEMM beats a 3-row one in OpenBLAS; the extra rows are discarded
            flat = np.concatenate([flat, np.zeros((padded - rows, flat.shape[1]), dtype=flat.dtype)])
        y = torch.from_numpy((flat @ self.weight_t)[:rows]).view(*x.shape[:-1], self.out_features)  # (..., out)
        return y if self.bias is None else y + self.bias


class NumbaLinear(nn.Module):
    """x @ W^T through specdec's few-row kernels; W stays in torch's (out, in) layout and memory
    (no copy, so tied embeddings stay shared).

    `weights="bf16"` packs W as bfloat16 (half the bytes per pass) and `weights="int8"` as int8 with a
    scale per output (a quarter): for drafters, whose guesses the target checks anyway, never for the
    target. The float32 copy is replaced by the same rounded values, so prefill (BLAS) and the few-row
    kernels run one model (to rounding: int8 kernels scale each sum once at the end)."""

    def __init__(self, linear: nn.Linear, weights: str = "fp32") -> None:
        super().__init__()
        if weights not in cpu_kernels.KINDS:
            raise ValueError(f"weights={weights!r}: one of {', '.join(cpu_kernels.KINDS)}")
        self.weight = linear.weight.detach()  # (out, in)
        packed_from = self.weight.contiguous().numpy()
        rounding = {"bf16": cpu_kernels.to_bf16, "int8": cpu_kernels.to_int8}.get(weights)
        if rounding is not None:  # a rounded copy: the original may be shared (tied embeddings)
            self.weight = torch.from_numpy(rounding(packed_from))
        self.weight_np: np.ndarray = self.weight.contiguous().numpy()
        # A second copy, packed for the few-row kernels; BLAS (prefill) and the embedding read the first.
        self.panels: np.ndarray = cpu_kernels.pack(packed_from, kind=weights)  # (P, in, NB) (+ scales)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.out_features = self.weight_np.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        flat = np.ascontiguousarray(x.reshape(-1, x.shape[-1]).numpy())  # (M, in)
        y = cpu_kernels.matmul_wt(flat, self.weight_np, self.panels)
        y = torch.from_numpy(np.ascontiguousarray(y)).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def padded_rows(rows: int) -> int:
    """Row count to run a GEMM at. Measured on this project's 2-core machines (SmolLM2-135M's
    matrices, OpenBLAS): 1 row 24 ms, 2-7 rows 48-78 ms, 8 rows 45 ms, 16 rows 61 ms, 24 rows 69 ms,
    so odd sizes are padded up to the next multiple of 8."""
    return rows if rows == 1 or rows % 8 == 0 else (rows + 7) // 8 * 8


def use_numpy_linears(module: nn.Module, kind: Callable[[nn.Linear], nn.Module] = NumpyLinear) -> int:
    """Swap every fp32 CPU nn.Linear below `module` for `kind(linear)` (NumpyLinear or NumbaLinear);
    returns how many were swapped."""
    swapped = 0
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu":
            setattr(module, name, kind(child))
            swapped += 1
        else:
            swapped += use_numpy_linears(child, kind)
    return swapped


def use_numba_linears(module: nn.Module, weights: str = "fp32") -> int:
    if not cpu_kernels.available():
        raise ImportError("model.matmul=numba needs the numba package: pip install numba")
    return use_numpy_linears(module, functools.partial(NumbaLinear, weights=weights))


def use_torch_linears(module: nn.Module) -> None:
    """Undo use_numpy_linears (rebuilding nn.Linear from the transposed copies)."""
    for name, child in module.named_children():
        if isinstance(child, NumpyLinear | NumbaLinear):
            w = child.weight if isinstance(child, NumbaLinear) else torch.from_numpy(child.weight_t).t().contiguous()
            lin = nn.Linear(w.shape[1], w.shape[0], bias=child.bias is not None, device="meta")
            lin.weight = nn.Parameter(w, requires_grad=False)
            if child.bias is not None:
                lin.bias = nn.Parameter(child.bias, requires_grad=False)
            setattr(module, name, lin)
        else:
            use_torch_linears(child)


def _step_time(model: nn.Module, threads: int, steps: int, width: int) -> float:
    """Seconds for `steps` forward passes over `width` new tokens each, after one warm-up pass."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cache = model.new_cache((steps + 1) * width)  # type: ignore[operator]
        tok = torch.zeros(1, width, dtype=torch.long, device=model.device)  # type: ignore[arg-type]
        pos = torch.arange(width, device=tok.device)[None]  # (1, width)
        with torch.inference_mode():
            model(tok, pos, cache)  # warm-up: first touches of buffers, kernel compilation
            start = time.perf_counter()
            for i in range(steps):
                model(tok, pos + (i + 1) * width, cache)
            return time.perf_counter() - start
    finally:
        torch.set_num_threads(before)


MATMULS = ("torch", "numpy", "numba")


def use_matmul(model: nn.Module, kind: str, weights: str = "fp32") -> None:
    """Run `model`'s linears (and, for numba, whole decoder layers) the named way: torch, numpy, numba.
    `weights="bf16"` or `"int8"`: numba's kernels over rounded weights (see NumbaLinear); other kinds ignore it."""
    use_layer_by_layer(model)
    use_torch_linears(model)
    if kind == "numpy":
        use_numpy_linears(model)
    elif kind == "numba":
        use_numba_linears(model, weights)
        use_fused_stacks(model)


def pick_faster_linears(model: nn.Module, steps: int = 4) -> str:
    """Time one-token decode steps and 4-token verification passes with each available matmul
    (torch, NumPy's BLAS, numba kernels), keep the fastest in total and return its name.

    Measured rather than assumed: OpenBLAS's two threads win on an idle 2-core machine but lose
    badly when another process holds a core, and other CPUs and BLAS builds differ again.
    """
    times: dict[str, float] = {}
    for kind in MATMULS:
        if kind == "numba" and not cpu_kernels.available():
            continue
        use_matmul(model, kind)
        threads = torch.get_num_threads() if kind == "torch" else 1
        times[kind] = sum(_step_time(model, threads, steps, width) for width in (1, 4))
    best = min(times, key=times.__getitem__)
    if times["torch"] <= 1.05 * times[best]:
        best = "torch"  # within noise: keep the plain torch model
    if best != list(times)[-1]:  # the last one timed is still in place (numba's packed weights: no second copy)
        use_matmul(model, best)
    return best
