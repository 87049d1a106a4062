"""A pass-cost curve per host state: `python experiments/state_curves.py [SECONDS]` (default 150).

Times the target's pass over 1-16 new tokens after 128 cached, as the strategies do at start-up
(`specdec.engine.engine.pass_times`, 9 interleaved rounds), again and again for SECONDS. Each timing met one of
the host's states (the AMD EPYC's: a one-token pass of about 13 or 19 ms; experiments/README.md, "The AMD's two
speeds"); the timings are split by their one-token pass at Otsu's threshold, and each state's curve is the
per-size median of its timings, made non-decreasing, printed as a list for `strategy.schedule.curve`.
A benchmark: run it on an idle machine.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from specdec.engine.engine import StaticEngine, pass_times
from specdec.models.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from phase_split import DISTINCT, otsu  # noqa: E402  (a sibling script, not a package)

SIZES = list(range(1, 17))
CONTEXT = 128


def state_curve(timings: list[dict[int, float]]) -> list[float]:
    """Per-size median of each timing's cost relative to its own one-token pass, made non-decreasing."""
    out = [1.0]
    for n in SIZES[1:]:
        out.append(max(out[-1], statistics.median(t[n] / t[1] for t in timings)))
    return out


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 150.0
    target = load_model("smollm2-135m", "builtin:smollm2-135m", matmul="numba")
    engine = StaticEngine(target.model, 2048)
    timings: list[dict[int, float]] = []
    start = time.time()
    while time.time() - start < seconds:
        timings.append(pass_times(engine, [0] * CONTEXT, SIZES, reps=9))
    ones = [1e3 * t[1] for t in timings]
    cut = otsu(ones)
    groups = {"fast": [t for t in timings if 1e3 * t[1] < cut], "slow": [t for t in timings if 1e3 * t[1] >= cut]}
    print(f"{len(timings)} timings; one-token pass split at {cut:.1f} ms (Otsu)")
    means = {k: statistics.mean(1e3 * t[1] for t in v) for k, v in groups.items() if v}
    if len(means) < 2 or means["slow"] / means["fast"] < DISTINCT:
        print("one state: " + "[" + ",".join(f"{c:.3f}" for c in state_curve(timings)) + "]")
        return
    for name, group in groups.items():
        print(f"{name} ({len(group)} timings, one token {means[name]:.1f} ms): "
              + "[" + ",".join(f"{c:.3f}" for c in state_curve(group)) + "]")


if __name__ == "__main__":
    main()
