"""Where a target pass over several tokens spends its extra, per host state: `python experiments/pass_parts.py`.

SmolLM2-135M on the CPU kernels, after 256 cached tokens. Each round times, for 1 and for 5 new tokens:
- the whole pass (`StaticEngine.forward`, rolled back after);
- the layers' matrix products alone: every layer's four products over random rows, in one compiled loop
  (the fused stack's own `mm_into`, no attention, norms or activations);
- the output head alone (its `NumbaLinear` over random rows).

The rest of the pass (attention, norms, activations, residuals and the Python around the call) is the whole
minus the two. Rounds are split by the host's state, read from the one-token pass as phase_split.py reads it
(Otsu's threshold; one state when the groups differ by less than 15%), and each part's median is printed per state.
A benchmark: run it on an idle machine. An argument sets the rounds (default 300).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from specdec.engine.engine import StaticEngine
from specdec.models import cpu_kernels
from specdec.models.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from phase_split import DISTINCT, otsu  # noqa: E402  (a sibling script, not a package)

SIZES = (1, 5)
CONTEXT = 256

if cpu_kernels.available():
    from numba import njit

    from specdec.models.cpu_kernels import mm_into_nested

    @njit
    def layer_products(h, act, wqkv, wo, w_gate_up, w_down, qkv, o, gate_up, down, tiles):  # pragma: no cover
        """Every layer's four products, as layer_forward runs them (attention's output stands in as h)."""
        for layer in range(wqkv.shape[0]):
            mm_into_nested(h, wqkv[layer], qkv, tiles)
            mm_into_nested(h, wo[layer], o, tiles)
            mm_into_nested(h, w_gate_up[layer], gate_up, tiles)
            mm_into_nested(act, w_down[layer], down, tiles)


def main() -> None:
    if not cpu_kernels.available():
        raise SystemExit("the CPU tile kernels need numba and llvmlite; pip install numba")
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    target = load_model("smollm2-135m", "builtin:smollm2-135m", matmul="numba")
    stack, head = target.model.fused, target.model.lm_head
    engine = StaticEngine(target.model, 2048)
    ids = list(range(1000, 1000 + CONTEXT))
    engine.prefill(ids)
    rng = np.random.default_rng(0)
    dim, hidden = stack.wqkv.shape[2], stack.w_down.shape[2]

    def rows(m: int, n: int) -> np.ndarray:
        return rng.standard_normal((m, n), dtype=np.float32)

    def products_args(m: int) -> tuple:
        out = [np.empty((m, w.shape[1] * w.shape[3]), np.float32) for w in (stack.wqkv, stack.wo, stack.w_gate_up,
                                                                             stack.w_down)]
        return (rows(m, dim), rows(m, hidden), stack.wqkv, stack.wo, stack.w_gate_up, stack.w_down, *out, stack.tiles)

    args = {m: products_args(m) for m in SIZES}
    head_in = {m: torch.from_numpy(rows(m, dim)) for m in SIZES}

    def timed(fn, *a) -> float:  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        fn(*a)
        return time.perf_counter() - start

    def whole(m: int) -> None:
        engine.forward(torch.zeros(m, dtype=torch.long))

    parts = {"pass": whole, "products": lambda m: layer_products(*args[m]), "head": lambda m: head(head_in[m])}
    times: dict[tuple[str, int], list[float]] = {(p, m): [] for p in parts for m in SIZES}
    with torch.inference_mode():
        for r in range(rounds + 3):  # 3 warm-up rounds: compilation and first touches
            for m in SIZES:
                for name, fn in parts.items():
                    t = timed(fn, m)
                    if name == "pass":
                        engine.rollback(len(ids))
                    if r >= 3:
                        times[name, m].append(t)
    one = times["pass", 1]
    cut = otsu(one)
    fast, slow = [t for t in one if t < cut], [t for t in one if t >= cut]
    if not fast or statistics.mean(slow) / statistics.mean(fast) < DISTINCT:
        cut = float("inf")  # one state: every round in the first group
    print(f"tile kernels: {cpu_kernels.describe()}; {rounds} rounds after {CONTEXT} cached tokens, medians in ms")
    print("| state (rounds) | " + " | ".join(f"{p}, {m} tok" for p in (*parts, "rest") for m in SIZES) + " |")
    print("|---" * (1 + 2 * len(SIZES) * 2) + "|")
    for state, keep in (("fast", [i for i, t in enumerate(one) if t < cut]),
                        ("slow", [i for i, t in enumerate(one) if t >= cut])):
        if not keep:
            continue
        med = {k: 1e3 * statistics.median(v[i] for i in keep) for k, v in times.items()}
        for m in SIZES:
            med["rest", m] = med["pass", m] - med["products", m] - med["head", m]
        label = state if cut != float("inf") else "one state"
        cells = " | ".join(f"{med[p, m]:.2f}" for p in (*parts, "rest") for m in SIZES)
        print(f"| {label} ({len(keep)}) | {cells} |")


if __name__ == "__main__":
    main()
