"""Turning logits into next tokens: greedy argmax or temperature/top-p sampling."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from specdec.errors import SpecdecError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise SpecdecError(f"generation.temperature={self.temperature} is negative; use 0 (greedy) or more")
        if not 0 < self.top_p <= 1:
            raise SpecdecError(f"generation.top_p={self.top_p} is outside (0, 1]; use for example 0.9 or 1.0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp(logits: Tensor, params: SamplingParams) -> Tensor:
    """Probabilities (..., V) after temperature and nucleus (top-p) filtering, in float32.

    Draft and target go through this same function, so speculative sampling compares the very
    distributions that plain sampling would draw from.
    """
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
        sorted_p = sorted_p.masked_fill(before >= params.top_p, 0.0)  # the top token always stays
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


F = TypeVar("F", bound=Callable[..., Any])


class HostReads(threading.local):
    """Counts the reads that bring device values to the host (each a synchronisation on a GPU).

    Functions marked `@host_read` are the decode loop's sanctioned transfers; the tests count them and
    every tensor-to-Python conversion made outside them (tests/test_host_syncs.py)."""

    count = 0
    inside = 0


HOST_READS = HostReads()


def host_read(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        HOST_READS.count += 1
        HOST_READS.inside += 1
        try:
            return fn(*args, **kwargs)
        finally:
            HOST_READS.inside -= 1
    return wrapper  # type: ignore[return-value]


@host_read
def read_greedy(logits: Tensor, tokens: Tensor | None = None) -> tuple[list[int], list[int]]:
    """The one device-to-host read of a greedy step: the target's argmax after each fed token (T,),
    the proposal's tokens (N,) when they live on the device, and whether every logit is finite (a
    SpecdecError if not), all in a single transfer."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        x = logits.numpy()  # numpy's argmax: see argmax_rows
        finite = bool(np.isfinite(x.sum(-1)).all())
        pred = x.argmax(-1).tolist()
        toks = [] if tokens is None else tokens.tolist()
    else:
        parts = [logits.argmax(-1), torch.isfinite(logits.sum(-1)).all().long()[None]]
        on_device = tokens is not None and tokens.device == logits.device
        if on_device:
            parts.append(tokens)  # type: ignore[arg-type]
        flat = torch.cat(parts).tolist()
        T = logits.shape[0]
        pred, finite = flat[:T], bool(flat[T])
        toks = flat[T + 1:] if on_device else ([] if tokens is None else tokens.tolist())
    if not finite:
        raise SpecdecError("the model produced NaN or inf logits; try model.dtype=fp32, or check the weights")
    return pred, toks


@host_read
def argmax_rows(logits: Tensor) -> list[int]:
    """The greedy token of each row of logits (T, V) (the first maximum, as torch.argmax gives).

    Why numpy on CPU float32: torch's argmax was many times slower per row of SmolLM2's 49k logits
    (experiments/README.md, "One call per pass, int8 drafter weights"); verification pays it for every
    token of the pass.
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()



@host_read
def sample(probs: Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def check_finite(logits: Tensor) -> None:
    # One reduction instead of a (T, V) mask: any NaN or inf makes its row's sum NaN or inf (logits of
    # real models are far too small for a sum of 50k of them to overflow). Much cheaper on a CPU.
    if not torch.isfinite(logits.sum(-1)).all():
        raise SpecdecError("the model produced NaN or inf logits; try model.dtype=fp32, or check the weights")


def new_generator(device: torch.device | str, seed: int) -> torch.Generator:
    """A seeded generator on `device`: torch draws with a generator on the tensors' own device only."""
    return torch.Generator(device=torch.device(device)).manual_seed(seed)
