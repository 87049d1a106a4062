"""Numba kernels for y = x @ W^T with few rows of x (decode steps, drafts, token trees) on CPU.

Why not BLAS: OpenBLAS and MKL are tuned for large GEMMs. For 2 to 8 rows they pack the weight
matrix before multiplying, so a verification pass over a few tokens streams the weights about twice
and costs 1.6-1.9x a one-token step, which eats most of what speculation saves. These kernels read
each weight row once, straight from its (out, in) row-major storage, and reuse it from L1 for every
row of x. Measured on an AMD EPYC of this project's 2-core machines (SmolLM2-135M's 120 layer
matrices, 0.45 GB, interleaved repeats): one row 18-19 ms (OpenBLAS GEMV 22 ms), 4 rows 19-23 ms
(OpenBLAS 48), 8 rows 28-33 ms (OpenBLAS 38), 16 rows 48-60 ms (OpenBLAS 61). Two layouts serve
several rows and the CPU decides between them at load (`pick_layout`).

Each output element is one dot product over `in` computed by the same four-sum loop whatever the
number of rows and the layout, so a row's result does not depend on which other rows share the call.
"""

from __future__ import annotations

import os
import time

import numpy as np

try:
    import numba
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.extending import intrinsic
except ImportError:  # numba is a dependency, but a missing one only costs speed (matmul=auto falls back)
    numba = None

# Above this many rows BLAS's packed GEMM (compute-bound, prefill) is faster than these kernels.
MAX_ROWS = 24


def available() -> bool:
    return numba is not None


if numba is not None:
    f32 = np.float32

    @intrinsic
    def _f32_from_bits(typingctx, i):  # pragma: no cover - compiled
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.FloatType())
        return types.float32(types.int32), codegen

    @njit(fastmath=True, cache=True)
    def fast_exp(x):  # pragma: no cover - compiled
        """exp of a float32, relative error < 2e-7, as plain arithmetic so that loops over it vectorise.

        numba's np.exp calls libm one element at a time (~5 ns; this LLVM has no SVML): that was
        most of the cost of attention's softmax and the MLP's SiLU. Here exp(x) = 2^n e^r with
        n = round(x / ln 2), |r| <= ln(2) / 2 (ln 2 split in two for an exact n ln 2), e^r by its
        degree-7 series, and 2^n built from its exponent bits. Inputs are clamped to [-87, 88].
        """
        x = min(max(x, f32(-87.0)), f32(88.0))
        n = np.floor(x * f32(1.4426950408889634) + f32(0.5))
        r = x - n * f32(0.693145751953125) - n * f32(1.428606765330187e-06)
        p = f32(1.0) + r * (f32(1.0) + r * (f32(0.5) + r * (f32(1.0 / 6) + r * (f32(1.0 / 24) + r * (
            f32(1.0 / 120) + r * (f32(1.0 / 720) + r * f32(1.0 / 5040)))))))
        return p * _f32_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))

    # Every kernel below keeps exactly four sums in its inner loop. LLVM shapes a vectorised dot product
    # (how many vector accumulators, how the tail is added) by the kernel's register pressure, and the
    # shape decides the rounding: with four sums in every kernel, a row's dot products come out bitwise
    # the same whichever kernel computes them (tests/test_model.py checks), so a token's logits do not
    # depend on how many tokens share its pass, which lossless speculation relies on.

    @njit(parallel=True, fastmath=True, cache=True)
    def _rows_each(x, w, y):  # pragma: no cover - compiled
        # Any number of rows. Weight rows four at a time (a ragged last block repeats row N - 1: the
        # compiler cannot know that, so it keeps four sums, and the block writes only the rows it owns);
        # each row of x passes over the block in turn, the first pass streaming it from memory and the
        # others reading it from L1. A one-row call runs the same loop.
        M, K = x.shape
        N = w.shape[0]
        last = N - 1
        for b in prange((N + 3) // 4):
            n = b * 4
            n1, n2, n3 = min(n + 1, last), min(n + 2, last), min(n + 3, last)
            for m in range(M):
                a0 = f32(0.0); a1 = f32(0.0); a2 = f32(0.0); a3 = f32(0.0)  # noqa: E702
                for k in range(K):
                    v = x[m, k]
                    a0 += v * w[n, k]; a1 += v * w[n1, k]; a2 += v * w[n2, k]; a3 += v * w[n3, k]  # noqa: E702
                y[m, n] = a0
                if n + 3 < N:
                    y[m, n1] = a1; y[m, n2] = a2; y[m, n3] = a3  # noqa: E702
                elif n + 2 < N:
                    y[m, n1] = a1; y[m, n2] = a2  # noqa: E702
                elif n + 1 < N:
                    y[m, n1] = a1

    @njit(parallel=True, fastmath=True, cache=True)
    def _rows_shared(x, w, y):  # pragma: no cover - compiled
        # M a multiple of 4. Each block of four weight rows is streamed once; every group of four rows
        # of x then passes over it in L1, one weight row at a time, so each weight element loaded serves
        # four rows of x.
        M, K = x.shape
        N = w.shape[0]
        for b in prange((N + 3) // 4):
            for m in range(0, M, 4):
                for n in range(b * 4, min(b * 4 + 4, N)):
                    a0 = f32(0.0); a1 = f32(0.0); a2 = f32(0.0); a3 = f32(0.0)  # noqa: E702
                    for k in range(K):
                        v = w[n, k]
                        a0 += x[m, k] * v; a1 += x[m + 1, k] * v; a2 += x[m + 2, k] * v; a3 += x[m + 3, k] * v  # noqa: E702
                    y[m, n] = a0; y[m + 1, n] = a1; y[m + 2, n] = a2; y[m + 3, n] = a3  # noqa: E702

    @njit(fastmath=True, cache=True)
    def mm_into(x, w, y, shared):  # pragma: no cover - compiled
        """y (M, N) = x (M, K) @ w (N, K)^T. `shared` (see `pick_layout`): M must be 1 or a multiple
        of 4 (`kernel_rows`); otherwise any M."""
        if x.shape[0] == 1 or not shared:
            _rows_each(x, w, y)
        elif x.shape[0] % 4:
            raise ValueError("the shared layout takes 1 or a multiple of 4 rows; pad with cpu_kernels.kernel_rows")
        else:
            _rows_shared(x, w, y)


# Which multi-row kernel runs: "shared" (each weight element loaded serves four rows of x; x padded to
# a multiple of 4 rows) or "each" (each row of x runs the one-row loop over a block of weight rows held
# in L1; no padding). Which is faster depends on the CPU, so `pick_layout` times both on the model's
# own matrices. `python -m specdec.bench` on SmolLM2-135M: on an AMD EPYC (AVX2), with the shared layout,
# a pass over 2 tokens cost 1.04x one token and over 4 1.07x (experiments/bench); on an Intel Xeon with
# AVX-512, with each layout pinned, 2 tokens 1.39x shared against 1.15x each, 4 tokens 1.43x against
# 1.29x (experiments/bench_intel_*).
LAYOUTS = ("shared", "each")
_layout: str | None = None


def layout() -> str:
    """The multi-row kernel in use ("shared" until `pick_layout` or `set_layout` says otherwise)."""
    return _layout or "shared"


def set_layout(name: str) -> None:
    global _layout
    if name not in LAYOUTS:
        raise ValueError(f"unknown kernel layout {name!r}; use one of {LAYOUTS}")
    _layout = name


def kernel_rows(rows: int) -> int:
    """Rows `mm_into` takes for `rows` rows of x under the current layout (zero rows added)."""
    return rows if rows == 1 or layout() == "each" else (rows + 3) // 4 * 4


def pick_layout(weights: list[np.ndarray], reps: int = 3) -> str:
    """Time both layouts on `weights` (the model's own matrices) at 2, 3 and 4 rows, in interleaved
    rounds, keep the faster in total and return its name. Once per process: the answer is the CPU's.
    The environment variable SPECDEC_KERNEL_LAYOUT=shared|each skips the timing and uses that one."""
    if _layout is not None:
        return _layout
    forced = os.environ.get("SPECDEC_KERNEL_LAYOUT")
    if forced:  # to compare the layouts on one machine, or to pin one for a series of runs
        if forced not in LAYOUTS:
            from specdec.errors import SpecdecError

            raise SpecdecError(f"SPECDEC_KERNEL_LAYOUT={forced!r} is not a kernel layout; use one of "
                               f"{', '.join(LAYOUTS)}, or unset it to let the CPU pick")
        set_layout(forced)
        return forced
    rng = np.random.default_rng(0)
    xs = {(m, w.shape[1]): rng.standard_normal((m, w.shape[1])).astype(np.float32)
          for m in (2, 3, 4) for w in weights}
    totals = {name: [] for name in LAYOUTS}
    for r in range(reps + 1):  # the first round compiles and warms up
        for name in LAYOUTS:
            set_layout(name)
            start = time.perf_counter()
            for m in (2, 3, 4):
                for w in weights:
                    matmul_wt(xs[m, w.shape[1]], w)
            if r:
                totals[name].append(time.perf_counter() - start)
    best = min(LAYOUTS, key=lambda n: sorted(totals[n])[len(totals[n]) // 2])
    set_layout(best)
    return best


def matmul_wt(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (M, K) float32 C-contiguous, w (N, K) float32 C-contiguous -> x @ w.T, (M, N)."""
    rows = x.shape[0]
    if rows > MAX_ROWS:
        return x @ w.T  # BLAS GEMM with a transposed operand: no copy of w
    shared = layout() == "shared"
    pad = kernel_rows(rows) - rows
    padded = np.concatenate([x, np.zeros((pad, x.shape[1]), dtype=np.float32)]) if pad else x
    y = np.empty((padded.shape[0], w.shape[0]), dtype=np.float32)
    mm_into(padded, w, y, shared)
    return y[:rows]

