"""A CPU linear layer that runs its matrix products through NumPy's BLAS.

Why: decoding one token is a chain of matrix-vector products that only memory bandwidth limits.
On the 2-core machines we measure on, torch's MKL GEMV streamed weights at about 13 GB/s (one core),
while OpenBLAS through NumPy reached about 20 GB/s (both cores); a SmolLM2-135M decode step went from
about 66 ms to about 46 ms. torch's own thread pool must then run single-threaded, or its spinning
OpenMP workers fight OpenBLAS for the two cores (see `LoadedModel.torch_threads`).
"""

from __future__ import annotations

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
        flat = x.reshape(-1, x.shape[-1]).numpy()
        y = torch.from_numpy(flat @ self.weight_t).view(*x.shape[:-1], self.out_features)  # (..., out)
        return y if self.bias is None else y + self.bias


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
