"""A static KV cache: preallocated once, written in place, rolled back by moving a length pointer."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from specdec.errors import SpecdecError


class KVCache:
    """K/V for every layer in one buffer each: (L, B, H_kv, T_max, D).

    Lengths live on the host as plain ints: every decode step needs them to slice, and reading
    them back from a device tensor would cost a synchronisation per layer.
    """

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.lengths = [0] * batch
        self._pending = 0  # tokens being written by the forward in flight

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def reserve(self, n_new: int) -> None:
        need = max(self.lengths) + n_new
        if need > self.max_len:
            raise SpecdecError(f"KV cache overflow: {need} positions needed but the cache holds {self.max_len}; "
                               "shorten the prompt or lower generation.max_new_tokens")
        self._pending = n_new

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store new K/V (B, H_kv, T, D) after each sequence's length; return K/V over the used slots."""
        T = k.shape[2]
        if self.batch == 1 or len(set(self.lengths)) == 1:
            n = self.lengths[0]
            self.k[layer, :, :, n:n + T] = k
            self.v[layer, :, :, n:n + T] = v
        else:
            for b, n in enumerate(self.lengths):
                self.k[layer, b, :, n:n + T] = k[b]
                self.v[layer, b, :, n:n + T] = v[b]
        end = max(self.lengths) + T
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, n_new: int) -> None:
        self.lengths = [n + n_new for n in self.lengths]
        self._pending = 0

    def rollback(self, lengths: int | Sequence[int]) -> None:
        """Forget everything past `lengths` (O(1): later writes overwrite the stale slots)."""
        new = [lengths] * self.batch if isinstance(lengths, int) else list(lengths)
        if len(new) != self.batch or any(not 0 <= m <= n for m, n in zip(new, self.lengths)):
            raise ValueError(f"rollback to {new} from {self.lengths}: lengths may only shrink")
        self.lengths = new

    def compact(self, start: int, keep: Sequence[int], b: int = 0) -> None:
        """Move slots `keep` (absolute, increasing, all >= start) of sequence b to start, start+1, ...

        Used after tree verification: the accepted path's K/V become a contiguous prefix and the
        rest of the tree is forgotten.
        """
        if any(j < start or j >= self.lengths[b] for j in keep) or list(keep) != sorted(set(keep)):
            raise ValueError(f"compact: bad keep slots {list(keep)} for start {start}, length {self.lengths[b]}")
        end = start + len(keep)
        if list(keep) != list(range(start, end)):
            idx = torch.as_tensor(keep, device=self.k.device)
            # index_select copies first, so overlapping source and destination slots are safe
            self.k[:, b, :, start:end] = self.k[:, b].index_select(2, idx)
            self.v[:, b, :, start:end] = self.v[:, b].index_select(2, idx)
        self.lengths[b] = end

    def attention_mask(self, new_mask: Tensor | None, n_new: int) -> Tensor | None:
        """Boolean mask (B, 1, T, S) over filled slots plus the T new tokens.

        new_mask (T, T) or (B, T, T): which new tokens each new token sees (a chain when None).
        Returns None when no masking is needed: one new token and equal lengths.
        """
        T, B = n_new, self.batch
        same = len(set(self.lengths)) == 1
        if new_mask is None and T == 1 and same:
            return None
        device = self.k.device
        S = max(self.lengths) + T
        if new_mask is None:
            new_mask = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        new_mask = new_mask.to(device=device, dtype=torch.bool).expand(B, T, T)
        mask = torch.zeros(B, 1, T, S, dtype=torch.bool, device=device)
        for b, n in enumerate(self.lengths):
            mask[b, 0, :, :n] = True
            mask[b, 0, :, n:n + T] = new_mask[b]
        return mask
