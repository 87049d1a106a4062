"""Time the CPU kernels' product over SmolLM2-135M's output head (49,152 x 576, fp32 panels) for 1-8 rows,
the rows interleaved, in several trials: where a verification pass stops streaming weights and starts
paying arithmetic. Each trial prints its medians and the bandwidth of the one-row product, so a machine
that switches speed phases shows both (experiments/README.md, "The acceptance runs on an AMD EPYC").
Random weights of the head's shape: the kernel's cost does not depend on the values. A benchmark: run it
on an idle machine.

    python experiments/row_costs.py [TRIALS]
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from specdec.models import cpu_kernels

ROWS = (1, 2, 4, 6, 8)
SHAPE = (49152, 576)


def trial(panels: np.ndarray, reps: int = 15) -> dict[int, float]:
    """Median seconds per product for each row count, the counts interleaved; the first round warms up."""
    samples: dict[int, list[float]] = {m: [] for m in ROWS}
    xs = {m: np.random.default_rng(m).standard_normal((m, SHAPE[1]), dtype=np.float32) for m in ROWS}
    for rep in range(reps + 1):
        for m in ROWS:
            start = time.perf_counter()
            cpu_kernels.matmul_panels(xs[m], panels, SHAPE[0])
            if rep:
                samples[m].append(time.perf_counter() - start)
    return {m: statistics.median(t) for m, t in samples.items()}


def main(trials: int = 5) -> None:
    w = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
    panels = cpu_kernels.pack(w)
    print(f"{cpu_kernels.describe()}; ms per product, and relative to one row")
    print("| trial | GB/s at 1 row | " + " | ".join(f"{m} rows" for m in ROWS) + " |")
    print("|---" * (len(ROWS) + 2) + "|")
    for i in range(trials):
        t = trial(panels)
        cells = [f"{t[m] * 1e3:.2f} ({t[m] / t[1]:.2f})" for m in ROWS]
        print(f"| {i + 1} | {w.nbytes / t[1] / 1e9:.0f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
