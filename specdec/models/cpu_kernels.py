"""CPU kernels for y = x @ W^T with few rows of x (decode steps, drafts, token trees), and a fast exp.

Why not BLAS: OpenBLAS and MKL are tuned for large GEMMs. For 2 to 8 rows they pack the weight
matrix on every call, so a verification pass over a few tokens streams the weights about twice and
costs 1.6-1.9x a one-token step, which eats most of what speculation saves.

Here W is packed once, at load, into panels: panel p holds output columns p*NB..p*NB+NB-1 as a
(K, NB) row-major block, so one pass over a panel streams contiguous memory. A small kernel written in
LLVM IR (compiled for this CPU by llvmlite, which numba already needs) keeps a tile of up to 8 rows x NB
outputs in vector registers (4 rows where there are only 16 of them): each step over k loads NB weights
once, broadcasts x[m, k] and does one fused multiply-add per row, and prefetches the panel a few KB
ahead, so that the extra rows' arithmetic hides under the weight stream instead of adding to it. The
kernels before (a dot product per output, numba-vectorised over k) made a 4-token pass cost 1.07x (AMD
EPYC) to 1.29x (Intel Xeon) a one-token pass; `python -m specdec.bench` gives the current curve.

Drafters may keep their panels as bfloat16 (`pack(..., kind="bf16")`): half the bytes to stream, each
weight widened exactly to float32 in registers, so a draft step costs ~0.7x (the target stays float32).
Or as int8 with a float32 scale per output column (`kind="int8"`): a quarter of the bytes; the
kernel sums x * q exactly as floats and multiplies by the column's scale once, at the store.

The panels are the only copy of W a model keeps (NumbaLinear; a tied embedding reads its rows from the
output head's): passes over more than MAX_ROWS rows (prefill) run BLAS over W unpacked into a reused
buffer (`matmul_panels`), bitwise the GEMM over a dense W.

Exactness: every output is the chain y = fma(x[m, k], W[n, k], y) for k = 0, 1, ... in order (int8: then
one multiply by the column's scale), in every kernel, whatever the number of rows, the vector width or
the panel. So a row's result is bitwise the
same whichever rows share the call (tests/test_model.py checks), which lossless speculation relies
on: a token's logits do not depend on how many tokens share its pass.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

try:
    import llvmlite.binding as llvm
    import numba
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.extending import intrinsic
except ImportError:  # numba is a dependency, but a missing one only costs speed (matmul=auto falls back)
    numba = None

# Above this many rows BLAS's packed GEMM (compute-bound, prefill) is faster than these kernels.
MAX_ROWS = 24
PREFETCH_BYTES = 4096  # prefetch distance ahead of the loads (a scratch sweep of 1-16 KB on a Xeon)
KINDS = ("fp32", "bf16", "int8")  # weight types the kernels read
SCALE_ROWS = 4  # an int8 panel (K + 4, NB) ends with its NB float32 column scales, as 4 rows of bytes


def available() -> bool:
    return numba is not None


@dataclass(frozen=True)
class Isa:
    """What the tile kernels are compiled for: `width` floats per vector, `vectors` per panel row (NB =
    width x vectors output columns), tiles of up to `rows` rows of x, and the CPU to tune for."""

    width: int
    vectors: int
    rows: int
    cpu: str
    features: str

    @property
    def panel(self) -> int:  # NB
        return self.width * self.vectors


@functools.cache
def host_isa() -> Isa:
    """This CPU's widest float vectors: 16 lanes with AVX-512, 8 with AVX, else 4; two per panel row.
    A tile holds rows x 2 accumulators plus 2 weight vectors and a broadcast in registers: up to 8 rows
    with 32 vector registers (AVX-512, NEON), 4 with AVX2's 16."""
    try:
        features = llvm.get_host_cpu_features()
    except RuntimeError:  # LLVM cannot list this host's features: generic code for its CPU name
        return Isa(4, 2, 8, llvm.get_host_cpu_name(), "")
    if features.get("avx512f"):
        width, rows = 16, 8
    elif features.get("avx"):
        width, rows = 8, 4
    else:
        width, rows = 4, 8
    return Isa(width, 2, rows, llvm.get_host_cpu_name(), features.flatten())


def tile_ir(rows: int, isa: Isa, kind: str = "fp32", prefetch: int = PREFETCH_BYTES) -> str:
    """LLVM IR of `tile{rows}(x, ldx, panels, y, ldy, K, p0, p1)`: y[m, p*NB:(p+1)*NB] = x[m] @ panel p
    for m < rows and panels p0..p1-1. The accumulators are SSA values, so LLVM keeps them in registers.

    `kind="bf16"`: `tile{rows}_bf16` reads panels of bfloat16 weights (the top half of a float32's bits),
    half the bytes to stream, and widens each to float32 exactly (a shift) before the same fma chain.
    `kind="int8"`: `tile{rows}_int8` reads int8 weights (exact as floats), a quarter of the bytes, and
    multiplies each finished sum by its column's scale, stored after the panel's K rows.
    `prefetch`: how many bytes ahead of its loads the kernel prefetches."""
    W, V, NB = isa.width, isa.vectors, isa.panel
    vt = f"<{W} x float>"
    et, esize = {"fp32": ("float", 4), "bf16": ("i16", 2), "int8": ("i8", 1)}[kind]
    acc = [(m, j) for m in range(rows) for j in range(V)]
    body = [
        f"define void @{tile_name(rows, kind)}(ptr noalias readonly %x, i64 %ldx, ptr noalias readonly %w,",
        "                         ptr noalias %y, i64 %ldy, i64 %K, i64 %p0, i64 %p1) nounwind {",
        "entry:",
        f"  %KP = add i64 %K, {SCALE_ROWS if kind == 'int8' else 0}",
        "  %none = icmp sge i64 %p0, %p1",
        "  br i1 %none, label %done, label %panel",
        "panel:",
        "  %p = phi i64 [ %p0, %entry ], [ %pnext, %store ]",
        "  %pk = mul i64 %p, %KP",
        f"  %pbase = mul i64 %pk, {NB}",
        "  br label %step",
        "step:",
        "  %k = phi i64 [ 0, %panel ], [ %knext, %step ]",
        *[f"  %a{m}_{j} = phi {vt} [ zeroinitializer, %panel ], [ %b{m}_{j}, %step ]" for m, j in acc],
        f"  %koff = mul i64 %k, {NB}",
        "  %woff = add i64 %pbase, %koff",
    ]
    sixteen = "<" + ", ".join(["i32 16"] * W) + ">"
    for j in range(V):
        body += [f"  %wo{j} = add i64 %woff, {j * W}",
                 f"  %wp{j} = getelementptr inbounds {et}, ptr %w, i64 %wo{j}"]
        if kind == "bf16":
            body += [f"  %wh{j} = load <{W} x i16>, ptr %wp{j}, align 2",
                     f"  %wz{j} = zext <{W} x i16> %wh{j} to <{W} x i32>",
                     f"  %ws{j} = shl <{W} x i32> %wz{j}, {sixteen}",
                     f"  %w{j} = bitcast <{W} x i32> %ws{j} to {vt}"]
        elif kind == "int8":
            body += [f"  %wb{j} = load <{W} x i8>, ptr %wp{j}, align 1",
                     f"  %wx{j} = sext <{W} x i8> %wb{j} to <{W} x i32>",
                     f"  %w{j} = sitofp <{W} x i32> %wx{j} to {vt}"]
        else:
            body += [f"  %w{j} = load {vt}, ptr %wp{j}, align 4"]
    for line in range(max(1, NB * esize // 64)):  # one prefetch per 64-byte line of this step's loads, a few KB ahead
        # (no inbounds: near the end this points past the panels, and a prefetch never faults)
        body += [f"  %fo{line} = add i64 %woff, {(prefetch + line * 64) // esize}",
                 f"  %fp{line} = getelementptr {et}, ptr %w, i64 %fo{line}",
                 f"  call void @llvm.prefetch.p0(ptr %fp{line}, i32 0, i32 3, i32 1)"]
    for m in range(rows):
        body += [f"  %xr{m} = mul i64 {m}, %ldx",
                 f"  %xi{m} = add i64 %xr{m}, %k",
                 f"  %xp{m} = getelementptr inbounds float, ptr %x, i64 %xi{m}",
                 f"  %xs{m} = load float, ptr %xp{m}, align 4",
                 f"  %xv{m} = insertelement {vt} poison, float %xs{m}, i32 0",
                 f"  %x{m} = shufflevector {vt} %xv{m}, {vt} poison, <{W} x i32> zeroinitializer"]
        body += [f"  %b{m}_{j} = call {vt} @llvm.fma.v{W}f32({vt} %x{m}, {vt} %w{j}, {vt} %a{m}_{j})" for j in range(V)]
    body += ["  %knext = add i64 %k, 1",
             "  %kend = icmp eq i64 %knext, %K",
             "  br i1 %kend, label %store, label %step",
             "store:",
             f"  %col = mul i64 %p, {NB}"]
    out = {(m, j): f"%b{m}_{j}" for m, j in acc}
    if kind == "int8":  # the column scales follow the panel's K x NB weights
        body += [f"  %kn = mul i64 %K, {NB}", "  %soff = add i64 %pbase, %kn"]
        for j in range(V):
            body += [f"  %so{j} = add i64 %soff, {4 * j * W}",
                     f"  %sp{j} = getelementptr inbounds i8, ptr %w, i64 %so{j}",
                     f"  %s{j} = load {vt}, ptr %sp{j}, align 4"]
        for m, j in acc:
            body.append(f"  %o{m}_{j} = fmul {vt} %b{m}_{j}, %s{j}")
            out[m, j] = f"%o{m}_{j}"
    for m in range(rows):
        body += [f"  %yr{m} = mul i64 {m}, %ldy", f"  %yb{m} = add i64 %yr{m}, %col"]
        for j in range(V):
            body += [f"  %yo{m}_{j} = add i64 %yb{m}, {j * W}",
                     f"  %yp{m}_{j} = getelementptr inbounds float, ptr %y, i64 %yo{m}_{j}",
                     f"  store {vt} {out[m, j]}, ptr %yp{m}_{j}, align 4"]
    body += ["  %pnext = add i64 %p, 1",
             "  %pend = icmp eq i64 %pnext, %p1",
             "  br i1 %pend, label %done, label %panel",
             "done:",
             "  ret void",
             "}"]
    return "\n".join(body)


def tile_name(rows: int, kind: str = "fp32") -> str:
    return f"tile{rows}" if kind == "fp32" else f"tile{rows}_{kind}"


class TileKernels:
    """The 1..isa.rows-row tile kernels compiled for `isa`; `by_kind[kind][r - 1]` is the address of the
    r-row kernel over panels of that kind (`addresses`: float32, `addresses_bf16`, `addresses_int8`)."""

    def __init__(self, isa: Isa, prefetch: int = PREFETCH_BYTES) -> None:
        W = isa.width
        source = "\n".join([
            "declare void @llvm.prefetch.p0(ptr, i32, i32, i32)",
            f"declare <{W} x float> @llvm.fma.v{W}f32(<{W} x float>, <{W} x float>, <{W} x float>)",
            *(tile_ir(r, isa, kind, prefetch) for kind in KINDS for r in range(1, isa.rows + 1))])
        module = llvm.parse_assembly(source)
        module.verify()
        machine = llvm.Target.from_default_triple().create_target_machine(cpu=isa.cpu, features=isa.features, opt=3)
        self.isa = isa
        self._engine = llvm.create_mcjit_compiler(module, machine)  # owns the code: keep it alive
        self._engine.finalize_object()
        self.by_kind = {kind: np.array([self._engine.get_function_address(tile_name(r, kind))
                                        for r in range(1, isa.rows + 1)], dtype=np.int64) for kind in KINDS}
        self.addresses, self.addresses_bf16, self.addresses_int8 = (self.by_kind[k] for k in KINDS)
        self.assembly = machine.emit_assembly(module)


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

    @intrinsic
    def _call_tile(typingctx, fn, x, ldx, w, y, ldy, k, p0, p1):  # pragma: no cover - compiled
        # A call through the kernel's address, passed in at run time: numba's on-disk cache then stays
        # valid across processes, where the JIT puts the kernels at new addresses.
        def codegen(context, builder, signature, args):
            i64, ptr = ir.IntType(64), ir.IntType(8).as_pointer()
            fnty = ir.FunctionType(ir.VoidType(), [ptr, i64, ptr, ptr, i64, i64, i64, i64])
            target = builder.inttoptr(args[0], fnty.as_pointer())
            builder.call(target, [builder.inttoptr(args[1], ptr), args[2], builder.inttoptr(args[3], ptr),
                                  builder.inttoptr(args[4], ptr), args[5], args[6], args[7], args[8]])
            return context.get_dummy_value()
        return types.void(*([types.int64] * 9)), codegen

    def _mm_into(x, panels, y, tiles):  # pragma: no cover - compiled
        """y[:, :P NB] = x (M, K) @ W^T for W packed as panels (P, K, NB) by `pack`; x and y rows
        contiguous, y at least P NB wide (the padded columns get products with zero weights).
        `tiles`: the kernels for the panels' type (`tiles_for`)."""
        M, K = x.shape
        P = panels.shape[0]
        xa, wa, ya = np.int64(x.ctypes.data), np.int64(panels.ctypes.data), np.int64(y.ctypes.data)
        ldx, ldy = np.int64(x.strides[0] // 4), np.int64(y.strides[0] // 4)
        T = tiles.shape[0]  # rows per tile
        if M == 0:  # an empty pass (and `prange(P if M else 0)` made numba's loop run ~2x slower)
            return
        for p in prange(P):  # numba gives each thread a contiguous run of panels
            if M <= T:  # one tile streams the panel once
                _call_tile(tiles[min(M, T) - 1], xa, ldx, wa, ya, ldy, K, p, p + 1)  # min: parfors hoist this read
            else:  # the first tile streams the panel from memory, the others find it in cache
                for m0 in range(0, M, T):
                    r = min(T, M - m0)
                    _call_tile(tiles[r - 1], xa + 4 * m0 * ldx, ldx, wa, ya + 4 * m0 * ldy, ldy, K, p, p + 1)

    @njit(cache=True)
    def _regroup(panels, out):  # pragma: no cover - compiled
        # out (K, P NB) = W^T row-major: out[k, p NB + j] = panels[p, k, j], runs of NB floats copied
        # as they lie (no transposition, so several times faster than NumPy's strided copy). Serial: it
        # runs between BLAS calls, and numba's worker threads woken there fight BLAS's spinning ones.
        P, K, NB = panels.shape
        for k in range(K):
            for p in range(P):
                for j in range(NB):
                    out[k, p * NB + j] = panels[p, k, j]

    mm_into = njit(parallel=True, cache=True)(_mm_into)  # for Python callers
    # For other compiled functions to call (cpu_layer, heads/cpu_heads.py): the same code, never read from
    # numba's disk cache, so it is compiled together with each caller. A cached caller compiled against a
    # parallel function that was itself loaded from the disk cache crashed the next process that loaded
    # the caller (a segmentation fault, numba 0.68); compiled together, the caller's cache loads fine.
    mm_into_nested = njit(parallel=True)(_mm_into)


_compiled: dict[Isa, TileKernels] = {}


def kernels(isa: Isa | None = None) -> TileKernels:
    """The tile kernels for `isa` (default: this CPU), compiled on first use (a few tens of ms) and kept
    for the life of the process: freeing an LLVM execution engine under running code crashed it."""
    isa = isa or host_isa()
    if isa not in _compiled:
        _compiled[isa] = TileKernels(isa)
    return _compiled[isa]


def describe() -> str:
    """What runs the few-row products here, for run records, e.g.
    "tiles up to 8x32, f32x16, sapphirerapids" (rows x columns of a register tile)."""
    isa = kernels().isa
    return f"tiles up to {isa.rows}x{isa.panel}, f32x{isa.width}, {isa.cpu}"


PANEL_DTYPES = {"fp32": np.dtype(np.float32), "bf16": np.dtype(np.uint16), "int8": np.dtype(np.int8)}


def packed_shape(n: int, k: int, panel: int | None = None, kind: str = "fp32") -> tuple[int, int, int]:
    """Shape of `pack`'s output for an (n, k) matrix."""
    nb = panel or kernels().isa.panel
    return -(-n // nb), k + (SCALE_ROWS if kind == "int8" else 0), nb


def pack(w: np.ndarray, panel: int | None = None, kind: str = "fp32", out: np.ndarray | None = None) -> np.ndarray:
    """(N, K) float32 -> (ceil(N / NB), K, NB) panels, zero-padded past N: float32; bfloat16 bit patterns
    (uint16, rounded to nearest even: `to_bf16`); or int8 (`int8_rows`), each panel followed by its NB
    column scales as SCALE_ROWS rows of bytes: (P, K + SCALE_ROWS, NB).
    `out`: an array of `packed_shape` and the kind's dtype (e.g. one layer of a stack) to pack into."""
    nb = panel or kernels().isa.panel
    n, k = w.shape
    shape = packed_shape(n, k, nb, kind)
    if out is None:
        out = np.empty(shape, dtype=PANEL_DTYPES[kind])
    elif out.shape != shape or out.dtype != PANEL_DTYPES[kind]:
        raise ValueError(f"pack into {out.dtype} {out.shape}: a {kind} ({n}, {k}) matrix needs {shape}")
    p, full = shape[0], n // nb
    if kind == "fp32":  # straight into place: no padded or transposed temporary of the whole matrix
        w = np.asarray(w, dtype=np.float32)
        out[:full] = w[:full * nb].reshape(full, nb, k).transpose(0, 2, 1)
        if full < p:
            out[full] = 0
            out[full, :, :n - full * nb] = w[full * nb:].T
        return out
    q, scales = int8_rows(w) if kind == "int8" else (w, None)
    padded = np.zeros((p * nb, k), dtype=q.dtype)
    padded[:n] = q
    panels = np.ascontiguousarray(padded.reshape(p, nb, k).transpose(0, 2, 1))
    if kind == "bf16":
        out[...] = bf16_bits(panels)
    else:
        col = np.ones(p * nb, dtype=np.float32)
        col[:n] = scales
        out[:, :k] = panels
        out[:, k:] = col.reshape(p, 1, nb).view(np.int8).reshape(p, SCALE_ROWS, nb)
    return out


def _panel_values(block: np.ndarray) -> np.ndarray:
    """Panels (p, K', NB) of any kind -> the float32 weights (p, K, NB) the kernels multiply by (bf16
    widened, int8 times its column scale, exactly as `to_bf16` and `to_int8` give them)."""
    kind = panel_kind(block)
    if kind == "fp32":
        return block
    if kind == "bf16":
        return (block.astype(np.uint32) << 16).view(np.float32)
    k, nb = block.shape[1] - SCALE_ROWS, block.shape[2]
    scales = np.ascontiguousarray(block[:, k:]).reshape(len(block), SCALE_ROWS * nb).view(np.float32)
    return block[:, :k].astype(np.float32) * scales[:, None, :]  # one product per weight, as to_int8


def _rows_block(panels: np.ndarray, start: int, stop: int) -> np.ndarray:
    nb = panels.shape[2]
    if start % nb:
        raise ValueError(f"unpack from row {start}: rows start at a multiple of the panel width {nb}")
    return panels[start // nb:-(-stop // nb)]


def unpack(panels: np.ndarray, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
    """Rows start..stop-1 (start a multiple of NB) of the (N, K) float32 matrix W that `pack` packed, as
    the kernels multiply by it. `out`: a flat float32 buffer of at least K floats per row, the rows
    rounded up to whole panels."""
    block = _rows_block(panels, start, stop)
    values = _panel_values(block)  # (p, K, NB)
    p, k, nb = values.shape
    w = np.empty(p * nb * k, dtype=np.float32) if out is None else out[:p * nb * k]
    w.reshape(p, nb, k)[...] = values.transpose(0, 2, 1)
    return w.reshape(p * nb, k)[:stop - start]


def unpack_t(panels: np.ndarray, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
    """Like `unpack`, transposed: W^T's columns start..stop-1 as a (K, stop - start) view of row-major
    memory, which the panels give without a transposition (BLAS takes either layout alike)."""
    block = _rows_block(panels, start, stop)
    values = _panel_values(block)
    p, k, nb = values.shape
    wt = (np.empty(k * p * nb, dtype=np.float32) if out is None else out[:k * p * nb]).reshape(k, p * nb)
    if values is block and numba is not None:
        _regroup(block, wt)
    else:
        wt.reshape(k, p, nb)[...] = values.transpose(1, 0, 2)
    return wt[:, :stop - start]


def int8_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 (N, K) -> int8 (N, K) and float32 scales (N,), per row symmetric: w ~ q * scale[:, None]."""
    w = np.asarray(w, dtype=np.float32)
    top = np.abs(w).max(axis=1)
    scales = np.where(top > 0, top / np.float32(127), np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(w / scales[:, None]), -127, 127).astype(np.int8)
    return q, scales


def to_int8(w: np.ndarray) -> np.ndarray:
    """float32 values replaced by their int8 approximations q * scale, the weights the int8 kernels use."""
    q, scales = int8_rows(w)
    return q.astype(np.float32) * scales[:, None]


def bf16_bits(w: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(torch.bfloat16).view(torch.int16) \
        .numpy().view(np.uint16)


def to_bf16(w: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 and widened back: exactly what the bf16 kernels multiply by."""
    return (bf16_bits(w).astype(np.uint32) << 16).view(np.float32)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError, TypeError):
        return None


def release_freed_memory() -> None:
    """Hand memory freed on the C heap back to the system. glibc keeps freed chunks of its heap mapped,
    so swapping a model's matrices for packed ones (or back) would hold both copies until the end; a
    no-op without glibc."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def panel_kind(panels: np.ndarray) -> str:
    return {np.dtype(np.uint16): "bf16", np.dtype(np.int8): "int8"}.get(panels.dtype, "fp32")


def tiles_for(panels: np.ndarray) -> np.ndarray:
    """The kernels' addresses for panels of this type (float32, bfloat16 bits or int8)."""
    return kernels().by_kind[panel_kind(panels)]


def padded_width(panels: np.ndarray) -> int:
    """Columns `mm_into` writes for these panels."""
    return panels.shape[0] * panels.shape[2]


def matmul(x: np.ndarray, panels: np.ndarray, n_out: int, tiles: np.ndarray | None = None) -> np.ndarray:
    """x (M, K) float32 -> x @ W^T (M, n_out), W given as `pack(W)` panels (any M; above MAX_ROWS
    BLAS is faster, see `matmul_wt`)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = np.empty((x.shape[0], padded_width(panels)), dtype=np.float32)
    mm_into(x, panels, y, tiles_for(panels) if tiles is None else tiles)
    return y[:, :n_out]


def matmul_wt(x: np.ndarray, w: np.ndarray, panels: np.ndarray) -> np.ndarray:
    """x (M, K) @ w (N, K)^T: the tile kernels for up to MAX_ROWS rows, BLAS's GEMM above (prefill)."""
    if x.shape[0] > MAX_ROWS:
        return x @ w.T  # a transposed operand: no copy of w
    return matmul(x, panels, w.shape[0])


# Above MAX_ROWS rows, `matmul_panels` unpacks W^T into a scratch buffer and runs BLAS on it: the whole
# matrix where it fits in this many bytes (one GEMM, as before there were panels), else blocks of columns.
BLOCK_BYTES = 8 << 20
# Matrices of up to this many weights are unpacked as W, for exactly the GEMM over a dense W: OpenBLAS
# runs products this small through kernels that sum in another order for each layout.
SMALL_MATRIX = 1 << 18
TILED_ROWS = 64  # passes up to this many rows stay on the tile kernels (cpu_layer.FUSED_ROWS is this)
_scratch = threading.local()


def _scratch_floats(size: int) -> np.ndarray:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < size:
        buf = _scratch.buf = np.empty(size, dtype=np.float32)
    return buf


def matmul_panels(x: np.ndarray, panels: np.ndarray, n_out: int) -> np.ndarray:
    """x (M, K) @ W^T (M, n_out) with W held only as `pack` panels: the tile kernels for up to TILED_ROWS
    rows (MAX_ROWS at a time), so a row of a tree or a draft gets a one-row pass's bits whatever the BLAS
    sums otherwise; above (prefill), BLAS over W unpacked into a reused buffer, bitwise the same GEMM over a dense
    W (tests/test_memory.py checks) without keeping that second copy. Larger matrices are unpacked as
    W^T in column blocks, which needs no transposition; a block's outputs may differ from a whole-matrix
    GEMM's in the last bits where the BLAS sums edge columns otherwise (OpenBLAS 0.3.31 does), the same
    in every pass, so every strategy still sees one model."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    m, k = x.shape
    if m <= MAX_ROWS:
        return matmul(x, panels, n_out)
    if m <= TILED_ROWS:  # each row bitwise a one-row pass's, whatever the BLAS: trees and drafts verify against it
        return np.concatenate([matmul(x[s:s + MAX_ROWS], panels, n_out) for s in range(0, m, MAX_ROWS)])
    nb = panels.shape[2]
    if n_out * k <= SMALL_MATRIX:
        return x @ unpack(panels, 0, n_out, out=_scratch_floats(-(-n_out // nb) * nb * k)).T
    per = min(-(-n_out // nb) * nb, max(nb, BLOCK_BYTES // (4 * k) // nb * nb))  # columns per GEMM
    buf = _scratch_floats(per * k)
    if per >= n_out:
        return x @ unpack_t(panels, 0, n_out, out=buf)
    y = np.empty((m, n_out), dtype=np.float32)
    for start in range(0, n_out, per):
        stop = min(n_out, start + per)
        np.matmul(x, unpack_t(panels, start, stop, out=buf), out=y[:, start:stop])
    return y
