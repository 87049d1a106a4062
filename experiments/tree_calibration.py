"""Does the EAGLE drafter's path probability predict what greedy verification accepts? strategy=eagle2 with the
shipped drafter and a fixed tree (`nodes` verified every round) on first turns of the held-apart Magpie
questions; every verified node's path probability is binned against whether the target accepted it.

    python experiments/tree_calibration.py [questions]
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from heads.eagle import load_eagle
from specdec.models.loader import load_model
from specdec.strategies.base import DecodeState, GenerationParams
from specdec.strategies.eagle_tree import Eagle2, EagleTreeProposer, Node
from specdec.verify import Proposal

ROOT = Path(__file__).resolve().parents[1]
BINS = (0.0, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0001)


def main(questions: int = 24) -> None:
    target = load_model("smollm2-135m", "builtin:smollm2-135m", matmul="numba")
    drafter = load_eagle(str(ROOT / "heads/checkpoints/smollm2-135m-eagle"), weights="int8")
    tree = Eagle2(target, "eagle2", drafter, depth=4, topk=4, nodes=8, size="fixed", grow="all")
    probs: list[float] = []  # the last proposal's path probabilities, in its node order
    rows: list[tuple[float, bool]] = []
    kept, step = EagleTreeProposer._kept, Eagle2._step

    def spy_kept(self: EagleTreeProposer, nodes: list[Node], budget: int) -> list[int]:
        order = kept(self, nodes, budget)
        probs[:] = [math.exp(nodes[i].score) for i in sorted(order, key=lambda i: (nodes[i].depth, -nodes[i].score))]
        return order

    def spy_step(self: Eagle2, state: DecodeState, proposal: Proposal | None) -> Any:
        verdict, out = step(self, state, proposal)
        if proposal is not None:
            accepted = set(verdict.nodes)
            rows.extend((p, k in accepted) for k, p in enumerate(probs, start=1))
        return verdict, out

    EagleTreeProposer._kept = spy_kept  # type: ignore[method-assign]
    Eagle2._step = spy_step  # type: ignore[method-assign]
    lines = (ROOT / "experiments/heldapart/magpie_heldapart.jsonl").open()
    params = GenerationParams(max_new_tokens=128, eos_ids=tuple(target.eos_ids))
    for row in [json.loads(line) for line in lines][:questions]:
        tree.new_conversation()
        tree.generate(target.chat_ids([{"role": "user", "content": row["turns"][0]}]), params, 0)
    print("| path probability | nodes | mean probability | accepted |\n|---|---:|---:|---:|")
    for lo, hi in zip(BINS, BINS[1:]):
        got = [(p, a) for p, a in rows if lo <= p < hi]
        if got:
            print(f"| {lo:.1f}-{min(hi, 1):.1f} | {len(got):,} | {sum(p for p, _ in got) / len(got):.3f} | "
                  f"{sum(a for _, a in got) / len(got):.3f} |")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
