"""Variants of the CPU tile kernels on the target's own products: `python experiments/tile_variants.py [ROUNDS]`.

The shipped kernels (specdec/models/cpu_kernels.py) keep a tile of rows x 2 vectors of the host's widest floats in
registers and prefetch PREFETCH_BYTES ahead. Each variant here is compiled beside them:
- `v256`: half-width vectors (8 floats), 4 per panel row, so the same 32-column panels; up to 6 rows per tile (the
  accumulators, weights and a broadcast fit 32 registers). Only where the host has 16-float vectors.
- `pf2k`, `pf8k`: the shipped shape, prefetching 2 KB or 8 KB ahead instead.
Every variant computes each output as the same in-order fma chain, so all give the same bits (checked first).

A round times, for each row count and each variant, SmolLM2-135M's four products (qkv, o, gate/up, down) over its
30 layers as one compiled loop over the fused stack's own panels, interleaved, the variants' order rotating from
round to round. Rounds are split by the host's
state as pass_parts.py splits them (the shipped kernels' one-row time; Otsu), and each cell gives the median time
and the median per-round ratio to the shipped kernels. A benchmark: run it on an idle machine.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from specdec.models import cpu_kernels
from specdec.models.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from phase_split import DISTINCT, otsu  # noqa: E402  (a sibling script, not a package)

ROWS = (1, 2, 3, 4, 5, 6, 8)

if cpu_kernels.available():
    from numba import njit

    from specdec.models.cpu_kernels import mm_into_nested as mm_into

    @njit
    def products(x, wqkv, wo, w_gate_up, w_down, att, act, qkv, o, gate_up, down, tiles):  # pragma: no cover
        """The four products of every layer, outputs overwritten layer after layer (inputs fixed)."""
        for layer in range(wqkv.shape[0]):
            mm_into(x, wqkv[layer], qkv, tiles)
            mm_into(att, wo[layer], o, tiles)
            mm_into(x, w_gate_up[layer], gate_up, tiles)
            mm_into(act, w_down[layer], down, tiles)


def variants(shipped: np.ndarray) -> dict[str, np.ndarray]:
    """Tile addresses per variant name; the compiled kernels stay alive in cpu_kernels' registry."""
    isa = cpu_kernels.host_isa()
    out = {"shipped": shipped}
    if isa.width == 16:
        half = cpu_kernels.Isa(8, 4, 6, isa.cpu, isa.features)
        out["v256"] = cpu_kernels.kernels(half).addresses
    for name, distance in (("pf2k", 2048), ("pf8k", 8192)):
        compiled = cpu_kernels.TileKernels(isa, prefetch=distance)
        _alive.append(compiled)  # freeing an LLVM engine under running code crashes it (cpu_kernels.kernels)
        out[name] = compiled.addresses
    return out


_alive: list[cpu_kernels.TileKernels] = []


def main() -> None:
    if not cpu_kernels.available():
        raise SystemExit("the CPU tile kernels need numba and llvmlite; pip install numba")
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    st = load_model("smollm2-135m", "builtin:smollm2-135m", matmul="numba").model.fused
    if st.wqkv.dtype != np.float32:
        raise SystemExit("the target's panels are not float32; this script times the fp32 kernels")
    tiles = variants(st.tiles)
    weights = (st.wqkv, st.wo, st.w_gate_up, st.w_down)
    rng = np.random.default_rng(0)
    calls: dict[tuple[str, int], Callable[[], np.ndarray]] = {}
    for m in ROWS:
        x = 0.1 * rng.standard_normal((m, st.wqkv.shape[2]), dtype=np.float32)
        att = 0.1 * rng.standard_normal((m, st.wo.shape[2]), dtype=np.float32)
        act = 0.1 * rng.standard_normal((m, st.w_down.shape[2]), dtype=np.float32)
        outs = [np.zeros((m, w.shape[1] * w.shape[3]), dtype=np.float32) for w in weights]
        for name, t in tiles.items():
            def call(x=x, att=att, act=act, outs=outs, t=t) -> np.ndarray:  # type: ignore[no-untyped-def]
                products(x, *weights, att, act, *outs, t)
                return np.concatenate([o.ravel() for o in outs])
            calls[name, m] = call
    for m in ROWS:
        ref = calls["shipped", m]()
        for name in tiles:
            if not np.array_equal(calls[name, m](), ref):
                raise SystemExit(f"variant {name} differs from the shipped kernels at {m} rows")
    times: dict[tuple[str, int], list[float]] = {key: [] for key in calls}
    names = list(tiles)
    for r in range(rounds + 3):  # 3 warm-up rounds
        for m in ROWS:
            for i in range(len(names)):  # the order rotates each round: the first call of a row count ran slower
                name = names[(i + r) % len(names)]
                start = time.perf_counter()
                calls[name, m]()
                if r >= 3:
                    times[name, m].append(time.perf_counter() - start)
    one = times["shipped", 1]
    cut = otsu(one)
    fast = [t for t in one if t < cut]
    if not fast or statistics.mean(t for t in one if t >= cut) / statistics.mean(fast) < DISTINCT:
        cut = float("inf")
    print(f"tile kernels: {cpu_kernels.describe()}; the four products over 30 layers, {rounds} rounds; every variant "
          "bitwise the shipped kernels. Cells: median ms (median ratio to shipped)")
    for state, keep in (("fast", [i for i, t in enumerate(one) if t < cut]),
                        ("slow", [i for i, t in enumerate(one) if t >= cut])):
        if not keep:
            continue
        print(f"\n{state if cut != float('inf') else 'one state'} ({len(keep)} rounds)\n")
        print("| variant | " + " | ".join(f"{m} rows" for m in ROWS) + " |")
        print("|---" * (len(ROWS) + 1) + "|")
        for name in tiles:
            cells = []
            for m in ROWS:
                med = 1e3 * statistics.median(times[name, m][i] for i in keep)
                ratio = statistics.median(times[name, m][i] / times["shipped", m][i] for i in keep)
                cells.append(f"{med:.2f} ({ratio:.3f})")
            print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
