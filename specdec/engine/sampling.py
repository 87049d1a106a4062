"""Turning logits into next tokens: greedy argmax or temperature/top-p sampling."""

from __future__ import annotations

from dataclasses import dataclass

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


def argmax_rows(logits: Tensor) -> list[int]:
    """The greedy token of each row of logits (T, V) (the first maximum, as torch.argmax gives).

    Why numpy on CPU float32: torch's argmax took 62 us per row of SmolLM2's 49k logits on these
    machines, numpy's 4 (a scratch timing); verification pays it for every token of the pass.
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def argmax_id(logits: Tensor) -> int:
    """The greedy token of one row of logits (V,)."""
    return argmax_rows(logits[None])[0]


def sample(probs: Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def check_finite(logits: Tensor) -> None:
    # One reduction instead of a (T, V) mask: any NaN or inf makes its row's sum NaN or inf (logits of
    # real models are far too small for a sum of 50k of them to overflow). ~4x cheaper on a CPU.
    if not torch.isfinite(logits.sum(-1)).all():
        raise SpecdecError("the model produced NaN or inf logits; try model.dtype=fp32, or check the weights")


def new_generator(device: torch.device | str, seed: int) -> torch.Generator:
    """A seeded generator on `device`: torch draws with a generator on the tensors' own device only."""
    return torch.Generator(device=torch.device(device)).manual_seed(seed)
