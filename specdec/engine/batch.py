"""Several sequences (slots) over one static KV cache, each with its own length.

One `step` feeds any slots' new tokens in a single target pass: on the CPU kernels the rows of every
slot go through each weight matrix together (the weights are read once for the batch) and attend
each over its own slot's cache (`FusedStack.run_segments`); on the torch path (CUDA) the slots'
rows are padded to a common count, and the padded rows are masked so that no real token sees them.
Slots advance, roll back and compact on their own: acceptance is ragged.

The model may also read a feature vector beside each token (an EAGLE-style drafter, `reads_features`):
then every feed carries its rows' features and the layers' input is the model's `pair_input`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from specdec.engine.engine import ForwardOut, fused_chunk
from specdec.engine.kv_cache import KVCache
from specdec.errors import SpecdecError

PAD_ROOM = 64  # the most rows a padded (torch-path) pass gives each slot


@dataclass
class Feed:
    """New tokens for one slot in a batched pass.

    tokens (T,) long; depth (T,) position offsets after the slot's length (None: a chain, 0..T-1);
    mask (T, T) bool, which new tokens each new token sees (None: a chain); logits_from: logits are
    computed for rows logits_from..T-1 only (T: none, as for a prompt chunk that is not the last);
    features (T, D): what a feature-reading model takes beside each token (None for any other model).
    """

    tokens: Tensor
    depth: Tensor | None = None
    mask: Tensor | None = None
    logits_from: int = 0
    features: Tensor | None = None


def slot_view(cache: KVCache, b: int) -> KVCache:
    """Sequence b of `cache` as a batch-1 cache sharing its storage (writes land in the batch)."""
    view = KVCache.__new__(KVCache)
    view.k, view.v = cache.k[:, b:b + 1], cache.v[:, b:b + 1]
    view.key_panels = None if cache.key_panels is None else cache.key_panels[:, b:b + 1]
    view.value_panels = None if cache.value_panels is None else cache.value_panels[:, b:b + 1]
    view.max_len, view.lengths, view._pending = cache.max_len, [cache.lengths[b]], 0
    return view


class BatchEngine:
    """The compact model over a cache of `batch` slots (the batched counterpart of StaticEngine)."""

    supports_trees = True

    def __init__(self, model: torch.nn.Module, batch: int, max_len: int, prefill_chunk: int = 512) -> None:
        self.model = model
        self.batch, self.max_len, self.prefill_chunk = batch, max_len, fused_chunk(model, prefill_chunk)
        self.device = model.device
        # PAD_ROOM slots past max_len: a padded row of a slot near its end (torch path) lands there
        self.cache: KVCache = model.new_cache(max_len + PAD_ROOM, batch)
        self.fused = getattr(model, "fused", None)
        # width of the features read beside each token (an EAGLE-style drafter); None: tokens only
        self.features: int | None = model.args.dim if getattr(model, "reads_features", False) else None
        if self.fused is not None:  # the panels the kernels' attention reads, for every slot at once
            self.cache.keep_panels(self.fused.att_panel)

    def length(self, b: int) -> int:
        return self.cache.lengths[b]

    def rollback(self, b: int, length: int) -> None:
        if not 0 <= length <= self.cache.lengths[b]:
            raise ValueError(f"rollback of slot {b} to {length} from {self.cache.lengths[b]}: lengths may only shrink")
        self.cache.lengths[b] = length

    def compact(self, b: int, start: int, keep: list[int]) -> None:
        self.cache.compact(start, keep, b)

    @torch.inference_mode()
    def prefill(self, b: int, ids: list[int], start: int = 0, features: Tensor | None = None) -> ForwardOut:
        """Feed ids[start:] to slot b after its first `start` cached tokens (0: a new prompt; more: the
        prefix it already holds), alone, in chunks; logits for the last token only, hidden (P - start, D).
        features (P - start, D): their rows, for a feature-reading model."""
        if start >= len(ids):
            raise SpecdecError("empty prompt: every turn needs at least one token")
        if len(ids) >= self.max_len:
            raise SpecdecError(f"prompt of {len(ids)} tokens does not fit the cache of {self.max_len}; "
                               "shorten the prompt or raise generation.max_len")
        self.rollback(b, start)
        t = torch.as_tensor(ids, device=self.device)
        hidden, logits = [], None
        for s in range(start, len(ids), self.prefill_chunk):
            chunk = t[s:s + self.prefill_chunk]
            last = s + len(chunk) == len(ids)
            rows = None if features is None else features[s - start:s - start + len(chunk)]
            out = self.step({b: Feed(chunk, logits_from=len(chunk) - 1 if last else len(chunk), features=rows)})[b]
            hidden.append(out.hidden)
            logits = out.logits if last else logits
        assert logits is not None
        return ForwardOut(logits, torch.cat(hidden))

    @torch.inference_mode()
    def step(self, feeds: dict[int, Feed]) -> dict[int, ForwardOut]:
        """One target pass over every fed slot's new tokens; each slot's length advances by its count."""
        for b, f in feeds.items():
            if (f.features is None) != (self.features is None):
                raise ValueError(f"slot {b}: a feed carries features exactly when the model reads them")
            if self.cache.lengths[b] + len(f.tokens) > self.max_len:
                raise SpecdecError(f"KV cache overflow: {self.cache.lengths[b] + len(f.tokens)} positions needed "
                                   f"but a slot holds {self.max_len}; shorten the prompt or lower "
                                   "generation.max_new_tokens")
        alone = next(iter(feeds.values())).tokens[None]  # (1, T): what `takes` reads of a single feed
        if self.fused is not None and (len(feeds) > 1 or self.fused.takes(alone, None, self.cache)):
            return self._step_fused(feeds)
        if len(feeds) == 1:  # alone (a prompt chunk; on the CPU kernels, a feed past FUSED_ROWS)
            return self._step_alone(*feeds.items())
        if max(len(f.tokens) for f in feeds.values()) > PAD_ROOM:  # rows past the room: one slot at a time
            return {b: out for item in feeds.items() for b, out in self._step_alone(item).items()}
        return self._step_padded(feeds)

    def _call(self, tokens: Tensor, features: Tensor | None, positions: Tensor, cache: KVCache,
              mask: Tensor | None, logits_from: int = 0) -> tuple[Tensor, Tensor]:
        """The model's own pass over (B, T) tokens (and (B, T, D) features if it reads them)."""
        lead = (tokens,) if features is None else (tokens, features.to(self.device))
        return self.model(*lead, positions, cache, mask, logits_from=logits_from)

    def _positions(self, b: int, f: Feed) -> Tensor:
        n, T = self.cache.lengths[b], len(f.tokens)
        depth = torch.arange(T, device=self.device) if f.depth is None else f.depth.to(self.device)
        return n + depth

    def _outputs(self, feeds: dict[int, Feed], rows: dict[int, slice], h: Tensor) -> dict[int, ForwardOut]:
        """Logits of the wanted rows of h (R, D) in one product, split back per slot."""
        want = [torch.arange(r.start + f.logits_from, r.stop) for (b, f), r in zip(feeds.items(), rows.values())]
        picked = torch.cat(want)
        wanted = h[picked.to(h.device)]  # (R', D)
        # the model's own head split (Llama.head): a token's logits are bitwise those of a batch-1 pass
        logits = self.model.head(wanted[None])[0].float() if len(wanted) else h.new_zeros(0, 0)
        out, at = {}, 0
        for b, r, w in zip(feeds, rows.values(), want):
            out[b] = ForwardOut(logits[at:at + len(w)], h[r])
            at += len(w)
        return out

    def _step_fused(self, feeds: dict[int, Feed]) -> dict[int, ForwardOut]:
        lengths = self.cache.lengths
        segments = np.empty((len(feeds), 4), dtype=np.int64)  # [slot, start, first row, rows]
        rows: dict[int, slice] = {}
        r = 0
        for i, (b, f) in enumerate(feeds.items()):
            segments[i] = (b, lengths[b], r, len(f.tokens))
            rows[b] = slice(r, r + len(f.tokens))
            r += len(f.tokens)
        mask = None
        if r > len(feeds):  # some slot feeds several tokens: each row's visible slots of its own sequence
            S = max(lengths[b] + len(f.tokens) for b, f in feeds.items())
            mask = np.zeros((r, S), dtype=np.bool_)
            for b, f in feeds.items():
                n, T, rs = lengths[b], len(f.tokens), rows[b]
                mask[rs, :n] = True
                mask[rs, n:n + T] = np.tril(np.ones((T, T), dtype=np.bool_)) if f.mask is None else f.mask.cpu().numpy()
        tokens = torch.cat([f.tokens.to(self.device) for f in feeds.values()])  # (R,)
        positions = torch.cat([self._positions(b, f) for b, f in feeds.items()])  # (R,)
        x = (self.model.embed(tokens) if self.features is None  # (R, D), the layers' input
             else self.model.pair_input(tokens, torch.cat([f.features for f in feeds.values()])))  # type: ignore[misc]
        h = self.fused.run_segments(self.model, x, positions, self.cache, segments, mask)
        for b, f in feeds.items():
            lengths[b] += len(f.tokens)
        return self._outputs(feeds, rows, h)

    def _step_alone(self, item: tuple[int, Feed]) -> dict[int, ForwardOut]:
        b, f = item
        view = slot_view(self.cache, b)
        T = len(f.tokens)
        new = None if f.mask is None else f.mask.to(self.device)
        attn = view.attention_mask(new, T)
        feats = None if f.features is None else f.features[None]
        logits, h = self._call(f.tokens.to(self.device)[None], feats, self._positions(b, f)[None], view, attn,
                               logits_from=min(f.logits_from, T))
        self.cache.lengths[b] = view.lengths[0]
        return {b: ForwardOut(logits[0].float(), h[0])}

    def _step_padded(self, feeds: dict[int, Feed]) -> dict[int, ForwardOut]:
        """The torch path: every slot's rows padded to the longest feed. A padded row (and a slot not fed)
        sees only itself and is never seen by a real token; its K/V land past the slot's length, where the
        next real write overwrites them."""
        B, lengths = self.batch, list(self.cache.lengths)
        Tm = max(len(f.tokens) for f in feeds.values())
        dev = self.device
        tokens = torch.zeros(B, Tm, dtype=torch.long, device=dev)
        positions = torch.tensor(lengths, device=dev)[:, None] + torch.arange(Tm, device=dev)  # (B, Tm)
        new = torch.eye(Tm, dtype=torch.bool, device=dev).repeat(B, 1, 1)  # (B, Tm, Tm)
        feats = None if self.features is None else torch.zeros(B, Tm, self.features, device=dev)  # (B, Tm, D)
        for b, f in feeds.items():
            T = len(f.tokens)
            tokens[b, :T] = f.tokens.to(dev)
            if feats is not None and f.features is not None:
                feats[b, :T] = f.features.to(dev)
            positions[b, :T] = self._positions(b, f)
            new[b, :T, :T] = torch.ones(T, T, dtype=torch.bool, device=dev).tril() if f.mask is None else f.mask.to(dev)
        logits, h = self._call(tokens, feats, positions, self.cache, self.cache.attention_mask(new, Tm))
        self.cache.lengths = [n + (len(feeds[b].tokens) if b in feeds else 0) for b, n in enumerate(lengths)]
        return {b: ForwardOut(logits[b, f.logits_from:len(f.tokens)].float(), h[b, :len(f.tokens)])
                for b, f in feeds.items()}



def batch_pass_times(engine: BatchEngine, sizes: list[int], context: int = 128, reps: int = 5) -> dict[int, float]:
    """Median seconds of a pass in which every slot feeds n new tokens, for each n in `sizes`, after
    `context` cached tokens per slot; timed in interleaved rounds (see `engine.pass_times` for why)."""
    from specdec.engine.timing import clock

    ctx = min(context, engine.max_len - max(sizes) - 1)

    def features(n: int) -> Tensor | None:  # zero features for a model that reads them: only the time counts
        return None if engine.features is None else torch.zeros(n, engine.features)

    for b in range(engine.batch):
        engine.prefill(b, [0] * ctx, features=features(ctx))
    order = list(dict.fromkeys(sizes))
    samples: dict[int, list[float]] = {n: [] for n in order}
    zeros = {n: torch.zeros(n, dtype=torch.long) for n in order}
    rows = {n: features(n) for n in order}
    for rep in range(reps + 1):  # the first round warms up
        for n in order:
            start = clock(engine.device)
            engine.step({b: Feed(zeros[n], features=rows[n]) for b in range(engine.batch)})
            if rep:
                samples[n].append(clock(engine.device) - start)
            for b in range(engine.batch):
                engine.rollback(b, ctx)
    for b in range(engine.batch):
        engine.rollback(b, 0)
    return {n: sorted(t)[len(t) // 2] for n, t in samples.items()}


def batch_pass_cost_curve(engine: BatchEngine, sizes: list[int], context: int = 128, reps: int = 5) -> dict[int, float]:
    """Time of a pass in which every slot feeds n new tokens, for each n in `sizes`, relative to every
    slot feeding one: what drafting n - 1 tokens costs at this batch size (on a CPU the curve rises
    with the batch, since B slots' rows already fill the products; on a GPU it stays near 1 for longer)."""
    times = batch_pass_times(engine, [1, *sizes], context, reps)
    return {n: times[n] / times[1] for n in sizes}
