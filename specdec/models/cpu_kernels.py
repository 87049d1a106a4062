"""Numba kernels for y = x @ W^T with few rows of x (decode steps, drafts, token trees) on CPU.

Why not BLAS: OpenBLAS and MKL are tuned for large GEMMs. For 2 to 8 rows they pack the weight
matrix before multiplying, so a verification pass over a few tokens streams the weights about twice
and costs 1.6-1.9x a one-token step, which eats most of what speculation saves. These kernels read
each weight row once, straight from its (out, in) row-major storage, and reuse it from L1 for every
row of x. Measured on this project's 2-core machines (SmolLM2-135M's matrices, 0.45 GB):
one row 17 ms (26 GB/s, OpenBLAS GEMV 22 ms), 4 rows 24 ms (OpenBLAS 48), 8 rows 29 ms (OpenBLAS 38).

Each output element is one dot product over `in`, summed in the same order whatever the number of
rows, so a row's result does not depend on which other rows share the call.
"""

from __future__ import annotations

import numpy as np

try:
    import numba
    from numba import njit, prange
except ImportError:  # numba is a dependency, but a missing one only costs speed (matmul=auto falls back)
    numba = None

# Above this many rows BLAS's packed GEMM (compute-bound, prefill) is faster than these kernels.
MAX_ROWS = 24


def available() -> bool:
    return numba is not None


if numba is not None:
    f32 = np.float32

    @njit(parallel=True, fastmath=True, cache=True)
    def _one_row(x, w, y):  # pragma: no cover - compiled
        # x (1, K) against weight rows 8 at a time: eight independent sums in flight
        K = x.shape[1]
        for b in prange(w.shape[0] // 8):
            n = b * 8
            a0 = f32(0.0); a1 = f32(0.0); a2 = f32(0.0); a3 = f32(0.0)  # noqa: E702
            a4 = f32(0.0); a5 = f32(0.0); a6 = f32(0.0); a7 = f32(0.0)  # noqa: E702
            for k in range(K):
                v = x[0, k]
                a0 += v * w[n, k]; a1 += v * w[n + 1, k]; a2 += v * w[n + 2, k]; a3 += v * w[n + 3, k]  # noqa: E702
                a4 += v * w[n + 4, k]; a5 += v * w[n + 5, k]; a6 += v * w[n + 6, k]; a7 += v * w[n + 7, k]  # noqa: E702
            y[0, n] = a0; y[0, n + 1] = a1; y[0, n + 2] = a2; y[0, n + 3] = a3  # noqa: E702
            y[0, n + 4] = a4; y[0, n + 5] = a5; y[0, n + 6] = a6; y[0, n + 7] = a7  # noqa: E702

    @njit(parallel=True, fastmath=True, cache=True)
    def _row_pairs(x, w, y):  # pragma: no cover - compiled
        # x (M, K), M even, against weight rows 4 at a time: each weight element loaded once per row pair,
        # the 4 rows staying in L1 while every pair passes over them
        M, K = x.shape
        for b in prange(w.shape[0] // 8 * 2):
            n = b * 4
            for m in range(0, M, 2):
                a0 = f32(0.0); a1 = f32(0.0); a2 = f32(0.0); a3 = f32(0.0)  # noqa: E702
                b0 = f32(0.0); b1 = f32(0.0); b2 = f32(0.0); b3 = f32(0.0)  # noqa: E702
                for k in range(K):
                    u = x[m, k]
                    v = x[m + 1, k]
                    w0 = w[n, k]; w1 = w[n + 1, k]; w2 = w[n + 2, k]; w3 = w[n + 3, k]  # noqa: E702
                    a0 += u * w0; a1 += u * w1; a2 += u * w2; a3 += u * w3  # noqa: E702
                    b0 += v * w0; b1 += v * w1; b2 += v * w2; b3 += v * w3  # noqa: E702
                y[m, n] = a0; y[m, n + 1] = a1; y[m, n + 2] = a2; y[m, n + 3] = a3  # noqa: E702
                y[m + 1, n] = b0; y[m + 1, n + 1] = b1; y[m + 1, n + 2] = b2; y[m + 1, n + 3] = b3  # noqa: E702

    @njit(fastmath=True, cache=True)
    def mm_into(x, w, y):  # pragma: no cover - compiled
        """y (M, N) = x (M, K) @ w (N, K)^T for M == 1 or M even (callers pad odd M with a zero row).

        Every output is one vectorised dot product over K whichever loop computes it (checked by
        tests/test_model.py), so a row's result does not depend on the other rows in the call.
        """
        M = x.shape[0]
        N = w.shape[0]
        if M == 1:
            _one_row(x, w, y)
        else:
            _row_pairs(x, w, y)
        for n in range(N - N % 8, N):  # the ragged end, the same way for any M
            for m in range(M):
                a = f32(0.0)
                for k in range(x.shape[1]):
                    a += x[m, k] * w[n, k]
                y[m, n] = a


def matmul_wt(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (M, K) float32 C-contiguous, w (N, K) float32 C-contiguous -> x @ w.T, (M, N)."""
    rows = x.shape[0]
    if rows > MAX_ROWS:
        return x @ w.T  # BLAS GEMM with a transposed operand: no copy of w
    padded = x if rows == 1 or rows % 2 == 0 else np.concatenate([x, np.zeros((1, x.shape[1]), dtype=np.float32)])
    y = np.empty((padded.shape[0], w.shape[0]), dtype=np.float32)
    mm_into(padded, w, y)
    return y[:rows]

