"""One decoder layer in a single numba call, for CPU fp32 passes over a few tokens.

Why: with the matrix products in `cpu_kernels`, a SmolLM2-135M decode step spent about 24 ms in
the products and another 15 ms in the ~25 small torch ops per layer around them (norms, rope,
cache writes, attention, residuals) and the Python that calls them. Here those ops run inside one
compiled function per layer. The math is `llama.Block`'s; `tests/test_model.py` checks the two agree.

Batch of one, up to `cpu_kernels.MAX_ROWS` new tokens (decode steps, drafts, token trees); prefill
chunks and batches take the torch path (`Block.forward`), whose large GEMMs BLAS does best.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from specdec.engine.kv_cache import KVCache
from specdec.models import cpu_kernels
from specdec.models.llama import Block

if cpu_kernels.available():
    from numba import njit, prange

    from specdec.models.cpu_kernels import mm_into

    @njit(fastmath=True, cache=True)
    def _rms_norm(x, weight, eps, out):  # pragma: no cover - compiled
        for t in range(x.shape[0]):
            ss = np.float32(0.0)
            for i in range(x.shape[1]):
                ss += x[t, i] * x[t, i]
            scale = np.float32(1.0) / np.sqrt(ss / np.float32(x.shape[1]) + np.float32(eps))
            for i in range(x.shape[1]):
                out[t, i] = weight[i] * (x[t, i] * scale)

    @njit(parallel=True, fastmath=True, cache=True)
    def _attend(qkv, rope, keys, values, start, mask, use_mask, n_heads, n_kv, head_dim, out):  # pragma: no cover
        # qkv (T', (H + 2 Hkv) D) rows of new tokens; rope (T, D/2, 2) cos/sin; keys, values (Hkv, S_max, D).
        # Rotates q and k (adjacent pairs: llama.py permutes wq/wk at load), writes k, v at start..start+T,
        # then out[t, h*D:(h+1)*D] = softmax(q k^T / sqrt(D)) v over the slots mask[t] allows.
        T = rope.shape[0]
        half = head_dim // 2
        group = n_heads // n_kv
        for t in range(T):
            for g in range(n_kv):
                base_k = (n_heads + g) * head_dim
                base_v = (n_heads + n_kv + g) * head_dim
                for i in range(half):
                    c, s = rope[t, i, 0], rope[t, i, 1]
                    a, b = qkv[t, base_k + 2 * i], qkv[t, base_k + 2 * i + 1]
                    keys[g, start + t, 2 * i] = a * c - b * s
                    keys[g, start + t, 2 * i + 1] = a * s + b * c
                for d in range(head_dim):
                    values[g, start + t, d] = qkv[t, base_v + d]
        S = start + T
        scale = np.float32(1.0 / np.sqrt(head_dim))
        for job in prange(T * n_heads):
            t = job // n_heads
            h = job % n_heads
            g = h // group
            q = np.empty(head_dim, dtype=np.float32)
            for i in range(half):
                c, s = rope[t, i, 0], rope[t, i, 1]
                a, b = qkv[t, h * head_dim + 2 * i], qkv[t, h * head_dim + 2 * i + 1]
                q[2 * i] = (a * c - b * s) * scale
                q[2 * i + 1] = (a * s + b * c) * scale
            scores = np.empty(S, dtype=np.float32)
            top = np.float32(-np.inf)
            for j in range(S):
                if use_mask and not mask[t, j]:
                    scores[j] = -np.inf
                    continue
                acc = np.float32(0.0)
                for d in range(head_dim):
                    acc += q[d] * keys[g, j, d]
                scores[j] = acc
                top = max(top, acc)
            acc_v = np.zeros(head_dim, dtype=np.float32)
            total = np.float32(0.0)
            for j in range(S):
                if scores[j] == -np.inf:
                    continue
                p = np.exp(scores[j] - top)
                total += p
                for d in range(head_dim):
                    acc_v[d] += p * values[g, j, d]
            for d in range(head_dim):
                out[t, h * head_dim + d] = acc_v[d] / total

    @njit(fastmath=True, cache=True)
    def _silu_mul(gate_up, hidden, out):  # pragma: no cover - compiled
        for t in range(gate_up.shape[0]):
            for i in range(hidden):
                g = gate_up[t, i]
                out[t, i] = g / (np.float32(1.0) + np.exp(-g)) * gate_up[t, hidden + i]

    @njit(cache=True)
    def layer_forward(x, rope, keys, values, start, mask, use_mask, attn_norm, wqkv, bqkv, bo, wo,  # pragma: no cover
                      mlp_norm, w_gate_up, w_down, eps, n_heads, n_kv, head_dim, hidden):
        """x (T, dim) -> the layer's output (T, dim); K/V of the T tokens written at slots start.."""
        T, dim = x.shape
        rows = T if T == 1 or T % 2 == 0 else T + 1  # the paired matmul tile wants an even count
        h = np.zeros((rows, dim), dtype=np.float32)
        _rms_norm(x, attn_norm, eps, h)
        qkv = np.empty((rows, wqkv.shape[0]), dtype=np.float32)
        mm_into(h, wqkv, qkv)
        for t in range(T):
            for i in range(wqkv.shape[0]):
                qkv[t, i] += bqkv[i]
        att = np.zeros((rows, n_heads * head_dim), dtype=np.float32)
        _attend(qkv, rope, keys, values, start, mask, use_mask, n_heads, n_kv, head_dim, att)
        o = np.empty((rows, dim), dtype=np.float32)
        mm_into(att, wo, o)
        mid = np.empty((T, dim), dtype=np.float32)
        for t in range(T):
            for i in range(dim):
                mid[t, i] = x[t, i] + (o[t, i] + bo[i])
        _rms_norm(mid, mlp_norm, eps, h)
        gate_up = np.empty((rows, w_gate_up.shape[0]), dtype=np.float32)
        mm_into(h, w_gate_up, gate_up)
        act = np.zeros((rows, hidden), dtype=np.float32)
        _silu_mul(gate_up[:T], hidden, act)
        down = np.empty((rows, dim), dtype=np.float32)
        mm_into(act, w_down, down)
        for t in range(T):
            for i in range(dim):
                mid[t, i] += down[t, i]
        return mid


class FusedBlock(Block):
    """A `Block` whose passes over a few tokens run as one `layer_forward` call (see the module doc).

    Made by changing the class of a loaded Block whose linears are NumbaLinear (`use_fused_blocks`),
    so parameters and state-dict names stay those of the Block.
    """

    def forward(self, x: Tensor, freqs: Tensor, cache: KVCache, mask: Tensor | None) -> Tensor:
        B, T, dim = x.shape
        if B != 1 or T > cpu_kernels.MAX_ROWS:
            return super().forward(x, freqs, cache, mask)
        attn, mlp = self.attn, self.mlp
        k_all, v_all = cache.k.numpy(), cache.v.numpy()  # (L, B, Hkv, S_max, D) views, written in place
        rope = torch.view_as_real(freqs[0, :, 0]).numpy()  # (T, D/2, 2)
        no_mask = mask is None
        m = self._all_visible if no_mask else mask[0, 0].numpy()  # (T, S)
        out = layer_forward(
            x[0].numpy(), rope, k_all[attn.layer, 0], v_all[attn.layer, 0], cache.lengths[0], m, not no_mask,
            self.attn_norm.weight.numpy(), attn.wqkv.weight_np, *self._biases(), attn.wo.weight_np,
            self.mlp_norm.weight.numpy(), mlp.w_gate_up.weight_np, mlp.w_down.weight_np,
            self.attn_norm.eps, attn.n_heads, attn.n_kv, attn.head_dim, mlp.hidden_dim)
        return torch.from_numpy(out)[None]  # (1, T, dim)

    def _biases(self) -> tuple[np.ndarray, np.ndarray]:
        """qkv and output-projection biases as arrays, zeros where the model has none (adding 0 is exact)."""
        if getattr(self, "_np_biases", None) is None:
            self._np_biases = tuple(
                np.zeros(lin.out_features, dtype=np.float32) if lin.bias is None else lin.bias.numpy()
                for lin in (self.attn.wqkv, self.attn.wo))
        return self._np_biases

    _all_visible = np.ones((1, 1), dtype=np.bool_)


def use_fused_blocks(model: torch.nn.Module) -> int:
    """Turn every Block below `model` into a FusedBlock (its linears must already be NumbaLinear)."""
    blocks = [m for m in model.modules() if type(m) is Block]
    for block in blocks:
        block.__class__ = FusedBlock
    return len(blocks)


def use_plain_blocks(model: torch.nn.Module) -> None:
    for m in model.modules():
        if type(m) is FusedBlock:
            m.__class__ = Block
