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
        self.key_panels: Tensor | None = None  # see keep_panels
        self.value_panels: Tensor | None = None

    def keep_panels(self, panel: int) -> tuple[Tensor, Tensor]:
        """Also keep K and V as the weights of small matrix products, for the CPU kernels' attention
        (cpu_layer._attend), and keep them current from here on (`write`, `compact`, and those kernels):
        key_panels (L, B, H_kv, P, D, panel), slot j's key at [..., j // panel, :, j % panel], so a query
        block's scores are one product with keys in runs of `panel` slots; value_panels
        (L, B, H_kv, Pd, T_max, panel), slot j's value dims d at [..., d // panel, j, d % panel].
        Both are filled now from what is cached."""
        L, B, H, S, D = self.k.shape
        P, Pd = -(-S // panel), -(-D // panel)
        # normal tensors like k and v, even when first asked for under inference mode, so that whoever
        # updates k and v in place (compact, outside inference mode in tests) may update these too
        with torch.inference_mode(False):
            keys = torch.zeros(L, B, H, P * panel, D, dtype=self.k.dtype, device=self.k.device)
            keys[:, :, :, :S] = self.k
            self.key_panels = keys.view(L, B, H, P, panel, D).transpose(-1, -2).contiguous()
            self.value_panels = torch.zeros(L, B, H, Pd, S, panel, dtype=self.v.dtype, device=self.v.device)
            self._put_value_panels(slice(None), slice(None), slice(None), self.v)
        return self.key_panels, self.value_panels

    def _put_panels(self, layer: int | slice, b: int | slice, slots: slice, k: Tensor, v: Tensor) -> None:
        # k, v (..., H_kv, T, D) for the slots `slots` of sequence(s) b
        kp = self.key_panels[layer, b]  # type: ignore[index]
        nb = kp.shape[-1]
        idx = torch.arange(slots.start, slots.stop, device=k.device)
        kp[..., idx // nb, :, idx % nb] = k.movedim(-2, 0)  # advanced indices split by a slice go first
        self._put_value_panels(layer, b, slots, v)

    def _put_value_panels(self, layer: int | slice, b: int | slice, slots: slice, v: Tensor) -> None:
        vp = self.value_panels[layer, b]  # type: ignore[index]  # (..., H_kv, Pd, T_max, nb)
        pd, nb = vp.shape[-3], vp.shape[-1]
        padded = torch.nn.functional.pad(v, (0, pd * nb - v.shape[-1]))  # (..., H_kv, T, Pd nb)
        vp[..., slots, :] = padded.unflatten(-1, (pd, nb)).movedim(-2, -3)

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
            if self.key_panels is not None:
                self._put_panels(layer, slice(None), slice(n, n + T), k, v)
        else:
            for b, n in enumerate(self.lengths):
                self.k[layer, b, :, n:n + T] = k[b]
                self.v[layer, b, :, n:n + T] = v[b]
                if self.key_panels is not None:
                    self._put_panels(layer, b, slice(n, n + T), k[b], v[b])
        end = max(self.lengths) + T
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def write_at(self, layer: int, k: Tensor, v: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
        """Static-shape write: K/V (B, H_kv, T, D) into slots (T,) (a device tensor), in place; returns
        K/V over every slot (B, H_kv, T_max, D). Lengths are the caller's to advance."""
        self.k[layer].index_copy_(2, slots, k)
        self.v[layer].index_copy_(2, slots, v)
        return self.k[layer], self.v[layer]

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
            if self.key_panels is not None:
                self._put_panels(slice(None), b, slice(start, end), self.k[:, b, :, start:end],
                                 self.v[:, b, :, start:end])
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
