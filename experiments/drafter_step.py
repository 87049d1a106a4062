"""One drafter step through the module path and as one compiled call (specdec/models/cpu_drafter.py), interleaved.

The shipped EAGLE drafter and the shipped draft of SmolLM2-135M (int8 weights, as their strategy configs run
them) on the CPU kernels, after `context` cached tokens, each step rolled back after. The module path is what
their proposers ran before: the drafter's modules (EAGLE: `EagleNet.forward` with the last row's logits; the
draft: `StaticEngine.forward`); the compiled call is `DrafterPass` (EAGLE) and `StaticEngine.next_logits` (the
draft). Both give the same bits. Prints medians in microseconds and the median of the paired ratios.
A benchmark, not a test: run it on an idle machine.

    python experiments/drafter_step.py [context] [samples]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from heads.draft_model import load_draft
from heads.eagle import load_eagle
from specdec.engine.engine import StaticEngine
from specdec.models.cpu_drafter import DrafterPass
from specdec.models.loader import load_model


def eagle_steps(target: object, context: int) -> tuple[Callable[[], object], Callable[[], object]]:
    net = load_eagle("heads/checkpoints/smollm2-135m-eagle", weights="int8").bind(target)
    cache, kernel = net.new_cache(context + 16), DrafterPass(net)
    dim = net.args.dim
    gen = torch.Generator().manual_seed(0)
    ids, feats = torch.randint(100, 40000, (context,), generator=gen), torch.randn(context, dim, generator=gen)
    for s in range(0, context, 64):  # the drafter's cache, filled as catch-up passes fill it
        kernel(ids[s:s + 64].numpy(), feats[s:s + 64].numpy(), cache)
    one, feature = torch.tensor([[123]]), torch.randn(1, 1, dim, generator=gen)
    position = torch.tensor([[context]])

    def module() -> object:
        out = net(one, feature, position, cache, None, logits_from=0)
        cache.rollback(context)
        return out

    def call() -> object:
        out = kernel(one[0].numpy(), feature[0].numpy(), cache)
        cache.rollback(context)
        return out

    return module, call


def draft_steps(target: object, context: int) -> tuple[Callable[[], object], Callable[[], object]]:
    engine = StaticEngine(load_draft("heads/checkpoints/smollm2-135m-draft", weights="int8").bind(target),
                          context + 16)
    engine.prefill([(i * 7919) % 40000 + 100 for i in range(context)])
    one = torch.tensor([123])

    def module() -> object:
        out = engine.forward(one).logits[-1]
        engine.rollback(context)
        return out

    def call() -> object:
        out = engine.next_logits(one)
        engine.rollback(context)
        return out

    return module, call


def main(context: int = 256, samples: int = 2000) -> None:
    target = load_model("smollm2-135m", "builtin:smollm2-135m", matmul="numba")
    torch.set_num_threads(target.torch_threads or torch.get_num_threads())
    with torch.inference_mode():
        pairs = {"eagle": eagle_steps(target, context), "draft": draft_steps(target, context)}
        times: dict[tuple[str, str], list[float]] = {(d, p): [] for d in pairs for p in ("module", "one call")}
        for i in range(samples + 20):
            for drafter, (module, call) in pairs.items():
                order = (("module", module), ("one call", call))
                for path, step in order if i % 2 else order[::-1]:
                    start = time.perf_counter()
                    step()
                    if i >= 20:  # the first rounds compile and warm up
                        times[drafter, path].append(time.perf_counter() - start)
    print(f"one drafter step after {context} cached tokens, {samples} interleaved samples (us, medians)")
    print("| drafter | module path | one call | one call / module (median of paired ratios) |\n|---|---|---|---|")
    for drafter in pairs:
        a, b = np.array(times[drafter, "module"]), np.array(times[drafter, "one call"])
        print(f"| {drafter} | {1e6 * statistics.median(a):.0f} | {1e6 * statistics.median(b):.0f} | "
              f"{statistics.median(b / a):.3f} |")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
