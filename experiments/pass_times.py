"""Time target passes over 1-8 new tokens after 16 to 1024 cached tokens (SmolLM2-135M, the numba
kernels): what a decode step and a verification pass cost as the context grows. Sizes interleaved
(`specdec.engine.engine.pass_times`); prints medians in ms. A benchmark: run it on an idle machine.

    python experiments/pass_times.py
"""

from __future__ import annotations

from specdec.engine.engine import StaticEngine, pass_times
from specdec.models.loader import load_model

SIZES = [1, 2, 4, 6, 8]


def main() -> None:
    target = load_model("smollm2-135m", "builtin:smollm2-135m", matmul="numba")
    engine = StaticEngine(target.model, 2048)
    print("| cached tokens | " + " | ".join(f"{n} new" for n in SIZES) + " |")
    print("|---" * (len(SIZES) + 1) + "|")
    for context in (16, 256, 512, 1024):
        times = pass_times(engine, list(range(1000, 1000 + context)), SIZES, reps=9)
        print(f"| {context} | " + " | ".join(f"{times[n] * 1e3:.2f}" for n in SIZES) + " |")


if __name__ == "__main__":
    main()
