"""Why the start-up pass-cost curve is noisy: the curve's 8-token point measured `trials` times in a row, each
as `pass_cost_curve` does it (one prefill of 128 tokens, 9 interleaved repetitions), with the one- and
8-token passes' median times beside it; two estimators (ratio of medians, median of paired ratios).
A benchmark, not a test: run it on an idle machine.

    python experiments/pass_cost_noise.py [trials]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from specdec.engine.engine import StaticEngine
from specdec.engine.timing import clock
from specdec.models.loader import load_model

SIZES = (1, 2, 4, 8)


def main(trials: int = 10) -> None:
    target = load_model("smollm2-135m", "builtin:smollm2-135m", matmul="numba")
    torch.set_num_threads(target.torch_threads or torch.get_num_threads())
    engine = StaticEngine(target.model, 2048)
    ids = [0] * 128
    of_medians, of_ratios = [], []
    with torch.inference_mode():
        for trial in range(trials):
            engine.prefill(ids)
            for n in SIZES:  # warm-up, as pass_times
                engine.forward(torch.zeros(n, dtype=torch.long))
                engine.rollback(len(ids))
            samples: dict[int, list[float]] = {n: [] for n in SIZES}
            for _ in range(9):
                for n in SIZES:
                    start = clock(engine.device)
                    engine.forward(torch.zeros(n, dtype=torch.long))
                    samples[n].append(clock(engine.device) - start)
                    engine.rollback(len(ids))
            engine.reset()
            med = {n: statistics.median(v) for n, v in samples.items()}
            of_medians.append(med[8] / med[1])
            of_ratios.append(statistics.median(a / b for a, b in zip(samples[8], samples[1])))
            print(f"trial {trial}: 1 token {med[1] * 1e3:5.1f} ms, 8 tokens {med[8] * 1e3:5.1f} ms; cost of 8: "
                  f"ratio of medians {of_medians[-1]:.2f}, median of ratios {of_ratios[-1]:.2f}", flush=True)
            time.sleep(2)
    for name, xs in (("ratio of medians", of_medians), ("median of ratios", of_ratios)):
        print(f"{name}: {min(xs):.2f} - {max(xs):.2f}, sd {statistics.stdev(xs):.2f}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
