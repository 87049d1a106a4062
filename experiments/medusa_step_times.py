"""Time one step of the shipped Medusa heads right after a target pass over 4 tokens (as in a round,
where the target's pass has pushed the heads' weights out of the caches): the residual blocks in torch
against the blocks on the CPU kernels (`MedusaHeads.use_cpu_kernels`, float32), each with the int8
projection and the shipped tree's needs (top 2 of the first 2 heads), on the hidden states of varied
4-token passes. Interleaved; prints medians in ms and how often both give the same candidates. A benchmark,
not a test: run it on an idle machine.

    python experiments/medusa_step_times.py [context] [samples]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from heads.medusa import load_heads
from specdec.engine.engine import StaticEngine
from specdec.models.loader import load_model

HEADS = "heads/checkpoints/smollm2-135m-medusa"


def main(context: int = 300, samples: int = 150) -> None:
    target = load_model("smollm2-135m", "builtin:smollm2-135m", matmul="numba")
    torch.set_num_threads(target.torch_threads or torch.get_num_threads())
    kernels = load_heads(target, HEADS, "int8")
    in_torch = load_heads(target, HEADS, "int8")
    in_torch.block_panels = None  # the blocks as torch modules, as before the kernels ran them
    engine = StaticEngine(target.model, context + 16)
    ids = [(i * 7919) % 40000 + 100 for i in range(context)]
    engine.prefill(ids)
    times: dict[str, list[float]] = {"torch blocks": [], "kernel blocks": []}
    same = 0
    with torch.inference_mode():
        for i in range(samples + 10):
            hidden = engine.forward(torch.tensor([5 + i, 6, 7, 8])).hidden[-1].clone()
            engine.rollback(context)
            picks = []
            for name, heads in (("torch blocks", in_torch), ("kernel blocks", kernels)):
                engine.forward(torch.tensor([5, 6, 7, 8]))  # a pass right before, as in a round
                engine.rollback(context)
                start = time.perf_counter()
                picks.append(heads.topk(hidden, 2, 2, root=8))
                if i >= 10:  # the first rounds warm up
                    times[name].append(time.perf_counter() - start)
            same += i >= 10 and torch.equal(picks[0], picks[1])
    print(f"Medusa heads step (top 2 of 2 heads) after a 4-token pass, {context} cached tokens, median of {samples}")
    for name, t in times.items():
        print(f"| {name} | {statistics.median(t) * 1e3:.3f} ms |")
    print(f"same candidates in {same} of {samples} steps")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
