"""Prefill and forward passes of one sequence against the target's KV cache.

The cache always holds every committed token except the newest one; each step feeds that token
(the root) plus whatever was proposed after it, then keeps the root and the accepted nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from specdec.engine.kv_cache import KVCache
from specdec.engine.static_step import BUCKETS, StaticStep
from specdec.engine.timing import clock
from specdec.errors import SpecdecError


@dataclass
class ForwardOut:
    logits: Tensor  # (T, V) float32, one row per fed token (prefill: the last token only)
    hidden: Tensor  # (T, dim) final-norm hidden states of the fed tokens


class Engine(Protocol):
    length: int
    max_len: int

    def reset(self) -> None: ...
    def prefill(self, ids: list[int]) -> ForwardOut: ...
    def forward(self, tokens: Tensor, depth: Tensor | None = None, mask: Tensor | None = None) -> ForwardOut: ...
    def rollback(self, length: int) -> None: ...
    def compact(self, start: int, keep: list[int]) -> None: ...


class StaticEngine:
    """Our compact model over a static cache: chains and token trees.

    compile: decode passes of up to BUCKETS[-1] tokens run as `torch.compile`d static-shape steps
    (engine/static_step.py); static: the same static-shape step without compiling (to compare the two).
    Prefill and longer passes stay eager; both write the same cache.
    """

    supports_trees = True

    def __init__(self, model: Any, max_len: int, prefill_chunk: int = 512, compile: bool = False,
                 static: bool = False) -> None:
        self.model = model
        self.max_len = max_len
        self.prefill_chunk = prefill_chunk
        self.device = model.device
        self.static: StaticStep | None = None
        if compile or static:
            if getattr(model, "fused", None) is not None:
                raise SpecdecError("model.compile=true runs the torch path, not the CPU kernels; "
                                   "add model.matmul=torch")
            self.cache: KVCache = model.new_cache(max_len + BUCKETS[-1])  # room for a padded last step
            self.static = StaticStep(model, self.cache, compile=compile)
            if compile:  # every bucket traced now: no decode step, timed or not, pays for compiling
                self.static.warm_up()
        else:
            self.cache = model.new_cache(max_len)
        self._arange = torch.arange(max_len, device=self.device)

    @property
    def length(self) -> int:
        return self.cache.lengths[0]

    def reset(self) -> None:
        self.cache.rollback(0)

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> ForwardOut:
        """Fill the cache with the prompt in chunks; logits for the last prompt token only."""
        if not ids:
            raise SpecdecError("empty prompt: every turn needs at least one token")
        if len(ids) >= self.max_len:
            raise SpecdecError(f"prompt of {len(ids)} tokens does not fit the cache of {self.max_len}; "
                               "shorten the prompt or raise generation.max_len")
        self.reset()
        t = torch.as_tensor(ids, device=self.device)
        hidden = []
        for s in range(0, len(ids), self.prefill_chunk):
            chunk = t[s:s + self.prefill_chunk]
            last = s + len(chunk) == len(ids)
            logits, h = self._run(chunk, self._arange[s:s + len(chunk)], None,
                                  logits_from=len(chunk) - 1 if last else len(chunk))
            hidden.append(h)
        return ForwardOut(logits, torch.cat(hidden))

    @torch.inference_mode()
    def forward(self, tokens: Tensor, depth: Tensor | None = None, mask: Tensor | None = None) -> ForwardOut:
        """Feed tokens (T,) at positions length + depth (a chain when depth is None) under mask (T, T)."""
        n = self.length
        if self.static is not None and len(tokens) <= BUCKETS[-1]:
            if n + len(tokens) > self.max_len:
                raise SpecdecError(f"KV cache overflow: {n + len(tokens)} positions needed but the cache holds "
                                   f"{self.max_len}; shorten the prompt or lower generation.max_new_tokens")
            logits, h = self.static(tokens, depth, mask, n)
            self.cache.advance(len(tokens))
            return ForwardOut(logits, h)
        pos = self._arange[n:n + len(tokens)] if depth is None else n + depth.to(self.device)
        logits, h = self._run(tokens.to(self.device), pos, mask)
        return ForwardOut(logits, h)

    def _run(self, tokens: Tensor, positions: Tensor, mask: Tensor | None,
             logits_from: int = 0) -> tuple[Tensor, Tensor]:
        attn = self.cache.attention_mask(mask, len(tokens))
        logits, h = self.model(tokens[None], positions[None], self.cache, attn, logits_from=logits_from)
        return logits[0].float(), h[0]

    def rollback(self, length: int) -> None:
        self.cache.rollback(length)

    def compact(self, start: int, keep: list[int]) -> None:
        self.cache.compact(start, keep)


class HFEngine:
    """Any transformers causal LM through its own dynamic cache: chains only (no tree masks)."""

    supports_trees = False

    def __init__(self, model: Any, max_len: int, prefill_chunk: int = 512) -> None:
        from transformers import DynamicCache

        self.model = model
        self.max_len = max_len
        self.prefill_chunk = prefill_chunk
        self._cache_cls = DynamicCache
        self.cache = DynamicCache()
        self.length = 0

    @property
    def device(self) -> torch.device:
        return self.model.device

    def reset(self) -> None:
        self.cache = self._cache_cls()
        self.length = 0

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> ForwardOut:
        if len(ids) >= self.max_len:
            raise SpecdecError(f"prompt of {len(ids)} tokens does not fit the cache of {self.max_len}; "
                               "shorten the prompt or raise generation.max_len")
        self.reset()
        t = torch.as_tensor(ids, device=self.device)
        outs = [self.forward(t[s:s + self.prefill_chunk]) for s in range(0, len(ids), self.prefill_chunk)]
        return ForwardOut(outs[-1].logits[-1:], torch.cat([o.hidden for o in outs]))

    @torch.inference_mode()
    def forward(self, tokens: Tensor, depth: Tensor | None = None, mask: Tensor | None = None) -> ForwardOut:
        if mask is not None:
            raise SpecdecError("token trees need the compact Llama-family model; this architecture runs "
                               "through transformers (model.backend=hf), which supports chain strategies only")
        if self.length + len(tokens) > self.max_len:
            raise SpecdecError(f"KV cache overflow: {self.length + len(tokens)} positions needed but the cache "
                               f"holds {self.max_len}; shorten the prompt or lower generation.max_new_tokens")
        out = self.model(tokens[None].to(self.device), past_key_values=self.cache, use_cache=True,
                         output_hidden_states=True)
        self.length += len(tokens)
        return ForwardOut(out.logits[0].float(), out.hidden_states[-1][0])

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"rollback to {length} from {self.length}: lengths may only shrink")
        if length == 0:
            self.reset()
        elif length < self.length:
            # a negative count (tokens to drop) is the only form both transformers 4.x and 5.x accept
            self.cache.crop(length - self.length)
        self.length = length

    def compact(self, start: int, keep: list[int]) -> None:
        if keep != list(range(start, start + len(keep))):
            raise SpecdecError("token trees need the compact Llama-family model (model.backend=compact)")
        self.rollback(start + len(keep))


def pass_cost_curve(engine: Engine, sizes: list[int], context: int = 128, reps: int = 5) -> dict[int, float]:
    """Time of a target pass over each number of new tokens in `sizes`, relative to one token.

    Strategies call this at start-up to decide how much drafting pays on the hardware they run on
    (on a 2-core CPU a pass over 8 tokens costs ~1.5-2x one; on a GPU close to 1x)."""
    times = pass_times(engine, [0] * min(context, engine.max_len - max(sizes) - 1), [1, *sizes], reps)
    return {n: times[n] / times[1] for n in sizes}


def pass_times(engine: Engine, ids: list[int], sizes: list[int], reps: int = 5) -> dict[int, float]:
    """Median seconds of a target pass over each number of new tokens in `sizes`, after `ids` are cached.

    The sizes are timed in interleaved rounds after a single prefill (each pass rolled back): on a
    shared machine whose speed drifts by tens of percent between seconds, timing one size after
    another made the curve zigzag.
    """
    engine.prefill(ids)
    device = getattr(engine, "device", None)
    order = list(dict.fromkeys(sizes))
    samples: dict[int, list[float]] = {n: [] for n in order}
    for n in order:  # warm-up: first calls compile kernels and touch buffers
        engine.forward(torch.zeros(n, dtype=torch.long))
        engine.rollback(len(ids))
    for _ in range(reps):
        for n in order:
            start = clock(device)
            engine.forward(torch.zeros(n, dtype=torch.long))
            samples[n].append(clock(device) - start)
            engine.rollback(len(ids))
    engine.reset()
    return {n: sorted(t)[len(t) // 2] for n, t in samples.items()}
