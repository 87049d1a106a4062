"""A whole decoder pass in a single numba call, for CPU fp32 passes over a few tokens.

Why: with the matrix products in `cpu_kernels`, a SmolLM2-135M decode step spent about 24 ms in
the products and another 15 ms in the ~25 small torch ops per layer around them (norms, rope,
cache writes, attention, residuals) and the Python that calls them. Those ops first moved into one
compiled function per layer (`layer_forward`); calling it once per layer from Python still cost about
4 ms of a 23 ms pass, so `FusedStack` now runs every layer and the final norm in one call. The math is
`llama.Block`'s; `tests/test_model.py` checks the two agree. A `llama.PassThroughNorm` in place of a block's
input norm or of the final norm (EAGLE-1's drafter layout) is skipped there too (tests/test_eagle.py).

Up to `FUSED_ROWS` new tokens (decode steps, drafts, token trees, prompt chunks) of one sequence, or
the rows of several sequences of a batched cache at once (`FusedStack.run_segments`: the linears run
once over every row, attention per sequence). A longer pass of one sequence runs as consecutive calls of
FUSED_ROWS rows when its mask lets no row see a later call's token (trees and chains: each row keeps a
one-row pass's bits); other long passes take the torch path (`Block.forward`).

Attention reads K and V as panels the tile kernels multiply by (`KVCache.keep_panels`, kept beside the
plain K/V that the torch path reads): before, a pass over 6 tokens (a 5-node tree) cost 1.13x a one-token
pass after 16 cached tokens and 1.65x after 1024, an extra that grew with attention's work; now 1.1x and
1.2-1.3x (`python experiments/pass_times.py`, experiments/README.md).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from specdec.engine.kv_cache import KVCache
from specdec.models import cpu_kernels
from specdec.models.llama import Block, Llama, PassThroughNorm, RMSNorm

# The most new tokens one fused pass takes; engines prefill in chunks of this many. Prompt chunks, too,
# run faster here than through BLAS over weights unpacked from the panels (experiments/README.md,
# 2026-12-02). The products' own limit for the tile kernels, so that every row of such a pass keeps a
# one-row pass's bits on the module path too.
FUSED_ROWS = cpu_kernels.TILED_ROWS


if cpu_kernels.available():
    from numba import njit, prange

    from specdec.models.cpu_kernels import _call_tile, fast_exp
    from specdec.models.cpu_kernels import mm_into_nested as mm_into


    @njit(fastmath=True, error_model="numpy", cache=True)
    def _rms_norm(x, weight, eps, out):  # pragma: no cover - compiled
        for t in range(x.shape[0]):
            ss = np.float32(0.0)
            for i in range(x.shape[1]):
                ss += x[t, i] * x[t, i]
            scale = np.float32(1.0) / np.sqrt(ss / np.float32(x.shape[1]) + np.float32(eps))
            for i in range(x.shape[1]):
                out[t, i] = weight[i] * (x[t, i] * scale)

    # Every fast-math flag but reassociation: a sum over cache slots must add them in a fixed order
    # whatever their number, or a token's output would depend on how many tokens share its pass.
    _IN_ORDER = {"nnan", "ninf", "nsz", "arcp", "contract", "afn"}
    _MASKED = np.float32(-1e30)  # a finite "minus infinity": fast-math code may assume no infinities
    # Every flag but the approximate ones (arcp, afn) for loops that divide: with them LLVM divides in a
    # vectorised loop body by a reciprocal estimate (vrcpps and a Newton step, on AVX2) and in its scalar
    # copy exactly, and which copy runs can hang on the arrays' addresses (its runtime overlap checks), so
    # a pass's bits varied from run to run on AVX2 hosts (the CI's, 2026-12-04).
    _EXACT_DIV = {"nnan", "ninf", "nsz", "contract", "reassoc"}

    @njit(fastmath=_IN_ORDER, cache=True)
    def _row_sums(x, n, totals):  # pragma: no cover - compiled
        # totals[r] = x[r, 0] + x[r, 1] + ... + x[r, n - 1], added in slot order: zeros anywhere (slots a
        # token may not see, which sit between the visible ones in a tree) leave it bitwise unchanged.
        # The rows' sums run side by side, so the adds of one do not wait on another's.
        for r in range(totals.shape[0]):
            totals[r] = np.float32(0.0)
        for j in range(n):
            for r in range(totals.shape[0]):
                totals[r] += x[r, j]

    # Not cached on disk, nor is layer_forward: both hold parallel loops and are compiled with
    # stack_forward, which is (see cpu_kernels.mm_into_nested).
    @njit(parallel=True, fastmath=_EXACT_DIV, error_model="numpy")
    def _attend(qkv, rope, keys, values, key_panels, value_panels, start, mask, use_mask,  # pragma: no cover
                n_heads, n_kv, head_dim, out, tiles):
        # qkv (T, (H + 2 Hkv) D) rows of new tokens; rope (T, D/2, 2) cos/sin; keys, values (Hkv, S_max, D)
        # and the same as panels (KVCache.keep_panels): key_panels (Hkv, P, D, NB), value_panels
        # (Hkv, Pd, S_max, NB). Rotates q and k (adjacent pairs: llama.py permutes wq/wk at load), writes
        # k, v at slots start..start+T, then out[t, h*D:(h+1)*D] = softmax(q k^T / sqrt(D)) v over the
        # slots mask[t] allows.
        #
        # Why panels: the R queries sharing a K/V head (its group of heads, times the T tokens) then get
        # their scores as one product queries (R, D) @ keys^T and their outputs as one product
        # probabilities (R, S) @ values, both by the fp32 tile kernels (`tiles`), which read each cached
        # key and value once for up to 8 queries and keep 16 sums going at a time. The loops these
        # replaced (a dot product per query and slot, then a weighted sum per query) read every cached
        # key and value once per query: a tree pass's extra over a one-token pass grew with the cache
        # (module docstring).
        # Exactness: each score is one in-order chain over d, each output one in-order chain over the
        # slots, whatever shares the call (tile kernels); masked slots get probability exactly 0; the
        # softmax total is summed in slot order too. So a token's output is bitwise the same in a chain, a
        # tree or alone.
        T = rope.shape[0]
        half = head_dim // 2
        group = n_heads // n_kv
        NB = key_panels.shape[3]
        for t in range(T):
            slot = start + t
            for g in range(n_kv):
                base_k = (n_heads + g) * head_dim
                base_v = (n_heads + n_kv + g) * head_dim
                for i in range(half):
                    c, s = rope[t, i, 0], rope[t, i, 1]
                    a, b = qkv[t, base_k + 2 * i], qkv[t, base_k + 2 * i + 1]
                    k0, k1 = a * c - b * s, a * s + b * c
                    keys[g, slot, 2 * i], keys[g, slot, 2 * i + 1] = k0, k1
                    key_panels[g, slot // NB, 2 * i, slot % NB] = k0
                    key_panels[g, slot // NB, 2 * i + 1, slot % NB] = k1
                for d in range(head_dim):
                    v = qkv[t, base_v + d]
                    values[g, slot, d] = v
                    value_panels[g, d // NB, slot, d % NB] = v
        S = start + T
        P = (S + NB - 1) // NB  # key panels holding slots 0..S-1; the last one's tail is never read
        Pd = value_panels.shape[1]
        R = T * group  # queries per K/V head: query r is token r // group, head g * group + r % group
        scale = np.float32(1.0 / np.sqrt(head_dim))
        queries = np.empty((n_kv, R, head_dim), dtype=np.float32)
        for t in range(T):
            for h in range(n_heads):
                g, r = h // group, t * group + h % group
                for i in range(half):
                    c, s = rope[t, i, 0], rope[t, i, 1]
                    a, b = qkv[t, h * head_dim + 2 * i], qkv[t, h * head_dim + 2 * i + 1]
                    queries[g, r, 2 * i] = (a * c - b * s) * scale
                    queries[g, r, 2 * i + 1] = (a * s + b * c) * scale
        scores = np.empty((n_kv, R, P * NB), dtype=np.float32)  # then the probabilities, unnormalised
        sums = np.empty((n_kv, R, Pd * NB), dtype=np.float32)
        rows = tiles.shape[0]
        f4 = np.int64(4)
        # The kernels get addresses, which numba does not count as uses: an array of this function's own
        # whose last use is taking its address is freed right there (numba deletes a variable after its
        # last use), and the loop's allocations (`totals`) may then reuse and overwrite its memory while the
        # kernels still read it. So queries, scores and sums are each sliced inside the loop, per job, which
        # keeps them alive until the loop ends. (`queries` was freed before the loop: with one numba thread,
        # whose allocations come from the caller's heap, the first `totals` split its freed block and
        # overwrote some queries, and tokens' outputs varied from run to run.) The panels are arguments,
        # alive in the caller.
        kbase, ks = np.int64(key_panels.ctypes.data), np.int64(key_panels.strides[0])
        vbase = np.int64(value_panels.ctypes.data)
        vs0, vs1 = np.int64(value_panels.strides[0]), np.int64(value_panels.strides[1])
        ld_s, ld_u = np.int64(P * NB), np.int64(Pd * NB)
        blocks = (R + rows - 1) // rows
        for job in prange(n_kv * blocks):
            g, r0 = job // blocks, (job % blocks) * rows
            m = min(rows, R - r0)
            qrow = np.int64(queries[g, r0:].ctypes.data)
            srow = np.int64(scores[g, r0:].ctypes.data)
            urow = np.int64(sums[g, r0:].ctypes.data)
            _call_tile(tiles[m - 1], qrow, np.int64(head_dim), kbase + g * ks,
                       srow, ld_s, np.int64(head_dim), np.int64(0), np.int64(P))
            totals = np.empty(m, dtype=np.float32)
            for r in range(r0, r0 + m):
                t = r // group
                p = scores[g, r]
                if use_mask:
                    for j in range(S):
                        p[j] = p[j] if mask[t, j] else _MASKED
                top = _MASKED
                for j in range(S):
                    top = max(top, p[j])
                for j in range(S):  # vectorised: fast_exp is arithmetic; below e^-80 of the top is 0 in fp32 sums
                    z = p[j] - top
                    p[j] = fast_exp(z) if z > np.float32(-80.0) else np.float32(0.0)
            _row_sums(scores[g, r0:r0 + m], S, totals)
            for pd in range(Pd):
                _call_tile(tiles[m - 1], srow, ld_s, vbase + g * vs0 + pd * vs1,
                           urow + f4 * pd * NB, ld_u, np.int64(S), np.int64(0), np.int64(1))
            for r in range(r0, r0 + m):
                t, h = r // group, g * group + r % group
                for d in range(head_dim):
                    out[t, h * head_dim + d] = sums[g, r, d] / totals[r - r0]

    @njit(fastmath=_EXACT_DIV, error_model="numpy", cache=True)
    def _silu_mul(gate_up, hidden, out):  # pragma: no cover - compiled
        for t in range(gate_up.shape[0]):
            for i in range(hidden):
                g = gate_up[t, i]
                out[t, i] = g / (np.float32(1.0) + fast_exp(-g)) * gate_up[t, hidden + i]

    @njit
    def layer_forward(x, rope, keys, values, key_panels, value_panels, segments, mask, use_mask,  # pragma: no cover
                      attn_normed, attn_norm, wqkv, bqkv, bo, wo, mlp_norm, w_gate_up, w_down, eps, n_heads, n_kv,
                      head_dim, hidden, tiles, att_tiles):
        """x (R, dim) -> the layer's output (R, dim). The rows are segments of new tokens of the cache's
        sequences, segments (n_seg, 4) [b, start, r0, n]: rows r0..r0+n-1 are sequence b's, their K/V go to
        its slots start..start+n-1 and they attend over its slots 0..start+n-1 (mask rows r0.., as in _attend).
        keys, values (B, Hkv, S_max, D) and their panels carry the batch axis.
        The four matrices come as `cpu_kernels.pack` panels, all of one type; `tiles` are the addresses of
        the kernels for that type (`cpu_kernels.tiles_for`), `att_tiles` those for float32 (attention's).
        attn_normed False: the attention reads x itself (no input norm, EAGLE-1's first drafter layer)."""
        R, dim = x.shape
        h = np.empty((R, dim), dtype=np.float32)  # a copy either way: h is reused for the MLP's input below
        if attn_normed:
            _rms_norm(x, attn_norm, eps, h)
        else:
            h[:] = x
        qkv = np.empty((R, wqkv.shape[0] * wqkv.shape[2]), dtype=np.float32)  # padded to whole panels
        mm_into(h, wqkv, qkv, tiles)  # every row at once: the weights are read once for all sequences
        for t in range(R):
            for i in range(bqkv.shape[0]):
                qkv[t, i] += bqkv[i]
        att = np.zeros((R, n_heads * head_dim), dtype=np.float32)
        # One sequence at a time: a segment's rows only see (and only write) their own sequence's slots, and
        # _attend gives a row the same bits whatever else shares its call, so alone or batched agree.
        # Without a mask (use_mask False) `mask` is a 1x1 placeholder: its row slices may be empty, never read.
        for s in range(segments.shape[0]):
            b, start, r0, r1 = segments[s, 0], segments[s, 1], segments[s, 2], segments[s, 2] + segments[s, 3]
            _attend(qkv[r0:r1], rope[r0:r1], keys[b], values[b], key_panels[b], value_panels[b], start,
                    mask[r0:r1], use_mask, n_heads, n_kv, head_dim, att[r0:r1], att_tiles)
        o = np.empty((R, wo.shape[0] * wo.shape[2]), dtype=np.float32)
        mm_into(att, wo, o, tiles)
        mid = np.empty((R, dim), dtype=np.float32)
        for t in range(R):
            for i in range(dim):
                mid[t, i] = x[t, i] + (o[t, i] + bo[i])
        _rms_norm(mid, mlp_norm, eps, h)
        gate_up = np.empty((R, w_gate_up.shape[0] * w_gate_up.shape[2]), dtype=np.float32)
        mm_into(h, w_gate_up, gate_up, tiles)
        act = np.empty((R, hidden), dtype=np.float32)
        _silu_mul(gate_up, hidden, act)
        down = np.empty((R, w_down.shape[0] * w_down.shape[2]), dtype=np.float32)
        mm_into(act, w_down, down, tiles)
        for t in range(R):
            for i in range(dim):
                mid[t, i] += down[t, i]
        return mid

    @njit(cache=True)
    def stack_forward(x, rope, keys, values, key_panels, value_panels, segments, mask, use_mask,  # pragma: no cover
                      attn_normed, attn_norms, wqkv, bqkv, bo, wo, mlp_norms, w_gate_up, w_down, final_normed, norm,
                      eps, n_heads, n_kv, head_dim, hidden, tiles, att_tiles):
        """Every layer, then the final norm: x (R, dim) -> final-norm hidden states (R, dim), the rows being
        `segments` of the cache's sequences (layer_forward). Per-layer arrays come stacked on a leading
        layer axis; keys, values (L, B, Hkv, S_max, D) and their panels (KVCache.keep_panels)
        (L, B, Hkv, P, D, NB) and (L, B, Hkv, Pd, S_max, NB). attn_normed (L,) bool: whether layer l
        normalises its input; final_normed False: the last layer's output is returned as it is."""
        for layer in range(attn_norms.shape[0]):
            x = layer_forward(x, rope, keys[layer], values[layer], key_panels[layer], value_panels[layer], segments,
                              mask, use_mask, attn_normed[layer], attn_norms[layer], wqkv[layer], bqkv[layer],
                              bo[layer], wo[layer], mlp_norms[layer], w_gate_up[layer], w_down[layer], eps, n_heads,
                              n_kv, head_dim, hidden, tiles, att_tiles)
        if not final_normed:
            return x  # layer_forward's own array, never the caller's input (L >= 1)
        out = np.empty_like(x)
        _rms_norm(x, norm, eps, out)
        return out


class FusedStack:
    """A Llama's whole pass over a few tokens (its layers and final norm) as one `stack_forward` call.

    Why: calling `layer_forward` once per layer from Python cost about 75 us per layer in argument
    conversion and numba's dispatch (a scratch timing of the draft: 0.22 ms per call from Python against
    0.15 ms inside it); a one-token SmolLM2-135M pass went from 22.9 to 18.8 ms with one call
    (experiments/pass_times.py, experiments/README.md). Stacking the layers' arrays makes that possible.
    The linears' packed panels are views into the stacks (no second copy); norms and biases are
    copied, so build this after the weights are final, as NumbaLinear's packing already is.
    Rope angles come from one table per model, the same for every pass, so a token's numbers still
    do not depend on what shares its pass.
    """

    def __init__(self, model: Llama) -> None:
        blocks: list[Block] = list(model.layers)  # type: ignore[arg-type]
        first = blocks[0]
        self.n_heads, self.n_kv, self.head_dim = first.attn.n_heads, first.attn.n_kv, first.attn.head_dim
        self.hidden, self.eps = first.mlp.hidden_dim, first.attn_norm.eps
        self.attn_norms = np.stack([b.attn_norm.weight.detach().numpy() for b in blocks])  # (L, dim)
        self.attn_normed = np.array([not isinstance(b.attn_norm, PassThroughNorm) for b in blocks])  # (L,) bool
        self.mlp_norms = np.stack([b.mlp_norm.weight.detach().numpy() for b in blocks])
        # zeros where the model has no bias: adding 0 is exact
        self.bqkv = np.stack([_bias(b.attn.wqkv) for b in blocks])  # (L, qkv_out)
        self.bo = np.stack([_bias(b.attn.wo) for b in blocks])  # (L, dim)
        self.wqkv = _stack_panels([b.attn.wqkv for b in blocks])  # (L, P, in, NB)
        self.wo = _stack_panels([b.attn.wo for b in blocks])
        self.w_gate_up = _stack_panels([b.mlp.w_gate_up for b in blocks])
        self.w_down = _stack_panels([b.mlp.w_down for b in blocks])
        self.tiles = cpu_kernels.tiles_for(self.wqkv)
        self.att_tiles = cpu_kernels.kernels().by_kind["fp32"]  # attention's products are fp32 whatever the weights
        self.att_panel = cpu_kernels.kernels().isa.panel  # slots per key panel: the tiles' NB
        self.norm = model.norm.weight.detach().numpy()
        self.norm_eps = model.norm.eps
        self.final_normed = not isinstance(model.norm, PassThroughNorm)
        self._rope = np.empty((0, self.head_dim // 2, 2), dtype=np.float32)

    rows = FUSED_ROWS

    def takes(self, x: Tensor, mask: Tensor | None = None, cache: object = None) -> bool:
        """One sequence's pass (1, T, dim) against a KV cache (a training pass without one takes the torch path):
        up to FUSED_ROWS rows in one call; more, given a mask (1, 1, T, S), as consecutive calls over FUSED_ROWS
        rows each, when no row sees a later call's token (chains, and trees listed parents first), so every row
        keeps a one-row pass's bits."""
        if x.shape[0] != 1 or not isinstance(cache, KVCache):
            return False
        T = x.shape[1]
        if T <= FUSED_ROWS:
            return True
        n = cache.lengths[0]  # cached slots: the new tokens' own start at n
        if mask is None or mask.shape[-1] != n + T:
            return False
        return not any(bool(mask[0, 0, s:s + FUSED_ROWS, n + s + FUSED_ROWS:].any()) for s in range(0, T, FUSED_ROWS))

    def rope(self, model: Llama, positions: np.ndarray) -> np.ndarray:
        """cos/sin (T, D/2, 2) of `positions` (T,), read from a table grown by doubling."""
        need = int(positions.max()) + 1
        if need > len(self._rope):
            size = max(need, 2 * len(self._rope), 256)
            freqs = model.rope(torch.arange(size)[None])  # (1, size, 1, D/2) complex; CPU only
            self._rope = torch.view_as_real(freqs[0, :, 0]).numpy().copy()  # (size, D/2, 2)
        return self._rope[positions]

    def __call__(self, model: Llama, x: Tensor, positions: Tensor, cache: KVCache, mask: Tensor | None,
                 taps: tuple[int, ...] = (), seen: list[Tensor] | None = None) -> Tensor:
        """Final-norm hidden states (1, T, dim) of the layers' input x (1, T, dim); K/V written to the cache
        after sequence 0's cached tokens (its length is the caller's to advance, as Llama.forward does).
        taps: append to `seen` the input of each of these layers (1, T, dim), in layer order."""
        T, n = x.shape[1], cache.lengths[0]
        m = None if mask is None else mask[0, 0].numpy()  # (T, S), S = n + T
        hs: list[Tensor] = []
        found: list[list[Tensor]] = []
        for s in range(0, T, FUSED_ROWS):  # one call unless T > FUSED_ROWS (`takes` checked the mask allows it)
            e = min(T, s + FUSED_ROWS)
            segment = np.array([[0, n + s, 0, e - s]], dtype=np.int64)
            found.append([])
            hs.append(self.run_segments(model, x[0, s:e], positions[0, s:e], cache, segment,
                                        None if m is None else m[s:e, :n + e], taps, found[-1]))
        if seen is not None:
            seen.extend(torch.cat(parts)[None] for parts in zip(*found))
        return torch.cat(hs)[None] if len(hs) > 1 else hs[0][None]

    def run_segments(self, model: Llama, x: Tensor, positions: Tensor, cache: KVCache,
                     segments: np.ndarray, mask: np.ndarray | None, taps: tuple[int, ...] = (),
                     seen: list[Tensor] | None = None) -> Tensor:
        """One pass over new tokens of several of the cache's sequences: the linears run once over all the
        rows (their weights read once), attention per sequence.

        x (R, dim) float32, positions (R,) long (rope's, per row). segments (n_seg, 4) int64
        [b, start, r0, n]: rows r0..r0+n-1 are sequence b's new tokens, at its slots start..start+n-1
        (start = how many it has cached); every row belongs to exactly one segment, in any order of b.
        mask (R, S) bool, S >= every start + n: mask[r, j] whether row r sees slot j of its own sequence;
        None: every row sees all of its sequence's slots up to its segment's end, which is right for one
        new token per segment. Writes each segment's K/V (k, v and the panels) into sequence b's slots;
        cache.lengths stay as they are (the caller advances them). Returns final-norm hidden states (R, dim).
        Sequences with no segment are left bitwise untouched. taps: append to `seen` the input (R, dim) of
        each of these layers; the stack then runs as one call per stretch of layers between taps."""
        R = x.shape[0]
        segments = np.ascontiguousarray(segments, dtype=np.int64)
        _check_segments(segments, R, cache.batch, cache.max_len, mask)
        rope = self.rope(model, positions.numpy())  # (R, D/2, 2)
        use_mask = mask is not None
        m = np.ascontiguousarray(mask, dtype=np.bool_) if use_mask else self._all_visible  # one array type: one compile
        if cache.key_panels is None or cache.value_panels is None:
            cache.keep_panels(self.att_panel)
        h = np.ascontiguousarray(x.detach().numpy())
        k, v, kp, vp = cache.k.numpy(), cache.v.numpy(), cache.key_panels.numpy(), cache.value_panels.numpy()
        L = len(self.attn_norms)
        edges = sorted({0, L, *taps})
        for a, b in zip(edges, edges[1:]):  # layers a..b-1 in one call: slices on the layer axis are views
            if a in taps:
                seen.append(torch.from_numpy(h.copy()))  # type: ignore[union-attr]
            h = stack_forward(
                h, rope, k[a:b], v[a:b], kp[a:b], vp[a:b], segments, m, use_mask, self.attn_normed[a:b],
                self.attn_norms[a:b], self.wqkv[a:b], self.bqkv[a:b], self.bo[a:b], self.wo[a:b],
                self.mlp_norms[a:b], self.w_gate_up[a:b], self.w_down[a:b], self.final_normed and b == L, self.norm,
                self.norm_eps, self.n_heads, self.n_kv, self.head_dim, self.hidden, self.tiles, self.att_tiles)
        return torch.from_numpy(h)

    _all_visible = np.ones((1, 1), dtype=np.bool_)


def _check_segments(segments: np.ndarray, rows: int, batch: int, max_len: int, mask: np.ndarray | None) -> None:
    """Refuse segments the compiled pass would follow out of its arrays (numba checks no bounds)."""
    if segments.ndim != 2 or segments.shape[1] != 4 or not len(segments):
        raise ValueError(f"segments: expected (n_seg, 4) [b, start, r0, n], got shape {segments.shape}")
    b, start, r0, n = segments.T
    order = np.argsort(r0, kind="stable")
    ends = np.cumsum(n[order])
    if ((b < 0) | (b >= batch) | (start < 0) | (n < 1) | (start + n > max_len)).any() \
            or r0[order][0] != 0 or (r0[order][1:] != ends[:-1]).any() or ends[-1] != rows:
        raise ValueError(f"segments {segments.tolist()} do not split {rows} rows among a batch of {batch} "
                         f"sequences of at most {max_len} slots")
    if mask is not None and (mask.ndim != 2 or mask.shape[0] != rows or mask.shape[1] < (start + n).max()):
        raise ValueError(f"mask of shape {mask.shape}: expected ({rows}, >= {(start + n).max()})")


def _stack_panels(linears: list) -> np.ndarray:
    """One (L, ...) array of the linears' packed panels; each linear then reads its view of it.
    Panels packed into one stack already (cpu_linear packs them so) are used as they are; others are
    moved in one at a time, so at most one matrix is held twice."""
    first = linears[0].panels
    stack = first.base
    if (isinstance(stack, np.ndarray) and stack.flags.c_contiguous and stack.dtype == first.dtype
            and stack.shape == (len(linears), *first.shape)
            and all(_address(lin.panels) == _address(stack[layer]) for layer, lin in enumerate(linears))):
        return stack
    stack = np.empty((len(linears), *first.shape), dtype=first.dtype)
    for layer, lin in enumerate(linears):
        stack[layer] = lin.panels
        lin.panels = stack[layer]
        cpu_kernels.release_freed_memory()
    return stack


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def _bias(linear: torch.nn.Module) -> np.ndarray:
    bias = getattr(linear, "bias", None)
    return np.zeros(linear.out_features, dtype=np.float32) if bias is None else bias.detach().numpy()


def use_fused_stacks(model: torch.nn.Module) -> int:
    """Give every Llama below `model` whose layers' linears are all NumbaLinear of one weight type a
    FusedStack (its passes over a few tokens then run as one call); returns how many."""
    count = 0
    for m in model.modules():
        if isinstance(m, Llama) and len(m.layers) and _one_panel_type(m) and _known_norms(m):
            m.fused = FusedStack(m)
            count += 1
    return count


def _one_panel_type(model: Llama) -> bool:
    panels = [getattr(lin, "panels", None) for b in model.layers
              for lin in (b.attn.wqkv, b.attn.wo, b.mlp.w_gate_up, b.mlp.w_down)]
    return all(p is not None for p in panels) and len({p.dtype for p in panels}) == 1


def _known_norms(model: Llama) -> bool:
    """Norms the fused stack computes: RMSNorm everywhere, or PassThroughNorm on block inputs and the output."""
    either = (RMSNorm, PassThroughNorm)
    return all(isinstance(b.attn_norm, either) and isinstance(b.mlp_norm, RMSNorm) for b in model.layers) \
        and isinstance(model.norm, either)


def use_layer_by_layer(model: torch.nn.Module) -> None:
    """Undo use_fused_stacks: every pass runs the layers' own forward."""
    for m in model.modules():
        if isinstance(m, Llama):
            m.fused = None
