"""Distillation throughput against the number of continuous-batching slots on the CPU kernels: the same
prompts (one chunk of `distill_data`, 128 by default) generated with each slot count in interleaved rounds,
checking that every count gives the same tokens and hidden states bitwise (each row of a batched pass is a
one-token pass's). Prints target tokens a second (prompt and continuation) and the median time per slot count.
A benchmark: run it on an idle machine.

    python experiments/distill_slots.py [--slots 16 32 48] [--prompts 128] [--rounds 2] [--source FILE]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from heads.batch_generate import Generated, continuous
from heads.prompt_sources import source_prompts
from specdec.models.loader import load_model

SOURCE = "heads/data/magpie-smollm2-135m-1turn-seed5.jsonl.gz"  # a training file: no evaluation data


def same(a: list[Generated], b: list[Generated]) -> bool:
    return all(x.continuation == y.continuation and np.array_equal(x.hidden, y.hidden) for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slots", type=int, nargs="+", default=[16, 32, 48])
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--source", default=SOURCE)
    args = ap.parse_args()
    torch.set_num_threads(2)
    target = load_model("smollm2-135m", "builtin:smollm2-135m", matmul="numba")
    prompts, _ = source_prompts(args.source, max_prompts=args.prompts)
    ids = [target.chat_ids([{"role": "user", "content": p}] if isinstance(p, str) else p) for p in prompts]
    stop = set(target.eos_ids)
    continuous(target, ids[:4], 8, 4, stop)  # compiles the kernels
    times: dict[int, list[float]] = {s: [] for s in args.slots}
    first: list[Generated] | None = None
    tokens = 0
    for _ in range(args.rounds):
        for s in args.slots:
            start = time.perf_counter()
            out = continuous(target, ids, 128, s, stop)
            times[s].append(time.perf_counter() - start)
            first = first or out
            if not same(first, out):
                raise SystemExit(f"{s} slots gave other tokens or hidden states than {args.slots[0]}: a kernel bug")
            tokens = sum(len(g.hidden) for g in out)
    print(f"{len(ids)} prompts, {tokens} target tokens (prompts and continuations); every slot count bitwise equal")
    for s in args.slots:
        med = float(np.median(times[s]))
        print(f"slots {s:3d}: {med:6.1f} s, {tokens / med:6.0f} tok/s ({', '.join(f'{t:.1f}' for t in times[s])})")


if __name__ == "__main__":
    main()
