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


class SpanTimer:
    """Adds up the time of many spans (the proposer's share of each step) without a wait per span:
    on CUDA each span is a pair of events, read once in `total()`; on the CPU a host clock."""

    def __init__(self, device: torch.device | str | None) -> None:
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self.seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._t0 = 0.0

    def start(self) -> None:
        if self.cuda:
            self._events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            self._events[-1][0].record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self._events[-1][1].record()
        else:
            self.seconds += time.perf_counter() - self._t0

    def total(self) -> float:
        """Seconds over every span so far (on CUDA, waits for the last span to finish)."""
        if self._events:
            self._events[-1][1].synchronize()
            self.seconds += sum(a.elapsed_time(b) for a, b in self._events) / 1e3
            self._events.clear()
        return self.seconds
