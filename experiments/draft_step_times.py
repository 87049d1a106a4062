"""Time one step of the shipped draft with its weights in fp32, bf16 and int8, right after another
step of the same draft and right after a target pass (as in a speculative round, where the target's
pass over 540 MB of weights has pushed the draft's out of the caches). Kinds and cases interleaved;
prints medians in ms. A benchmark, not a test: run it on an idle machine.

    python experiments/draft_step_times.py [context] [samples]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from heads.draft_model import load_draft
from specdec.engine.engine import StaticEngine
from specdec.models.loader import load_model

KINDS = ("fp32", "bf16", "int8")


def main(context: int = 200, samples: int = 200) -> None:
    target = load_model("smollm2-135m", "builtin:smollm2-135m", matmul="numba")
    torch.set_num_threads(target.torch_threads or torch.get_num_threads())
    ids = [(i * 7919) % 40000 + 100 for i in range(context)]
    target_engine = StaticEngine(target.model, context + 16)
    drafts = {kind: StaticEngine(load_draft("heads/checkpoints/smollm2-135m-draft", weights=kind).bind(target),
                                 context + 16) for kind in KINDS}
    target_engine.prefill(ids)
    for engine in drafts.values():
        engine.prefill(ids)
    cases = ("after draft", "after target")
    times: dict[tuple[str, str], list[float]] = {(k, when): [] for k in KINDS for when in cases}
    with torch.inference_mode():
        for i in range(samples + 5):
            for kind, engine in drafts.items():
                for when in cases:
                    if when == "after target":
                        target_engine.forward(torch.tensor([5, 6, 7, 8]))
                        target_engine.rollback(context)
                    else:
                        engine.forward(torch.tensor([9]))  # the step before, as in a chain
                        engine.rollback(context)
                    start = time.perf_counter()
                    engine.forward(torch.tensor([5]))
                    if i >= 5:  # the first rounds compile and warm up
                        times[kind, when].append(time.perf_counter() - start)
                    engine.rollback(context)
    print(f"draft step after {context} cached tokens, median of {samples} (ms)")
    print("| weights | after a step of the same draft | after a target pass over 4 tokens |\n|---|---|---|")
    for kind in KINDS:
        warm, cold = (statistics.median(times[kind, w]) * 1e3 for w in cases)
        print(f"| {kind} | {warm:.3f} | {cold:.3f} |")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
