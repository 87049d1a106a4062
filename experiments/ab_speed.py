"""Speed of one configuration against another, interleaved, as a ratio with a 95% paired-bootstrap interval
over questions (`specdec.metrics.speedup_ci`). A benchmark: run it on an idle machine.

    # compiled against eager torch-path greedy, in one process, turn by turn, order alternating
    python experiments/ab_speed.py compile --limit 6 --tokens 64 --reps 2
    # the same specdec.run in two source trees (e.g. a commit before a change), runs alternating
    python experiments/ab_speed.py trees OLD_DIR NEW_DIR --reps 3 -- strategy=greedy data.limit=6 ...
    # a shipped drafter's strategy (strategy/NAME.yaml) with its pass as one compiled call against the module
    # path (models/cpu_drafter.py), in one process, turn by turn, order alternating; questions from a jsonl file
    python experiments/ab_speed.py drafter eagle --data experiments/heldapart/human_heldapart.jsonl --limit 24

Prints B's tokens/s over A's (A: eager / OLD_DIR / the module path) and each side's tokens/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from specdec.metrics import speedup_ci


def _report(a: list[dict[str, Any]], b: list[dict[str, Any]], names: tuple[str, str]) -> None:
    """Whole turns (prefill + decode), then decode alone (tokens after the first over time after TTFT)."""
    def rate(rows: list[dict[str, Any]]) -> float:
        return sum(r["new_tokens"] for r in rows) / sum(r["wall_time_s"] for r in rows)

    def decode(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**r, "new_tokens": r["new_tokens"] - 1, "wall_time_s": r["wall_time_s"] - r["ttft_s"]} for r in rows]

    for label, ra, rb in (("turns", a, b), ("decode", decode(a), decode(b))):
        point = rate(rb) / rate(ra)
        lo, hi = speedup_ci(rb, ra, point) or (point, point)
        print(f"{label}: {names[0]} {rate(ra):.2f} tok/s, {names[1]} {rate(rb):.2f} tok/s over {len(ra)} turns; "
              f"{names[1]} / {names[0]}: {point:.3f}x (95% CI {lo:.3f}-{hi:.3f})")
    ttft = [sum(r["ttft_s"] for r in rows) / len(rows) * 1e3 for rows in (a, b)]
    print(f"mean TTFT: {names[0]} {ttft[0]:.1f} ms, {names[1]} {ttft[1]:.1f} ms")


def compile_ab(limit: int, tokens: int, reps: int) -> None:
    from specdec.data import default_suite
    from specdec.models.loader import load_model
    from specdec.strategies.base import GenerationParams
    from specdec.strategies.greedy import Greedy

    eager = load_model("smollm2-135m", "builtin:smollm2-135m", matmul="torch", compile=False)
    compiled = dataclasses.replace(eager, compile=True)  # same weights; the engine compiles its step
    sides = {"eager": Greedy(eager, "eager"), "compiled": Greedy(compiled, "compiled")}
    params = GenerationParams(max_new_tokens=tokens)
    prompts = [(q.question_id, eager.chat_ids([{"role": "user", "content": q.turns[0]}]))
               for q in default_suite()[:limit]]
    for s in sides.values():  # warm-up: allocator, kernels, first-call paths
        s.generate(prompts[0][1], params, 0)
    rows: dict[str, list[dict[str, Any]]] = {"eager": [], "compiled": []}
    for rep in range(reps):
        for i, (qid, prompt) in enumerate(prompts):
            order = ["eager", "compiled"] if (i + rep) % 2 == 0 else ["compiled", "eager"]
            outs = {}
            for name in order:
                res = sides[name].generate(prompt, params, 0)
                outs[name] = res.output_ids
                rows[name].append({"question_id": qid, "new_tokens": len(res.output_ids),
                                   "wall_time_s": res.wall_time_s, "ttft_s": res.ttft_s})
            print(f"rep {rep} {qid}: same tokens {outs['eager'] == outs['compiled']}", flush=True)
    _report(rows["eager"], rows["compiled"], ("eager", "compiled"))


def drafter_ab(name: str, data: str, limit: int, tokens: int, reps: int) -> None:
    from omegaconf import OmegaConf

    from specdec.cli_checks import group_config
    from specdec.data import load_jsonl
    from specdec.models.loader import load_model
    from specdec.run import build
    from specdec.strategies.base import GenerationParams

    target = load_model("smollm2-135m", "builtin:smollm2-135m", matmul="numba")
    cfg = OmegaConf.merge(OmegaConf.create({"model": {"name": "smollm2-135m"}}),
                          {"strategy": group_config("strategy", name)})
    sides = {side: build(cfg.strategy)(target=target, max_len=2048, prefill_chunk=512)
             for side in ("module", "one call")}
    module = sides["module"]
    if hasattr(module, "kernel"):  # EAGLE's proposer: its drafter's modules
        module.kernel = None
    else:  # a draft's engine: forward's last row
        module.drafter.engine.next_logits = lambda t, e=module.drafter.engine: e.forward(t).logits[-1]
    params = GenerationParams(max_new_tokens=tokens)
    prompts = [(q.question_id, target.chat_ids([{"role": "user", "content": q.turns[0]}]))
               for q in load_jsonl(data)[:limit]]
    for s in sides.values():  # warm-up: compilation, first-call paths, the schedules' start-up timing
        s.generate(prompts[0][1], params, 0)
    rows: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    for rep in range(reps):
        for i, (qid, prompt) in enumerate(prompts):
            order = list(sides) if (i + rep) % 2 == 0 else list(sides)[::-1]
            outs = {}
            for side in order:
                res = sides[side].generate(prompt, params, 0)
                outs[side] = res.output_ids
                rows[side].append({"question_id": f"{qid}/{rep}", "new_tokens": len(res.output_ids),
                                   "wall_time_s": res.wall_time_s, "ttft_s": res.ttft_s})
            print(f"rep {rep} {qid}: same tokens {outs['module'] == outs['one call']}", flush=True)
    _report(rows["module"], rows["one call"], (f"{name}, module path", f"{name}, one call"))


def trees_ab(old: Path, new: Path, reps: int, overrides: list[str]) -> None:
    rows: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            for side in (["old", "new"] if rep % 2 == 0 else ["new", "old"]):
                out = Path(tmp) / f"{side}{rep}"
                subprocess.run([sys.executable, "-m", "specdec.run", *overrides, f"output_dir={out}"],
                               cwd=old if side == "old" else new, check=True, capture_output=True)
                for line in (out / "answers.jsonl").read_text().splitlines():
                    r = json.loads(line)
                    rows[side].append({"question_id": f"{r['strategy']}/{r['question_id']}/{r['turn']}",
                                       "new_tokens": r["new_tokens"], "wall_time_s": r["wall_time_s"],
                                       "ttft_s": r["ttft_s"]})
                print(f"rep {rep} {side} done", flush=True)
    _report(rows["old"], rows["new"], (f"old ({old})", f"new ({new})"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    sub = p.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("compile")
    c.add_argument("--limit", type=int, default=6)
    c.add_argument("--tokens", type=int, default=64)
    c.add_argument("--reps", type=int, default=2)
    t = sub.add_parser("trees")
    t.add_argument("old", type=Path)
    t.add_argument("new", type=Path)
    t.add_argument("--reps", type=int, default=3)
    d = sub.add_parser("drafter")
    d.add_argument("strategy")
    d.add_argument("--data", default="experiments/heldapart/human_heldapart.jsonl")
    d.add_argument("--limit", type=int, default=24)
    d.add_argument("--tokens", type=int, default=128)
    d.add_argument("--reps", type=int, default=1)
    a, overrides = p.parse_known_args()  # after `--`: specdec.run's overrides
    if a.mode == "compile":
        compile_ab(a.limit, a.tokens, a.reps)
    elif a.mode == "drafter":
        drafter_ab(a.strategy, a.data, a.limit, a.tokens, a.reps)
    else:
        trees_ab(a.old.resolve(), a.new.resolve(), a.reps, [o for o in overrides if o != "--"])


if __name__ == "__main__":
    main()
