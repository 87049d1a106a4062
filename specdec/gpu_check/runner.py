"""The GPU check's runner: every case in isolation under a time budget, both result files rewritten as
each case ends, and the command line (`python -m specdec.gpu_check`)."""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import gc
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from specdec.engine.timing import clock
from specdec.gpu_check.correctness import (
    BATCHED,
    check_batched,
    check_distill,
    check_sampled_turns,
    check_sampling_rules,
    check_strategy,
    check_tree,
    strategy_names,
)
from specdec.gpu_check.models import SHAPES, Models, Options
from specdec.gpu_check.report import to_markdown
from specdec.gpu_check.speed import (
    DRAFTERS,
    speed_bandwidth,
    speed_batch,
    speed_decode,
    speed_drafting,
    speed_verification,
    speed_weights,
)

# compiled on a CPU by default: inductor there compiles each token bucket for tens of seconds
# (the tree/*/compiled cases still run a compiled tree pass)
CPU_COMPILED = ("greedy",)
STATUSES = ("passed", "failed", "error", "skipped")


class CaseTimeout(Exception):
    """A case ran past its time limit (--case-timeout-s, or what was left of --budget-s)."""


@dataclass
class Case:
    """One isolated check: `run` returns its figures; a "passed": False among them fails the case."""

    name: str
    run: Callable[[], dict[str, Any]]



def all_cases(models: Models) -> list[Case]:
    """Eager correctness first, then eager speed, then what compiles (slowest to start, least certain)."""
    opt = models.opt
    names = strategy_names()
    on = opt.compiled_strategies if opt.compiled_strategies is not None else names
    cases: list[Case] = []

    def add(name: str, fn: Callable[..., dict[str, Any]], *args: Any) -> None:
        cases.append(Case(name, partial(fn, models, *args)))

    for dtype in ("fp32", "bf16"):
        for s in names:
            add(f"correct/{dtype}/eager/{s}", check_strategy, s, dtype, False)
        add(f"tree/{dtype}/eager", check_tree, dtype, False)
    add("sampling/chi_square", check_sampling_rules)
    add("sampling/turns", check_sampled_turns)
    add("speed/weights", speed_weights)
    add("speed/bandwidth", speed_bandwidth)
    for d in ("greedy_eager", "hf_eager"):
        add(f"speed/decode/{d}", speed_decode, d)
    add("speed/verification/eager", speed_verification, opt.ks, False)
    for s in BATCHED:
        add(f"batch/fp32/{s}", check_batched, s, "fp32")
    for b in opt.batches:
        add(f"speed/batch/b{b}", speed_batch, b)
    for s in DRAFTERS:
        add(f"speed/drafting/{s}", speed_drafting, s)

    def compiled_correctness(dtype: str) -> None:
        for s in names:
            if s in on:
                add(f"correct/{dtype}/compiled/{s}", check_strategy, s, dtype, True)
        add(f"tree/{dtype}/compiled", check_tree, dtype, True)

    compiled_correctness("bf16")  # what a GPU runs by default
    add("distill/fp32/compiled", check_distill, "fp32")  # the drafters' training data, as a GPU makes it
    for d in ("greedy_compiled", "hf_static"):
        add(f"speed/decode/{d}", speed_decode, d)
    # a case per pass size: each compiles one more bucket, so a slow compile costs one point, not the curve
    for k in opt.ks:
        if k > 1:
            add(f"speed/verification/compiled/k{k}", speed_verification, [k], True)
    compiled_correctness("fp32")
    if opt.cases:
        cases = [c for c in cases if any(fnmatch.fnmatch(c.name, pat) for pat in opt.cases)]
    return [c for c in cases if not any(fnmatch.fnmatch(c.name, pat) for pat in opt.skip)]


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise CaseTimeout in the main thread after `seconds` (no limit elsewhere: signals need it)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise CaseTimeout(f"ran past its {seconds:.0f} s limit; raise --case-timeout-s or --budget-s")

    before = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def error_record(e: BaseException) -> dict[str, Any]:
    """The error as one line, and the innermost frames (file:line function) to find it by."""
    frames = traceback.extract_tb(e.__traceback__)[-4:]
    return {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}",
            "where": [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames]}


def _now(device: torch.device) -> float:
    try:
        return clock(device)
    except Exception:  # a failed case may leave the device unusable; the runner still times the rest
        return clock(None)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        try:
            torch.cuda.empty_cache()
        except Exception:  # a broken context is recorded by the next case that touches it
            pass


def run_cases(cases: list[Case], out: Path, meta: dict[str, Any], device: torch.device, budget_s: float,
              case_timeout_s: float, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every case in isolation, rewriting the json and md files after each one."""
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {**meta, "cases": {}, "finished": False}
    start = _now(device)
    for i, case in enumerate(cases):
        left = budget_s - (_now(device) - start)
        entry: dict[str, Any] = {"status": "skipped", "seconds": 0.0}
        if left <= 0:
            entry["error"] = f"time budget of {budget_s:.0f} s spent; rerun with --cases '{case.name}'"
        else:
            t0 = _now(device)
            try:
                with time_limit(min(case_timeout_s, left)):
                    figures = case.run()
                entry["status"] = "passed" if figures.get("passed", True) else "failed"
                entry["result"] = figures
            except Exception as e:  # isolate: record it, run the rest
                entry["status"] = "error"
                entry.update(error_record(e))
            finally:
                _release(device)
            entry["seconds"] = _now(device) - t0
        result["cases"][case.name] = entry
        result["summary"] = {s: sum(c["status"] == s for c in result["cases"].values()) for s in STATUSES}
        result["seconds"] = _now(device) - start
        result["finished"] = i == len(cases) - 1
        write(result, out)
        log(f"[{i + 1}/{len(cases)}] {case.name}: {entry['status']} ({entry['seconds']:.1f} s)"
            + (f" {entry['error']}" if "error" in entry else ""))
    if not cases:
        write(result, out)
    return result


def write(result: dict[str, Any], out: Path) -> None:
    """Replace both files whole, so a reader (or a run killed mid-write) never sees half of one."""
    for name, text in (("gpu_check.json", json.dumps(result, indent=2, default=str)),
                       ("gpu_check.md", to_markdown(result))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)


def parse(argv: list[str] | None) -> Options:
    usage = (sys.modules["specdec.gpu_check"].__doc__ or "").split("\n")[0]  # the package docstring's first line
    p = argparse.ArgumentParser(prog="python -m specdec.gpu_check", description=usage)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), help="speed cases' model: 8b (default on cuda) or tiny")
    p.add_argument("--out", default="experiments/gpu")
    p.add_argument("--check-tokens", type=int, help="tokens per correctness turn (cuda 32, cpu 12)")
    p.add_argument("--prompts", type=int, help="correctness prompts, at most 4 (cuda 4, cpu 2)")
    p.add_argument("--new-tokens", type=int, help="tokens per speed turn (8b 64, tiny 16)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--context", type=int, help="speed prompts' length and the verification context (8b 256, tiny 32)")
    p.add_argument("--ks", help="verification pass sizes (8b 1,2,4,8,16,32,64; tiny 1,2,4)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batches", help="slots of the batched speed cases (8b 1,4,16; tiny 1,4)")
    p.add_argument("--samples", type=int, default=2000, help="draws per chi-square test")
    p.add_argument("--sampling-seed", type=int, default=1234, help="the chi-square tests' generator seed")
    p.add_argument("--budget-s", type=float, help="stop starting cases after this many seconds (cuda 440)")
    p.add_argument("--case-timeout-s", type=float, default=240.0)
    p.add_argument("--compiled-strategies", help="'all' or a comma list (cuda all; cpu "
                   f"{','.join(CPU_COMPILED)})")
    p.add_argument("--cases", default="", help="comma list of fnmatch patterns, e.g. 'speed/*,tree/*'")
    p.add_argument("--skip", default="", help="comma list of fnmatch patterns of cases to leave out")
    a = p.parse_args(argv)
    cpu = not a.device.startswith("cuda")
    shape = a.shape or ("tiny" if cpu else "8b")
    big = shape != "tiny"
    compiled = a.compiled_strategies or ("all" if not cpu else ",".join(CPU_COMPILED))
    return Options(
        device=a.device, shape=shape, out=Path(a.out),
        check_tokens=a.check_tokens or (12 if cpu else 32), check_prompts=min(a.prompts or (2 if cpu else 4), 4),
        new_tokens=a.new_tokens or (64 if big else 16), rounds=a.rounds, speed_prompts=2,
        context=a.context or (256 if big else 32),
        ks=[int(k) for k in (a.ks or ("1,2,4,8,16,32,64" if big else "1,2,4")).split(",")], reps=a.reps,
        batches=[int(b) for b in (a.batches or ("1,4,16" if big else "1,4")).split(",")],
        samples=a.samples, sampling_seed=a.sampling_seed,
        budget_s=a.budget_s if a.budget_s is not None else (440.0 if not cpu else 900.0),
        case_timeout_s=a.case_timeout_s,
        compiled_strategies=None if compiled == "all" else tuple(compiled.split(",")),
        cases=tuple(c for c in a.cases.split(",") if c), skip=tuple(c for c in a.skip.split(",") if c))


def main(argv: list[str] | None = None) -> int:
    import transformers

    opt = parse(argv)
    if opt.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: no CUDA device visible; run on a GPU machine or pass --device cpu --shape tiny", file=sys.stderr)
        return 2
    dev = torch.device(opt.device)
    meta = {"command": " ".join(["python -m specdec.gpu_check", *(argv if argv is not None else sys.argv[1:])]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
            "transformers": transformers.__version__, "device": opt.device, "shape": opt.shape,
            "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU",
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "options": {k: v for k, v in dataclasses.asdict(opt).items() if k != "out"}}
    threads = torch.get_num_threads()
    if dev.type == "cpu" and opt.shape == "tiny":
        torch.set_num_threads(1)  # tiny matrices: threads only add OpenMP spinning on a shared CPU
    try:
        models = Models(opt)
        result = run_cases(all_cases(models), opt.out, meta, dev, opt.budget_s, opt.case_timeout_s)
    finally:
        torch.set_num_threads(threads)
    summary = result["summary"] if result["cases"] else "no cases"
    print(f"wrote {opt.out / 'gpu_check.md'} and gpu_check.json: {summary}")
    return 0 if result["cases"] and all(c["status"] == "passed" for c in result["cases"].values()) else 1
