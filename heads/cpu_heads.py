"""The sequential Medusa heads' per-node work as two compiled calls, for the CPU kernels.

Why: each tree node costs a head call: a residual stack over [x, e(root), e(parent's token)], then the
projection onto the kept vocabulary, its top guesses and their log-sum-exp. Through numpy and torch
that meant torch's topk and logsumexp over 8192 logits, libm's exp in the SiLU and conversions
around the products. Here a block is one call (the row assembled, the product, bias and SiLU in place)
and the projection's top-k with log-probabilities another, with `cpu_kernels.fast_exp`. In the
issue runs the heads' time per step fell (experiments/README.md, "Cheaper tree passes and head calls;
Medusa at 6 nodes").
The products are the same `cpu_kernels` tile kernels, so the features are bitwise what the numpy path
gives; the log-sum-exp is summed in another order (last-bit differences in the scores).
"""

from __future__ import annotations

import numpy as np

from specdec.models import cpu_kernels

if cpu_kernels.available():
    from numba import njit

    from specdec.models.cpu_kernels import fast_exp
    from specdec.models.cpu_kernels import mm_into_nested as mm_into

    @njit(cache=True)
    def residual_block(x, e_root, e_prev, panels, bias, tiles):  # pragma: no cover - compiled
        """x + SiLU(W [x, e_root, e_prev] + b) for x (dim,); e_prev may be empty (head 0 reads no path)."""
        dim = x.shape[0]
        n = dim + e_root.shape[0] + e_prev.shape[0]
        row = np.empty((1, n), dtype=np.float32)
        row[0, :dim] = x
        row[0, dim:dim + e_root.shape[0]] = e_root
        row[0, dim + e_root.shape[0]:] = e_prev
        y = np.empty((1, panels.shape[0] * panels.shape[2]), dtype=np.float32)
        mm_into(row, panels, y, tiles)
        out = np.empty(dim, dtype=np.float32)
        for i in range(dim):
            v = y[0, i] + bias[i]
            out[i] = x[i] + v / (np.float32(1.0) + fast_exp(-v))
        return out

    @njit(cache=True)
    def top_logprobs(x, panels, n_out, tiles, width):  # pragma: no cover - compiled
        """The `width` largest of the logits x @ W^T (n_out,), best first (the lower index on ties), and
        their log-probabilities: (width,) int64 indices, (width,) float32."""
        logits = np.empty((1, panels.shape[0] * panels.shape[2]), dtype=np.float32)
        mm_into(x.reshape(1, x.shape[0]), panels, logits, tiles)
        z = logits[0, :n_out]
        top = np.float32(-np.inf)
        for i in range(n_out):
            top = max(top, z[i])
        total = np.float32(0.0)
        for i in range(n_out):
            total += fast_exp(z[i] - top)
        best = np.full(width, -1, dtype=np.int64)
        vals = np.full(width, np.float32(-np.inf), dtype=np.float32)
        for i in range(n_out):
            v = z[i]
            if v > vals[width - 1]:
                j = width - 1
                while j > 0 and v > vals[j - 1]:
                    vals[j], best[j] = vals[j - 1], best[j - 1]
                    j -= 1
                vals[j], best[j] = v, i
        return best, vals - (top + np.float32(np.log(total)))
