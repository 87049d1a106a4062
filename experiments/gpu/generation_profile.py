"""Where the distillation's batched generation spends its time on a GPU (heads/batch_generate.py's
left-padded loop), on random weights in SmolLM2-135M's shape, so no model file has to travel.

    python experiments/gpu/generation_profile.py [--device cuda] [--batches 64,256] [--loops eager,compiled] [--out DIR]

Prints seconds per batch and milliseconds per decoding step for each loop and batch size (prompts of 40-200
random tokens, 128 new tokens: random weights never end early): `eager` steps, and `compiled` static-shape
steps (what a GPU target runs by default; traced before the timing), then torch.profiler's top operators
for a short batch of the first loop, by device time and by host time.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import replace
from pathlib import Path

import torch

from heads.batch_generate import _generate_batch
from specdec.gpu_check.models import random_llama

SMOLLM2_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "vocab_size": 49152, "rope_theta": 100000.0,
                "max_position_embeddings": 8192, "rms_norm_eps": 1e-5}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (a quick CPU try)")
    ap.add_argument("--loops", default="eager,compiled")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    shape = dict(SMOLLM2_135M, num_hidden_layers=a.layers or SMOLLM2_135M["num_hidden_layers"])
    target = random_llama(shape, a.device, torch.float32, keep_hf=False)
    loops = {name: replace(target, compile=name == "compiled") for name in a.loops.split(",")}
    rng = random.Random(0)
    sizes = [int(b) for b in a.batches.split(",")]
    prompts = [[rng.randrange(3, shape["vocab_size"]) for _ in range(rng.randint(40, 200))] for _ in range(max(sizes))]
    lines = [f"device {a.device}; torch {torch.__version__}; {shape['num_hidden_layers']} layers, fp32, "
             f"{a.new_tokens} new tokens"]
    for name, model in loops.items():
        for B in sizes:
            batch = sorted(prompts[:B], key=len)
            _generate_batch(model, batch, 4)  # warm-up; the compiled loop traces this batch's graph
            sync(a.device)
            t0 = time.perf_counter()
            _generate_batch(model, batch, a.new_tokens)
            sync(a.device)
            s = time.perf_counter() - t0
            lines.append(f"{name} B={B}: {s:.2f} s per batch, {1000 * s / (a.new_tokens + 1):.1f} ms per step, "
                         f"{B / s:.1f} prompts/s")
            print(lines[-1], flush=True)
    target = next(iter(loops.values()))
    acts = [torch.profiler.ProfilerActivity.CPU]
    if a.device == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        _generate_batch(target, sorted(prompts[:sizes[0]], key=len), 16)
        sync(a.device)
    table = prof.key_averages()
    if a.device == "cuda":
        lines += ["", "by device time:", table.table(sort_by="self_cuda_time_total", row_limit=15)]
    lines += ["", "by host time:", table.table(sort_by="self_cpu_time_total", row_limit=15)]
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "generation_profile.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
