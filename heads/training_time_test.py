"""The training-time test (EAGLE-3, Li et al. 2025; HASS, Zhang et al. 2024): a drafter trained on what
drafting shows it.

Drafting the s-th token after the last verified pair j - (s - 1), the drafter attends to real pairs (their
features the target's) up to j - (s - 1) and to its own s - 1 guesses after them. A training pass s > 1 over a
whole sequence reproduces that for every pair j at once: it keeps each earlier pass's keys and values
(`PassStack`) and attends to pass 1's keys up to j - (s - 1) and to the diagonal of each later pass
(`ttt_mask`). heads/eagle3_train.py trains EAGLE-3 this way; heads/eagle.py with `head.context=drafting`.
"""

from __future__ import annotations

import torch
from torch import Tensor


class PassStack:
    """The training-time test's KV cache: each pass's keys and values per layer, (B, Hkv, T, hd), kept so that a
    later pass attends to them, returned concatenated along the key axis (pass 1's keys first)."""

    def __init__(self) -> None:
        self.k: dict[int, list[Tensor]] = {}
        self.v: dict[int, list[Tensor]] = {}

    def reserve(self, n_new: int) -> None:
        pass

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.k.setdefault(layer, []).append(k)
        self.v.setdefault(layer, []).append(v)
        return torch.cat(self.k[layer], 2), torch.cat(self.v[layer], 2)  # (B, Hkv, s T, hd)

    def advance(self, n_new: int) -> None:
        pass


def ttt_mask(T: int, s: int, device: torch.device) -> Tensor:
    """(1, 1, T, s T) which keys pair j attends to at pass s (1-based), the keys of pass r in columns
    (r - 1) T .. r T: pass 1's pairs j' <= j - (s - 1), whose features are real, then the diagonal
    j' = j - (s - r) of each later pass r, the drafter's own earlier guesses. Pass 1 is the causal mask."""
    j = torch.arange(T, device=device)
    blocks = [j[None, :] <= (j[:, None] - (s - 1))]
    blocks += [j[None, :] == (j[:, None] - (s - r)) for r in range(2, s + 1)]
    return torch.cat(blocks, 1)[None, None]
