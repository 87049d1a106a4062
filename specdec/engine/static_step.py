"""A compiled, static-shape target step: what lets a GPU decode without launch and host overhead.

Eager decoding slices the cache with host integers, so every step has new shapes and pays one
kernel launch per op. Here every step has one of a few shapes: the new tokens are padded to a
bucket (1, 2, 4, ..., 64), their K/V are written in place at slots held in a device tensor, and
attention runs over the whole cache under a mask built on the device. `torch.compile` then traces
one graph per bucket; with `mode="reduce-overhead"` on CUDA each replays as a CUDA graph.

Padding is harmless: padded tokens sit after the real ones, no real token's mask admits them, and
their K/V land in slots past the committed length, which the next step overwrites. The cache keeps
`BUCKETS[-1]` spare slots so that a padded step never writes past its end.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from specdec.engine.kv_cache import KVCache

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket(n: int) -> int:
    """The smallest bucket holding n tokens (n <= BUCKETS[-1])."""
    return next(b for b in BUCKETS if b >= n)


def compile_mode(device: torch.device) -> str | None:
    """CUDA graphs on a GPU (each bucket's graph replayed with one launch); inductor's default elsewhere."""
    return "reduce-overhead" if device.type == "cuda" else None


class CacheView:
    """K/V buffers (L, B, H_kv, S, D) as the static-shape layers write and read them. Made inside the
    compiled step from its tensor inputs, so that one compiled function serves every cache of a model."""

    def __init__(self, k: Tensor, v: Tensor) -> None:
        self.k, self.v = k, v

    def write_at(self, layer: int, k: Tensor, v: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
        # index the whole buffer, not a layer's view of it: a write through a view is functionalised
        # into a copy of the entire cache, a write into the graph input itself is done in place
        at = [torch.tensor([layer], device=slots.device), None, None, slots]
        torch.ops.aten.index_put_(self.k, at, k.permute(2, 0, 1, 3))  # values (T, B, H_kv, D)
        torch.ops.aten.index_put_(self.v, at, v.permute(2, 0, 1, 3))
        return self.k[layer], self.v[layer]


def allow_many_graphs() -> None:
    """One traced graph per bucket and cache size, for the target and each drafter (and per heads object),
    all of one function: dynamo's default of 8 per function would silently drop the rest back to eager."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 128)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 1024)


def compiled_step(model: torch.nn.Module, compile: bool,
                  taps: tuple[int, ...] = ()) -> Callable[..., tuple[Tensor, Tensor]]:
    """model.forward_static over (tokens, positions, slots, tree, k, v), compiled once per model and taps
    (kept on it): every engine and strategy over the same model replays the same graphs."""
    key = ("_static_step_compiled" if compile else "_static_step_eager") + (f"_taps{list(taps)}" if taps else "")
    fn = model.__dict__.get(key)
    if fn is None:
        tapped = {"taps": taps} if taps else {}  # Llama.forward_static: the tapped layers' inputs too

        def step(tokens: Tensor, positions: Tensor, slots: Tensor, tree: Tensor, k: Tensor, v: Tensor,
                 *extra: Tensor) -> tuple[Tensor, Tensor]:
            return model.forward_static(tokens, positions, slots, tree, CacheView(k, v), *extra,  # type: ignore[operator]
                                        **tapped)

        device = next(model.parameters()).device
        allow_many_graphs()
        fn = torch.compile(step, mode=compile_mode(device), fullgraph=True, dynamic=False) if compile else step
        model.__dict__[key] = fn
    return fn


class StaticStep:
    """Runs `model.forward_static` (or any function of its signature) at bucketed, static shapes.

    `__call__(tokens, depth, mask, length)` takes what `StaticEngine.forward` takes plus the number of
    cached tokens, and returns logits (T, V) and hidden states (T, dim) for the T real tokens.
    `features` (T, dim): the per-token inputs of a feature drafter (heads.eagle.EagleNet), padded too.
    `taps`: the model's tapped layers (Llama.forward_static), returned after the hidden states in their rows.
    """

    def __init__(self, model: torch.nn.Module, cache: KVCache, compile: bool = True,
                 taps: tuple[int, ...] = ()) -> None:
        self.cache = cache
        self.device = cache.k.device
        self.size = cache.k.shape[3]
        if compile and self.device.type == "cuda":
            # cudagraphs may only mutate inputs whose address never changes: the cache's buffers
            torch._dynamo.mark_static_address(cache.k)
            torch._dynamo.mark_static_address(cache.v)
        self.step = compiled_step(model, compile, taps)
        self.compiled = compile
        self._arange = torch.arange(self.size, device=self.device)
        with torch.inference_mode():  # as the masks a tree step builds: guards tell inference tensors apart
            self._tril = {b: torch.ones(b, b, dtype=torch.bool, device=self.device).tril() for b in BUCKETS}

    @torch.inference_mode()  # grad mode is part of what a compiled graph is guarded on
    def __call__(self, tokens: Tensor, depth: Tensor | None, mask: Tensor | None,
                 length: int, features: Tensor | None = None) -> tuple[Tensor, Tensor]:
        T = len(tokens)
        B = bucket(T)
        toks = torch.nn.functional.pad(tokens.to(self.device), (0, B - T))  # (B,)
        slots = self._arange[length:length + B].clone()  # (B,) on the device: no host-to-device copy
        if depth is None:
            positions = slots
        else:  # padded tokens take the positions after the block's; nothing sees them
            positions = torch.cat([length + depth.to(self.device), slots[T:]])
        if mask is None:
            tree = self._tril[B]
        else:
            tree = self._tril[B] & torch.eye(B, dtype=torch.bool, device=self.device)
            tree[:T, :T] = mask.to(self.device, torch.bool)
        extra = () if features is None else (torch.nn.functional.pad(features, (0, 0, 0, B - T))[None],)
        logits, hidden = self.step(toks[None], positions[None], slots, tree, self.cache.k, self.cache.v, *extra)
        # cudagraph outputs live in buffers the next replay overwrites; keep copies of the real rows
        return logits[0, :T].float().clone(), hidden[0, :T].clone()

    def warm_up(self, sizes: tuple[int, ...] = BUCKETS, features: Tensor | None = None) -> None:
        """Trace (and capture) every bucket now, so that no decode step pays for compilation.
        Writes only past the committed length, which stays as it was. features (dim,): a feature
        drafter's input row, repeated for every token."""
        length = self.cache.lengths[0]
        for b in sizes:
            if length + b <= self.size:
                extra = None if features is None else features.expand(b, -1)
                self(torch.zeros(b, dtype=torch.long, device=self.device), None, None, length, extra)
