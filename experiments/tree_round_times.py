"""Where an EAGLE-2 round's time goes (strategy=eagle2 with the shipped drafter): the target pass, the drafter's
catch-up and expansion passes, the top-k reads, on first turns of the held-apart Magpie questions; then the
start-up pass-cost curve measured `curves` times in a row. A benchmark, not a test: run it on an idle machine.

    python experiments/tree_round_times.py [questions] [curves] [grow]
"""

from __future__ import annotations

import collections
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from heads.eagle import load_eagle
from specdec.engine.engine import pass_cost_curve
from specdec.models.loader import load_model
from specdec.strategies.base import GenerationParams
from specdec.strategies.eagle_tree import Eagle2, EagleTreeProposer

ROOT = Path(__file__).resolve().parents[1]
spent: dict[str, float] = collections.defaultdict(float)


def timed(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start
    return run


def main(questions: int = 12, curves: int = 6, grow: str = "useful") -> None:
    target = load_model("smollm2-135m", "builtin:smollm2-135m", matmul="numba")
    drafter = load_eagle(str(ROOT / "heads/checkpoints/smollm2-135m-eagle"), weights="int8")
    tree = Eagle2(target, "eagle2", drafter, depth=4, topk=4, nodes=8, size="cost", grow=grow)
    for name in ("propose", "_run", "_expand", "_children"):
        setattr(EagleTreeProposer, name, timed(name, getattr(EagleTreeProposer, name)))
    Eagle2._step = timed("target pass + verify", Eagle2._step)  # type: ignore[method-assign]
    rows = [json.loads(line) for line in (ROOT / "experiments/heldapart/magpie_heldapart.jsonl").open()][:questions]
    params = GenerationParams(max_new_tokens=128, eos_ids=tuple(target.eos_ids))
    tokens = rounds = 0
    for row in rows:
        tree.new_conversation()
        out = tree.generate(target.chat_ids([{"role": "user", "content": row["turns"][0]}]), params, 0)
        tokens, rounds = tokens + len(out.output_ids), rounds + (out.decode_steps or 0)
    print(f"{questions} first turns, {rounds} rounds, tau {tokens / rounds:.2f}; ms per round:")
    spent["catch-up"] = spent.pop("_run")
    for name, seconds in spent.items():
        print(f"  {name:22s} {seconds / rounds * 1e3:6.2f}")
    sizes = list(range(2, 10))
    for _ in range(curves):
        curve = pass_cost_curve(tree.engine, sizes, fresh=True)
        print("pass cost over n tokens / one:", " ".join(f"{n}:{curve[n]:.2f}" for n in sizes))


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]), *sys.argv[3:4])
