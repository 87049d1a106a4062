"""Prefill and forward passes of one sequence against the target's KV cache.

The cache always holds every committed token except the newest one; each step feeds that token
(the root) plus whatever was proposed after it, then keeps the root and the accepted nodes.

Prefix reuse (`prefix_cache`, generation.prefix_cache): an engine also remembers which token each
cache slot holds (`HeldTokens`), so the next prefill (a conversation's next turn) keeps the longest
prefix the new prompt shares with the cache and feeds only the rest.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from specdec.engine.kv_cache import KVCache
from specdec.engine.sampling import host_read
from specdec.engine.static_step import BUCKETS, StaticStep
from specdec.engine.timing import clock
from specdec.errors import SpecdecError
from specdec.models.cpu_drafter import DrafterPass
from specdec.models.cpu_layer import FUSED_ROWS


@dataclass
class ForwardOut:
    logits: Tensor  # (T, V) float32, one row per fed token (prefill: the last token only)
    hidden: Tensor  # (T, dim) final-norm hidden states of the fed tokens
    # (T, n dim) the residual stream entering each tapped layer, concatenated in layer order; only from an
    # engine asked for taps (`use_taps`, an EAGLE-3 drafter's features), else None
    taps: Tensor | None = None


class Engine(Protocol):
    length: int
    max_len: int
    held: HeldTokens | None  # what the cache holds, slot by slot, when prefix reuse is on
    prefilled: int  # tokens the last prefill fed (the rest of its prompt was reused)

    def reuse_prefix(self, on: bool) -> None: ...
    def use_taps(self, layers: tuple[int, ...]) -> None: ...
    def reset(self) -> None: ...
    def prefill(self, ids: list[int]) -> ForwardOut: ...
    def forward(self, tokens: Tensor, depth: Tensor | None = None, mask: Tensor | None = None) -> ForwardOut: ...
    def next_logits(self, tokens: Tensor) -> Tensor: ...
    def rollback(self, length: int) -> None: ...
    def compact(self, start: int, keep: list[int]) -> None: ...


def fused_chunk(model: Any, prefill_chunk: int) -> int:
    """Prompt tokens per prefill pass: on the CPU kernels at most what one fused pass takes."""
    if getattr(model, "fused", None) is None:
        return prefill_chunk
    from specdec.models.cpu_layer import FUSED_ROWS

    return min(prefill_chunk, FUSED_ROWS)


class HeldTokens:
    """The token id and final-norm hidden state in each slot of an engine's cache, on its device.

    Written by every pass at the slots it fills and moved by `compact` like the K/V; slots past the
    engine's length are stale, so rollback and reset need nothing here. Device writes only: the host
    reads the ids once per prefill (`shared_prefix`), never per decode step.
    """

    def __init__(self, slots: int, device: torch.device | str) -> None:
        self.ids = torch.full((slots,), -1, dtype=torch.long, device=device)  # (S,)
        self.hidden: Tensor | None = None  # (S, D), allocated by the first write (dtype and D from it)
        self.taps: Tensor | None = None  # (S, n D) likewise, when the engine taps layers

    def write(self, at: int, tokens: Tensor, hidden: Tensor, taps: Tensor | None = None) -> None:
        """tokens (T,) and their hidden states (T, D) (and taps (T, n D)), fed at slots at.. ."""
        if self.hidden is None:
            self.hidden = self._buffer(hidden)
        if taps is not None and self.taps is None:
            self.taps = self._buffer(taps)
        self.ids[at:at + len(tokens)] = tokens
        self.hidden[at:at + len(tokens)] = hidden
        if taps is not None:
            self.taps[at:at + len(tokens)] = taps  # type: ignore[index]

    def _buffer(self, like: Tensor) -> Tensor:
        # a normal tensor even when first written under inference mode, so that a compaction outside
        # it (tests, tools) may update it in place, like the K/V buffers
        with torch.inference_mode(False):
            return torch.empty(len(self.ids), like.shape[-1], dtype=like.dtype, device=like.device)

    def compact(self, start: int, keep: list[int]) -> None:
        """As KVCache.compact: slots `keep` (increasing, >= start) move to start, start + 1, ..."""
        if keep == list(range(start, start + len(keep))):
            return
        idx = torch.as_tensor(keep, device=self.ids.device)
        end = start + len(keep)
        self.ids[start:end] = self.ids.index_select(0, idx)  # index_select copies: overlaps are safe
        if self.hidden is not None:
            self.hidden[start:end] = self.hidden.index_select(0, idx)
        if self.taps is not None:
            self.taps[start:end] = self.taps.index_select(0, idx)

    @host_read
    def shared_prefix(self, length: int, ids: list[int]) -> int:
        """How many leading ids the first `length` slots already hold (one read of one integer)."""
        n = min(length, len(ids))
        if n == 0:
            return 0
        differs = self.ids[:n] != torch.as_tensor(ids[:n], device=self.ids.device)  # (n,)
        # the first mismatch, or n when there is none (argmax gives the first maximum)
        return int(torch.cat([differs, differs.new_ones(1)]).to(torch.uint8).argmax())

    def prompt_hidden(self, n: int) -> Tensor:
        """(n, D) hidden states of slots 0..n-1, copied: later passes overwrite the buffer."""
        assert self.hidden is not None
        return self.hidden[:n].clone()

    def prompt_taps(self, n: int) -> Tensor | None:
        """(n, n_taps D) taps of slots 0..n-1, copied; None when the engine taps nothing."""
        return None if self.taps is None else self.taps[:n].clone()


class StaticEngine:
    """Our compact model over a static cache: chains and token trees.

    compile: decode passes of up to BUCKETS[-1] tokens run as `torch.compile`d static-shape steps
    (engine/static_step.py); static: the same static-shape step without compiling (to compare the two).
    Prefill and longer passes stay eager; both write the same cache.
    """

    supports_trees = True

    def __init__(self, model: Any, max_len: int, prefill_chunk: int = 512, compile: bool = False,
                 static: bool = False, prefix_cache: bool = False) -> None:
        self.model = model
        self.max_len = max_len
        self.prefill_chunk = fused_chunk(model, prefill_chunk)
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
        self._kernel: DrafterPass | None = None
        self._kernel_of: object = None  # the fused stack `_kernel` was decided for
        self.held: HeldTokens | None = None
        self.prefilled = 0
        self.taps: tuple[int, ...] = ()
        self.reuse_prefix(prefix_cache)

    @property
    def length(self) -> int:
        return self.cache.lengths[0]

    def use_taps(self, layers: tuple[int, ...]) -> None:
        """From now on every pass also returns `ForwardOut.taps`: the residual stream entering each of
        `layers` (indices into the model's layers), concatenated in layer order. Off unless asked for, so
        other strategies pay nothing; the cache starts empty (what it held was computed without taps)."""
        self.taps = tuple(sorted(layers))
        if self.static is not None:  # its own graphs: the taps leave the step with the hidden states
            self.static = StaticStep(self.model, self.cache, compile=self.static.compiled, taps=self.taps)
            if self.static.compiled:
                self.static.warm_up()
        self.reuse_prefix(self.held is not None)

    def reuse_prefix(self, on: bool) -> None:
        """Prefix reuse on or off; the cache starts empty either way (what it held was not tracked)."""
        self.held = HeldTokens(self.cache.max_len, self.device) if on else None
        self.reset()

    def reset(self) -> None:
        self.cache.rollback(0)

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> ForwardOut:
        """Fill the cache with the prompt in chunks; logits for the last prompt token only, hidden states
        of every prompt token. With prefix reuse only the part after what the cache shares is fed."""
        _check_prompt(ids, self.max_len)
        start = _reuse_point(self, ids)
        self.rollback(start)
        t = torch.as_tensor(ids, device=self.device)
        hidden, taps = [], []
        for s in range(start, len(ids), self.prefill_chunk):
            chunk = t[s:s + self.prefill_chunk]
            last = s + len(chunk) == len(ids)
            out = self._run(chunk, self._arange[s:s + len(chunk)], None,
                            logits_from=len(chunk) - 1 if last else len(chunk))
            hidden.append(out.hidden)
            taps.append(out.taps)
        self.prefilled = len(ids) - start
        if self.held is not None:
            return ForwardOut(out.logits, self.held.prompt_hidden(len(ids)), self.held.prompt_taps(len(ids)))
        return ForwardOut(out.logits, torch.cat(hidden), torch.cat(taps) if self.taps else None)

    @torch.inference_mode()
    def forward(self, tokens: Tensor, depth: Tensor | None = None, mask: Tensor | None = None) -> ForwardOut:
        """Feed tokens (T,) at positions length + depth (a chain when depth is None) under mask (T, T)."""
        n = self.length
        tokens = tokens.to(self.device)
        if self.static is not None and len(tokens) <= BUCKETS[-1]:
            if n + len(tokens) > self.max_len:
                raise SpecdecError(f"KV cache overflow: {n + len(tokens)} positions needed but the cache holds "
                                   f"{self.max_len}; shorten the prompt or lower generation.max_new_tokens")
            logits, h = self.static(tokens, depth, mask, n)
            self.cache.advance(len(tokens))
            taps = None
            if self.taps:  # the tapped layers' inputs follow the hidden states in each row
                h, taps = h.split([self.model.args.dim, len(self.taps) * self.model.args.dim], -1)
            if self.held is not None:
                self.held.write(n, tokens, h, taps)
            return ForwardOut(logits, h, taps)
        pos = self._arange[n:n + len(tokens)] if depth is None else n + depth.to(self.device)
        return self._run(tokens, pos, mask)

    @torch.inference_mode()
    def next_logits(self, tokens: Tensor) -> Tensor:
        """Feed a chain of tokens (T,) like `forward` and return the last one's logits (V,) alone: what a
        drafter reads. A model the CPU kernels run whole (models/cpu_drafter.py) does it as one compiled call,
        bitwise `forward(tokens).logits[-1]`, without the other rows' head products."""
        kernel = self._drafter_pass()
        if kernel is None or self.taps or len(tokens) > FUSED_ROWS:
            return self.forward(tokens).logits[-1]
        n = self.length
        logits, h = kernel(tokens.numpy(), None, self.cache)
        if self.held is not None:
            self.held.write(n, tokens, h)
        return logits[-1]

    def _drafter_pass(self) -> DrafterPass | None:
        fused = getattr(self.model, "fused", None)
        if self.static is not None or fused is None:
            return None
        if self._kernel_of is not fused:  # checked and built once per fused stack, not per step
            self._kernel = DrafterPass(self.model) if DrafterPass.fits(self.model) else None
            self._kernel_of = fused
        return self._kernel

    def _run(self, tokens: Tensor, positions: Tensor, mask: Tensor | None, logits_from: int = 0) -> ForwardOut:
        n = self.length
        attn = self.cache.attention_mask(mask, len(tokens))
        taps = None
        if self.taps:
            logits, h, taps = self.model.forward_tapped(tokens[None], positions[None], self.cache, attn, logits_from,
                                                        self.taps)
            taps = taps[0]
        else:
            logits, h = self.model(tokens[None], positions[None], self.cache, attn, logits_from=logits_from)
        if self.held is not None:
            self.held.write(n, tokens, h[0], taps)
        return ForwardOut(logits[0].float(), h[0], taps)

    def rollback(self, length: int) -> None:
        self.cache.rollback(length)

    def compact(self, start: int, keep: list[int]) -> None:
        self.cache.compact(start, keep)
        if self.held is not None:
            self.held.compact(start, keep)


class HFEngine:
    """Any transformers causal LM through its own dynamic cache: chains only (no tree masks)."""

    supports_trees = False

    def __init__(self, model: Any, max_len: int, prefill_chunk: int = 512, prefix_cache: bool = False) -> None:
        from transformers import DynamicCache

        self.model = model
        self.max_len = max_len
        self.prefill_chunk = prefill_chunk
        self._cache_cls = DynamicCache
        self.cache = DynamicCache()
        self.length = 0
        self.held: HeldTokens | None = None
        self.prefilled = 0
        self.taps: tuple[int, ...] = ()
        self.reuse_prefix(prefix_cache)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def use_taps(self, layers: tuple[int, ...]) -> None:
        """As StaticEngine.use_taps: transformers' hidden_states[i] is the input of layer i."""
        self.taps = tuple(sorted(layers))
        self.reuse_prefix(self.held is not None)

    def reuse_prefix(self, on: bool) -> None:
        """Prefix reuse on or off; the cache starts empty either way (what it held was not tracked)."""
        self.held = HeldTokens(self.max_len, self.device) if on else None
        self.reset()

    def reset(self) -> None:
        self.cache = self._cache_cls()
        self.length = 0

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> ForwardOut:
        _check_prompt(ids, self.max_len)
        start = _reuse_point(self, ids)
        self.rollback(start)  # a DynamicCache crops to any length: what it keeps is still valid
        t = torch.as_tensor(ids, device=self.device)
        outs = [self.forward(t[s:s + self.prefill_chunk]) for s in range(start, len(ids), self.prefill_chunk)]
        self.prefilled = len(ids) - start
        if self.held is not None:
            return ForwardOut(outs[-1].logits[-1:], self.held.prompt_hidden(len(ids)), self.held.prompt_taps(len(ids)))
        taps = torch.cat([o.taps for o in outs]) if self.taps else None  # type: ignore[misc]
        return ForwardOut(outs[-1].logits[-1:], torch.cat([o.hidden for o in outs]), taps)

    @torch.inference_mode()
    def forward(self, tokens: Tensor, depth: Tensor | None = None, mask: Tensor | None = None) -> ForwardOut:
        if mask is not None:
            raise SpecdecError("token trees need the compact Llama-family model; this architecture runs "
                               "through transformers (model.backend=hf), which supports chain strategies only")
        if self.length + len(tokens) > self.max_len:
            raise SpecdecError(f"KV cache overflow: {self.length + len(tokens)} positions needed but the cache "
                               f"holds {self.max_len}; shorten the prompt or lower generation.max_new_tokens")
        tokens = tokens.to(self.device)
        out = self.model(tokens[None], past_key_values=self.cache, use_cache=True, output_hidden_states=True)
        hidden = out.hidden_states[-1][0]  # (T, D)
        taps = torch.cat([out.hidden_states[i][0] for i in self.taps], -1) if self.taps else None
        if self.held is not None:
            self.held.write(self.length, tokens, hidden, taps)
        self.length += len(tokens)
        return ForwardOut(out.logits[0].float(), hidden, taps)

    def next_logits(self, tokens: Tensor) -> Tensor:
        return self.forward(tokens).logits[-1]

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


def _check_prompt(ids: list[int], max_len: int) -> None:
    if not ids:
        raise SpecdecError("empty prompt: every turn needs at least one token")
    if len(ids) >= max_len:
        raise SpecdecError(f"prompt of {len(ids)} tokens does not fit the cache of {max_len}; "
                           "shorten the prompt or raise generation.max_len")


def _reuse_point(engine: StaticEngine | HFEngine, ids: list[int]) -> int:
    """Where a prefill of ids starts feeding: after the prefix the cache already holds (0 without reuse),
    at most len(ids) - 1, since the last prompt token must be fed for its logits."""
    if engine.held is None:
        return 0
    return engine.held.shared_prefix(engine.length, ids[:-1])


# model -> {(engine kind, context): curve over 1..n}: one measurement per process, shared by every strategy
_CURVES: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], dict[int, float]]] = weakref.WeakKeyDictionary()
SHARED_SIZES = 16  # the shared curve covers at least 2..16 new tokens, so most strategies' first ask fills it


def pass_cost_curve(engine: Engine, sizes: list[int], context: int = 128, reps: int = 9,
                    fresh: bool = False) -> dict[int, float]:
    """Time of a target pass over each number of new tokens in `sizes`, relative to one token.

    Strategies call this at start-up to decide how much drafting pays on the hardware they run on
    (on a CPU a pass costs more the more tokens it feeds; on a GPU it is nearly flat). The curve is
    measured once per model and kind of engine in a process and shared: strategies compared in one run
    size their drafts from the same measurement, so its noise (tens of percent on a shared CPU) does not
    differ between them. A request past the measured sizes measures the whole curve again.
    `fresh`: measure now and share nothing (to study that noise)."""
    if fresh:
        order = list(dict.fromkeys([1, *sizes]))
        times = pass_times(engine, [0] * min(context, engine.max_len - max(sizes) - 1), order, reps)
        return {n: times[n] / times[1] for n in sizes}
    static = getattr(engine, "static", None)  # the compiled step, the CPU kernels and torch's matmuls cost differently
    kind = (type(engine).__name__, None if static is None else bool(getattr(static, "compiled", False)),
            getattr(engine.model, "fused", None) is not None, context)
    curves = _CURVES.setdefault(engine.model, {})
    have = curves.get(kind, {})
    if not all(n in have for n in sizes):
        top = max(max(sizes), max(have, default=0), SHARED_SIZES)
        top = max(max(sizes), min(top, engine.max_len - 2))  # a short cache caps what is measured ahead
        have = curves[kind] = pass_cost_curve(engine, list(range(1, top + 1)), context, reps, fresh=True)
    return {n: have[n] for n in sizes}


def measured_curves(model: Any) -> dict[str, dict[str, float]]:
    """The pass-cost curves this process measured for `model` (the shared ones of `pass_cost_curve`), for
    the run's record: "<engine>, <how it ran>, <context> cached" -> {"n": a pass over n new tokens in
    one-token passes}. What every cost-sized strategy of the run sized its drafts from."""
    out: dict[str, dict[str, float]] = {}
    for (engine, compiled, fused, context), curve in _CURVES.get(model, {}).items():
        how = "compiled" if compiled else "CPU kernels" if fused else "eager"
        out[f"{engine}, {how}, {context} cached"] = {str(n): round(c, 3) for n, c in sorted(curve.items())}
    return out


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
