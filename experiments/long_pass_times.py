"""Time target passes over more new tokens than one fused call takes (FUSED_ROWS, 64), as trees of the papers'
size and larger verify them: through consecutive fused calls (the route since 944a44f) and through the torch
path with BLAS above 64 rows (the route before it), interleaved in one process after 256 cached tokens
(SmolLM2-135M, the numba kernels). Prints medians in ms and each row's logits' agreement with one-token passes.
A benchmark: run it on an idle machine.

    python experiments/long_pass_times.py
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from specdec.engine.engine import StaticEngine, pass_times
from specdec.models.cpu_layer import FUSED_ROWS
from specdec.models.loader import load_model

SIZES = [64, 65, 101, 128]
CONTEXT = 256


@contextmanager
def torch_path_above(model: Any, rows: int) -> Iterator[None]:
    """The route before 944a44f: passes over more than `rows` tokens skip the fused stack, and the output
    head multiplies all of a pass's rows in one product."""
    fused, takes = model.fused, model.fused.takes
    fused.takes = lambda x, mask=None, cache=None: x.shape[1] <= rows and takes(x, mask, cache)
    model.head = lambda h: model.lm_head(h.contiguous())
    try:
        yield
    finally:
        del fused.takes, model.head


def same_as_steps(engine: StaticEngine, ids: list[int], n: int) -> float:
    """Share of a chain pass's n rows whose logits equal, bitwise, those of n one-token passes."""
    tokens = torch.arange(1000, 1000 + n)
    engine.prefill(ids)
    whole = engine.forward(tokens).logits
    engine.rollback(len(ids))
    steps = torch.cat([engine.forward(t[None]).logits for t in tokens])
    engine.reset()
    return sum(torch.equal(a, b) for a, b in zip(whole, steps)) / n


def main() -> None:
    target = load_model("smollm2-135m", "builtin:smollm2-135m", matmul="numba")
    engine = StaticEngine(target.model, 1024)
    ids = list(range(1000, 1000 + CONTEXT))
    assert min(SIZES) <= FUSED_ROWS < max(SIZES)
    times: dict[str, list[dict[int, float]]] = {"fused calls": [], "torch path": []}
    for _ in range(3):  # the two routes alternate, so a drift in the machine's speed hits both
        times["fused calls"].append(pass_times(engine, ids, SIZES, reps=5))
        with torch_path_above(target.model, FUSED_ROWS):
            times["torch path"].append(pass_times(engine, ids, SIZES, reps=5))
    print("| route | " + " | ".join(f"{n} new" for n in SIZES) + " | rows bitwise a one-token pass's, 101 new |")
    print("|---" * (len(SIZES) + 2) + "|")
    for route, runs in times.items():
        med = {n: sorted(r[n] for r in runs)[1] * 1e3 for n in SIZES}
        if route == "torch path":
            with torch_path_above(target.model, FUSED_ROWS):
                same = same_as_steps(engine, ids, 101)
        else:
            same = same_as_steps(engine, ids, 101)
        print(f"| {route} | " + " | ".join(f"{med[n]:.1f}" for n in SIZES) + f" | {same:.2f} |")


if __name__ == "__main__":
    main()
