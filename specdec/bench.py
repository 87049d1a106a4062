"""`python -m specdec.bench`: how close one decode step is to the hardware, and what verification costs.

Measures, in one process and interleaved where two things are compared:
- memory bandwidth and the bound it puts on one decode step: on a CPU the read bandwidth of a sum over
  a large buffer, on a GPU a device-to-device copy (each byte read and written once);
- our greedy against transformers `generate()` (`peers`: eager, and with a static cache plus
  torch.compile): tokens/s, ms per token, bytes of weights read per second as a fraction of the
  measured bandwidth (as gpt-fast reports), peak resident memory;
- the verification-cost curve: one target pass over k = 1, 2, 4, ... new tokens relative to k = 1;
- the drafting step of each listed strategy, as a fraction of a target step (the cost ratio that the
  analytic speedup needs).
A benchmark, not a test: run it on an otherwise idle machine. Every timer waits for the device's
queued work first (`specdec.engine.timing.clock`): CUDA kernels run asynchronously.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from specdec.cli_checks import CONFIG_DIR, group_config
from specdec.data import default_suite
from specdec.engine.engine import pass_times
from specdec.engine.timing import clock
from specdec.errors import SpecdecError
from specdec.models import cpu_kernels
from specdec.models.loader import LoadedModel
from specdec.provenance import cpu_name
from specdec.strategies.base import GenerationParams, Strategy, make_engine, torch_threads


def memory_bandwidth_gbs(mbytes: int = 256, reps: int = 5) -> float:
    """Best-of-reps read bandwidth of a reduction over a buffer far larger than the caches (CPU)."""
    buf = torch.ones(mbytes * 2**20 // 4)
    buf.sum()
    best = min(_timed(buf.sum, buf.device) for _ in range(reps))
    return buf.numel() * 4 / best / 1e9


def device_bandwidth_gbs(device: torch.device | str, mbytes: int = 2048, reps: int = 10) -> float:
    """The bound for a decode step on `device`: on a GPU, best-of-reps bandwidth of a device-to-device
    copy (bytes read plus bytes written, as HBM sees them); on a CPU, `memory_bandwidth_gbs`."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return memory_bandwidth_gbs()
    src = torch.ones(mbytes * 2**20 // 2, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: allocation and lazy init stay out of the timing
    best = min(_timed(lambda: dst.copy_(src), dev) for _ in range(reps))
    return 2 * src.nbytes / best / 1e9


def bandwidth_method(device: torch.device | str) -> str:
    return "device-to-device copy" if torch.device(device).type == "cuda" else "read (sum over a buffer)"


def _timed(fn: Any, device: torch.device | str | None = None) -> float:
    start = clock(device)
    fn()
    return clock(device) - start


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes one decode step reads: every weight once (tied matrices once), embeddings' one row aside."""
    seen: set[int] = set()
    total = 0
    for name, module in model.named_modules():
        panels = getattr(module, "panels", None)  # NumbaLinear: its panels are the matrix (`weight` is a copy)
        if panels is not None:
            tensors = [panels] + [t for t in (getattr(module, "bias", None),) if t is not None]
        else:
            tensors = [t for t in (getattr(module, "weight", None), getattr(module, "bias", None)) if t is not None]
        tensors += [t for t in (getattr(module, "weight_t", None),) if t is not None]  # NumpyLinear
        for t in tensors:
            key = t.__array_interface__["data"][0] if isinstance(t, np.ndarray) else t.data_ptr()
            if key in seen or name.endswith("embed"):
                continue
            seen.add(key)
            total += t.nbytes
    return total


def verification_curve(target: LoadedModel, ks: list[int], context: int, reps: int) -> dict[int, float]:
    """ms of one target pass over k new tokens after `context` cached tokens (median of reps, sizes interleaved)."""
    engine = make_engine(target, context + max(ks) + 1, 512)
    vocab = target.vocab_size
    ids = [(i * 7919) % (vocab - 1) + 1 for i in range(context)]
    with torch_threads(target.torch_threads), torch.inference_mode():
        return {k: t * 1e3 for k, t in pass_times(engine, ids, ks, reps).items()}


def compare_greedy(strategies: dict[str, Strategy], target: LoadedModel, prompts: list[list[int]],
                   params: GenerationParams, rounds: int) -> dict[str, dict[str, float]]:
    """Interleaved turns; tokens/s over all of them, ms per token over the decode phase."""
    totals = {name: {"tokens": 0, "wall": 0.0, "decode": 0.0, "steps": 0} for name in strategies}
    for r in range(rounds):
        for i, prompt in enumerate(prompts):
            order = list(strategies) if (i + r) % 2 == 0 else list(strategies)[::-1]
            for name in order:
                res = strategies[name].generate(prompt, params, 0)
                t = totals[name]
                t["tokens"] += len(res.output_ids)
                t["wall"] += res.wall_time_s
                t["decode"] += res.wall_time_s - res.ttft_s
                t["steps"] += len(res.output_ids) - 1
    return {name: {"tokens_per_s": t["tokens"] / t["wall"], "ms_per_token": 1e3 * t["decode"] / max(t["steps"], 1)}
            for name, t in totals.items()}


def drafting_cost(strategy: Strategy, prompts: list[list[int]], params: GenerationParams) -> dict[str, float]:
    """Mean time of one proposal and of one target decode step, from real turns."""
    draft, steps, decode = 0.0, 0, 0.0
    for prompt in prompts:
        res = strategy.generate(prompt, params, 0)
        draft += res.draft_time_s
        steps += res.decode_steps or 0
        decode += res.wall_time_s - res.ttft_s
    per_step = decode / max(steps, 1)
    per_draft = draft / max(steps, 1)
    return {"draft_ms": per_draft * 1e3, "step_ms": per_step * 1e3,
            "draft_to_step": per_draft / (per_step - per_draft) if per_step > per_draft else float("nan")}


def bench(cfg: DictConfig) -> dict[str, Any]:
    target: LoadedModel = instantiate(cfg.model)
    if not isinstance(target.model, torch.nn.Module) or target.backend != "compact":
        raise SpecdecError("specdec.bench measures our compact engine; use a Llama-family model")
    questions = default_suite(per_category=1, seed=int(cfg.prompt_seed))[: int(cfg.prompts)]
    prompts = [target.chat_ids([{"role": "user", "content": q.turns[0]}]) for q in questions]
    params = GenerationParams(int(cfg.new_tokens), eos_ids=())  # fixed length: no early EOS
    bandwidth = device_bandwidth_gbs(target.device)
    nbytes = weight_bytes(target.model)
    names = list(dict.fromkeys(["greedy", "hf_generate", *cfg.get("peers", [])]))
    peers: dict[str, Strategy] = {}
    for name in names:
        factory = instantiate(group_config("strategy", name))
        peers[name] = factory(target=target, max_len=int(cfg.max_len), prefill_chunk=512)
    # warm-up; a compiled peer compiles its decode step (one shape) and captures its graphs here
    compare_greedy(peers, target, prompts[:1], GenerationParams(8, eos_ids=()), 1)
    speed = compare_greedy(peers, target, prompts, params, int(cfg.rounds))
    for s in speed.values():
        s["weights_gb_per_s"] = nbytes / (s["ms_per_token"] / 1e3) / 1e9
        s["fraction_of_bandwidth"] = s["weights_gb_per_s"] / bandwidth
    curve = verification_curve(target, list(cfg.ks), int(cfg.context), int(cfg.reps))
    drafts: dict[str, dict[str, float]] = {}
    for name in cfg.strategies:
        scfg = group_config("strategy", name)  # with its defaults list, as a run composes it
        try:
            root = OmegaConf.create({"model": OmegaConf.to_container(cfg.model), "_s": scfg})
            factory = instantiate(root._s)  # resolves ${model.*} as in a run
            drafts[name] = drafting_cost(factory(target=target, max_len=int(cfg.max_len), prefill_chunk=512),
                                         prompts, params)
        except Exception as e:  # e.g. a draft or heads not trained yet: report it, measure the rest
            drafts[name] = {"error": " ".join(str(e).split())[:200]}  # type: ignore[dict-item]
    return {
        "model": target.name, "dtype": str(target.dtype).removeprefix("torch."),
        "matmul": target.matmul, "threads": torch.get_num_threads(), "cpu": cpu_name(),
        "kernels": cpu_kernels.describe() if target.matmul == "numba" else None,
        "device": str(target.device), "bandwidth_method": bandwidth_method(target.device),
        "memory_bandwidth_gb_per_s": bandwidth, "weight_bytes": nbytes,
        "bandwidth_bound_ms_per_token": nbytes / bandwidth / 1e6,
        "greedy_vs_hf": speed,
        "speedup_greedy_over_hf": speed["greedy"]["tokens_per_s"] / speed["hf_generate"]["tokens_per_s"],
        "speedup_greedy_over": {n: speed["greedy"]["tokens_per_s"] / s["tokens_per_s"]
                                for n, s in speed.items() if n != "greedy"},
        "verification_ms": curve, "verification_ratio": {k: v / curve[cfg.ks[0]] for k, v in curve.items()},
        "drafting": drafts, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "command": " ".join(["python -m specdec.bench", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def to_markdown(r: dict[str, Any]) -> str:
    layout = f", kernel layout {r['kernel_layout']}" if r.get("kernel_layout") else ""  # records before the tiles
    layout += f", kernels {r['kernels']}" if r.get("kernels") else ""
    lines = [f"# specdec.bench: {r['model']} ({r['dtype']}, matmul {r['matmul']}{layout}, {r['threads']} threads)", "",
             f"`{r['command']}` on {r['date']}" + (f", {r['cpu']}" if r.get("cpu") else ""), "",
             f"- memory bandwidth {r['memory_bandwidth_gb_per_s']:.1f} GB/s "
             f"({r.get('bandwidth_method', 'read (sum over a buffer)')}); weights read per step "
             f"{r['weight_bytes'] / 1e6:.0f} MB; bound {r['bandwidth_bound_ms_per_token']:.3g} ms/token",
             f"- peak resident memory {r['peak_rss_mb']:.0f} MB", "",
             "| decoder | tokens/s | ms/token | GB/s of weights | of bandwidth |", "|---|---|---|---|---|"]
    for name, s in r["greedy_vs_hf"].items():
        lines.append(f"| {name} | {s['tokens_per_s']:.2f} | {s['ms_per_token']:.2f} | {s['weights_gb_per_s']:.1f} | "
                     f"{s['fraction_of_bandwidth']:.0%} |")
    lines += [""]
    for name, x in r.get("speedup_greedy_over", {"hf_generate": r["speedup_greedy_over_hf"]}).items():
        lines.append(f"- greedy / {name}: **{x:.2f}x**")
    lines += ["", "| k new tokens | ms per pass | relative to k=1 |", "|---|---|---|"]
    for k, ms in r["verification_ms"].items():
        lines.append(f"| {k} | {ms:.1f} | {r['verification_ratio'][k]:.2f} |")
    lines += ["", "| strategy | drafting ms/step | target step ms | draft / target |", "|---|---|---|---|"]
    for name, d in r["drafting"].items():
        if "error" in d:
            lines.append(f"| {name} | not run: {d['error']} | | |")
        else:
            lines.append(f"| {name} | {d['draft_ms']:.2f} | {d['step_ms']:.1f} | {d['draft_to_step']:.3f} |")
    return "\n".join(lines) + "\n"


@hydra.main(version_base=None, config_path=str(CONFIG_DIR), config_name="bench")
def main(cfg: DictConfig) -> None:
    try:
        result = bench(cfg)
    except SpecdecError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=2, default=str))
    text = to_markdown(result)
    (out / "bench.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
