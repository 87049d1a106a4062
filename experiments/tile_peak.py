"""Multiply-adds per second of the CPU tile kernels (specdec/models/cpu_kernels.py) over a cache-resident
fp32 matrix (1536 x 576, 3.5 MB), for 1-8 rows of x on 1 and 2 threads: what the arithmetic alone allows,
beside the weight stream that bounds a pass. Best of 5 timings of 200 calls each. A benchmark: run it on an
idle machine.

    python experiments/tile_peak.py
"""

from __future__ import annotations

import time

import numba
import numpy as np

from specdec.models import cpu_kernels

N, K = 1536, 576
ROWS = (1, 2, 4, 5, 6, 8)


def main() -> None:
    if not cpu_kernels.available():
        raise SystemExit("the CPU tile kernels need numba and llvmlite; pip install numba")
    rng = np.random.default_rng(0)
    panels = cpu_kernels.pack(rng.standard_normal((N, K), dtype=np.float32))
    print(f"tile kernels: {cpu_kernels.describe()}")
    print("| threads | " + " | ".join(f"{m} rows" for m in ROWS) + " |")
    print("|---" * (len(ROWS) + 1) + "|")
    for threads in (1, 2):
        numba.set_num_threads(threads)
        rates = []
        for m in ROWS:
            x = rng.standard_normal((m, K), dtype=np.float32)
            for _ in range(50):
                cpu_kernels.matmul(x, panels, N)
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(200):
                    cpu_kernels.matmul(x, panels, N)
                best = min(best, (time.perf_counter() - start) / 200)
            rates.append(m * N * K / best / 1e9)
        print(f"| {threads} | " + " | ".join(f"{r:.1f} GMAC/s" for r in rates) + " |")


if __name__ == "__main__":
    main()
