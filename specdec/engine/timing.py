"""Wall-clock timing that is right on a GPU: CUDA kernels run asynchronously, so a host clock read
right after a launch measures the launch, not the work. Every timer that feeds a decision or a result
reads `clock(device)`, which first waits for the device's queued work (a no-op on the CPU)."""

from __future__ import annotations

import time

import torch


def synchronize(device: torch.device | str | None) -> None:
    """Wait for every kernel queued on `device` (nothing to wait for on the CPU)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device | str | None = None) -> float:
    """time.perf_counter() once the work queued on `device` has finished."""
    synchronize(device)
    return time.perf_counter()
