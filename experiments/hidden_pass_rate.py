"""Would committed distilled tokens pay? Recomputing the target's hidden states from tokens, against the
distillation that made them.

    python experiments/hidden_pass_rate.py CACHE_FOLDER [CACHE_FOLDER ...] [--rows 128]

Each CACHE_FOLDER is a distillation cache folder (heads/distill_data.py: chunk-*/ and progress.json). Printed:
its sequences, tokens (prompts and continuations), the tokens' size as compressed uint16, and its generation
seconds. Then the batched hidden-state pass (heads.batches.target_hidden) timed over the first folder's
longest chunk's first `--rows` rows, sorted by length, for fp32 (numba kernels, torch) and bf16 (torch) at
several batch sizes. Each rate gives the minutes needed for every folder's tokens, as a share of their
generation time.
"""

from __future__ import annotations

import argparse
import io
import json
import time
from pathlib import Path

import numpy as np
import torch

from heads.batches import target_hidden
from specdec.models import load_model

SETTINGS = (("fp32", "numba", (8,)), ("fp32", "torch", (8,)), ("bf16", "torch", (8, 16, 32, 64)))


def folder_stats(folder: Path) -> tuple[list[list[int]], float, float]:
    """(every sequence's tokens, their compressed uint16 size in MB, the generation seconds)."""
    import datasets

    parts = sorted(folder.glob("chunk-*"))
    data = datasets.concatenate_datasets([datasets.load_from_disk(str(p)) for p in parts])
    ids = data["input_ids"]
    buf = io.BytesIO()
    np.savez_compressed(buf, tokens=np.concatenate([np.asarray(x, np.uint16) for x in ids]),
                        lengths=np.array([len(x) for x in ids], np.int32),
                        prompt_lens=np.array(data["prompt_len"], np.int32))
    return ids, buf.tell() / 1e6, json.loads((folder / "progress.json").read_text())["seconds"]


def rate(rows: list[list[int]], dtype: str, matmul: str, batch: int) -> float:
    """Tokens per second of target_hidden over `rows` (sorted by length) in right-padded batches."""
    model = load_model("smollm2-135m", "builtin:smollm2-135m", dtype=dtype, device="cpu", matmul=matmul)
    n, start = 0, time.perf_counter()
    for s in range(0, len(rows), batch):
        part = rows[s:s + batch]
        ids = torch.zeros(len(part), max(map(len, part)), dtype=torch.long)  # (B, T)
        for b, r in enumerate(part):
            ids[b, :len(r)] = torch.tensor(r)
        with torch.inference_mode():
            target_hidden(model, ids, torch.ones_like(ids))
        n += sum(map(len, part))
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--rows", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(2)
    tokens, seconds, first = 0, 0.0, None
    for folder in args.folders:
        ids, mb, secs = folder_stats(folder)
        n = sum(map(len, ids))
        tokens, seconds = tokens + n, seconds + secs
        first = first or folder
        print(f"{folder.name}: {len(ids)} sequences, {n} tokens, {mb:.2f} MB as uint16, generated in {secs:.0f} s")
    print(f"all: {tokens} tokens, generated in {seconds:.0f} s ({seconds / 60:.1f} min)")
    import datasets

    chunk = max(sorted(first.glob("chunk-*")), key=lambda p: datasets.load_from_disk(str(p)).num_rows)
    rows = sorted(datasets.load_from_disk(str(chunk))["input_ids"][:args.rows], key=len)
    for dtype, matmul, batches in SETTINGS:
        for batch in batches:
            r = rate(rows, dtype, matmul, batch)
            minutes = tokens / r / 60
            print(f"{dtype} {matmul} batch {batch}: {r:.0f} tokens/s -> {minutes:.1f} min, "
                  f"{minutes * 60 / seconds:.2f} of the distillation")


if __name__ == "__main__":
    main()
