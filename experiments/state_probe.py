"""Does a cheap pass tell the machine's state? Alternates, for `seconds`: a one-token and an 8-token target pass
(after 128 cached tokens) and one EAGLE drafter pass over two tokens (after the target's, as a round's catch-up
is), and prints each 2-second window's medians, so one can see whether the drafter's time moves with the
one-token pass's (the two-state machine of the notebook). A benchmark, not a test: run it on an idle machine.

    python experiments/state_probe.py [seconds]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

from heads.eagle import load_eagle
from specdec.engine.timing import clock
from specdec.models.loader import load_model
from specdec.strategies.base import GenerationParams
from specdec.strategies.eagle_tree import Eagle2

ROOT = Path(__file__).resolve().parents[1]


def main(seconds: int = 60) -> None:
    target = load_model("smollm2-135m", "builtin:smollm2-135m", matmul="numba")
    torch.set_num_threads(target.torch_threads or torch.get_num_threads())
    drafter = load_eagle(str(ROOT / "heads/checkpoints/smollm2-135m-eagle"), weights="int8")
    tree = Eagle2(target, "eagle2", drafter, depth=4, topk=4, nodes=8, size="fixed", max_len=1024)
    prompt = target.chat_ids([{"role": "user", "content": "Explain how a bicycle gear works. " * 8}])
    tree.generate(prompt, GenerationParams(max_new_tokens=4, eos_ids=()), 0)  # leaves the drafter's cache filled
    proposer, engine = tree.last_proposer, tree.engine
    engine.prefill([0] * 128)
    kept = proposer.cache.lengths[0]
    features = torch.zeros(2, proposer.pending.shape[-1], device=target.device)  # (2, F): values do not matter
    rows: list[tuple[float, float, float, float]] = []
    start = clock(engine.device)
    with torch.inference_mode():
        while clock(engine.device) - start < seconds:
            t0 = clock(engine.device)
            engine.forward(torch.zeros(1, dtype=torch.long))
            engine.rollback(128)
            t1 = clock(engine.device)
            engine.forward(torch.zeros(8, dtype=torch.long))
            engine.rollback(128)
            t2 = clock(engine.device)
            proposer._run([5, 6], features, kept)
            proposer.cache.rollback(kept)
            t3 = clock(engine.device)
            rows.append((t0 - start, t1 - t0, t2 - t1, t3 - t2))
    window = 2.0
    print("window  1-token ms  8-token ms  8/1   drafter ms")
    w = 0
    while w * window < seconds:
        part = [r for r in rows if w * window <= r[0] < (w + 1) * window]
        if part:
            one, eight, draft = (statistics.median(r[i] for r in part) * 1e3 for i in (1, 2, 3))
            print(f"{w * window:5.0f} s  {one:9.1f}  {eight:10.1f}  {eight / one:4.2f}  {draft:9.2f}")
        w += 1


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
