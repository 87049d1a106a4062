"""Self-distillation data: prompts built like the offline suite, optionally general chat instructions
(`heads/instruction_prompts.py`), and the target's own greedy continuations, generated in left-padded
batches (specdec's compact model, else transformers).

No prompt shares a 13-word n-gram with an evaluation question shipped in the repository (the default
suite, experiments/data/*.jsonl; heads/contamination.py): the suite's passages are shared between its
categories, so a prompt built on an evaluation question's passage under another template is dropped,
and the builder checks its output before returning it.

The result is a `datasets.Dataset` with `input_ids` (prompt + continuation), `labels` (the next
token at every position, -100 over the prompt and the last position) and `prompt_len`, cached with
`save_to_disk` in chunks under SPECDEC_CACHE/distill/MODEL-KEY/. Each chunk is saved as soon as it
is generated, so an interrupted run resumes where it stopped, and a time budget bounds the whole.
With the compact model each chunk also keeps the target's hidden states of its tokens (`hidden.npy`),
which the drafters' losses read, so training needs no second pass over the data.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from heads.batch_generate import generate_with_hidden
from heads.contamination import EvalIndex, check_clean, evaluation_turns
from heads.instruction_prompts import instruction_prompts
from heads.prompt_sources import Prompt
from specdec.data import default_suite
from specdec.errors import SpecdecError
from specdec.models.cache import cache_root
from specdec.models.loader import LoadedModel
from specdec.strategies.base import torch_threads as torch_threads_ctx

VERSION = 2  # bump when the format or the generation changes
AUTO_BATCH_CPU = 64
# On an H200 a 135M target's batched step is bound by the host's kernel launches up to about here: 256 rows
# gave 2.8x the prompts/s of 64 (experiments/gpu/generation_profile.py; notebook, 2026-12-04, afternoon).
AUTO_BATCH_CUDA = 256
AUTO_PROMPT_BOUND = 1024  # the prompt length `auto` sizes the CUDA batch for


def distill_prompts(per_category: int, seeds: list[int], exclude_per_category: int, exclude_seed: int,
                    max_prompts: int | None = None, instructions: int = 0) -> list[str]:
    """First turns of default_suite(per_category, seed) for each seed, deduplicated, plus `instructions`
    general chat instructions, all interleaved so that `max_prompts` or a time budget keeps a mix.

    Held out: every prompt sharing a 13-word n-gram with a turn of default_suite(exclude_per_category,
    exclude_seed) (which covers the benchmark's default_suite(10, 0)) or of experiments/data/*.jsonl is
    left out; the result is checked again before it is returned."""
    if exclude_seed in seeds:
        raise SpecdecError(f"data.seeds={list(seeds)} includes the benchmark seed {exclude_seed}; use other seeds")
    index = EvalIndex(evaluation_turns(exclude_per_category, exclude_seed))
    by_category: dict[str, list[str]] = defaultdict(list)
    seen: set[str] = set()
    for seed in seeds:
        for q in default_suite(per_category=per_category, seed=seed):
            first = q.turns[0]
            if first not in seen and index.clean(first):
                seen.add(first)
                by_category[q.category].append(first)
    if instructions:
        made = instruction_prompts(instructions, seed=seeds[0], exclude=[t.text for t in index.turns])
        by_category["instructions"] = [p for p in made if p not in seen]
    lists = list(by_category.values())
    mixed = [lst[i] for i in range(max(map(len, lists), default=0)) for lst in lists if i < len(lst)]
    mixed = mixed[:max_prompts] if max_prompts else mixed
    check_clean(mixed, index)
    return mixed


def greedy_continuations(target: LoadedModel, prompts: list[list[int]], max_new_tokens: int,
                         batch_size: int) -> list[list[int]]:
    """The target's greedy continuation of each prompt (ending at its first end-of-turn token)."""
    from transformers import GenerationConfig

    model = target.hf_model()
    eos = list(target.eos_ids)
    pad = target.tokenizer.pad_token_id
    pad = pad if pad is not None else (eos[0] if eos else 0)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None,
                              top_k=None, eos_token_id=eos or None, pad_token_id=pad)
    out: list[list[int]] = [[] for _ in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths pad less
    for s in range(0, len(order), batch_size):
        idx = order[s:s + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):  # left padding: every prompt ends where generation starts
            ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]):] = 1
        with torch.inference_mode():
            gen = model.generate(ids.to(model.device), attention_mask=mask.to(model.device), generation_config=config)
        for row, i in enumerate(idx):
            cont = gen[row, width:].tolist()
            cut = next((j + 1 for j, t in enumerate(cont) if t in eos), len(cont))
            out[i] = cont[:cut]
    return out


def to_example(prompt: list[int], continuation: list[int]) -> dict[str, Any]:
    seq = prompt + continuation
    labels = [-100] * len(seq)
    for t in range(len(prompt) - 1, len(seq) - 1):  # learn the continuation: the token after each position
        labels[t] = seq[t + 1]
    return {"input_ids": seq, "labels": labels, "prompt_len": len(prompt)}


def _key(target: LoadedModel, prompts: Sequence[Prompt], max_new_tokens: int, chunk: int) -> str:
    text = "\0".join(p if isinstance(p, str) else json.dumps(p, sort_keys=True) for p in prompts)
    spec = {"v": VERSION, "model": target.folder.name, "dtype": str(target.dtype), "backend": target.backend,
            "max_new_tokens": max_new_tokens, "chunk": chunk,
            "prompts": hashlib.sha256(text.encode()).hexdigest()}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


@dataclass
class DistillSet:
    data: Any  # datasets.Dataset: input_ids, labels, prompt_len (+ hidden_start when hidden is set)
    # (rows, D) float16 memory map: the target's hidden states of example j's tokens are rows
    # hidden_start[j] .. hidden_start[j] + len(input_ids[j]); None when generated without them
    hidden: np.ndarray | None = None
    minutes: float = 0.0  # generation time summed over every run that built this set


def generation_batch(batch_size: int | str, target: LoadedModel, max_new_tokens: int) -> int:
    """`data.batch_size`: an int as given; `auto`: 64 on the CPU (its kernels run at most CPU_SLOTS at once);
    on a GPU, 256, halved until a batch's KV cache and hidden states for prompts of up to 1,024 tokens
    take at most half the free device memory (at least 16)."""
    if batch_size != "auto":
        if (isinstance(batch_size, str) and not batch_size.isdigit()) or int(batch_size) < 1:
            raise SpecdecError(f"data.batch_size={batch_size!r}; use a positive integer or auto")
        return int(batch_size)
    args = getattr(target.model, "args", None)
    if target.device.type != "cuda" or args is None:
        return AUTO_BATCH_CPU
    elem = torch.finfo(target.dtype).bits // 8
    length = AUTO_PROMPT_BOUND + max_new_tokens
    per_row = length * (2 * args.n_layers * args.n_kv_heads * args.head_dim * elem + 2 * args.dim)
    free, _ = torch.cuda.mem_get_info(target.device)
    batch = AUTO_BATCH_CUDA
    while batch > 16 and batch * per_row > free // 2:
        batch //= 2
    return batch


def _generate_chunk(target: LoadedModel, ids: list[list[int]], max_new_tokens: int, batch_size: int,
                    folder: Path) -> None:
    """Generate one chunk and save it into `folder` (written under a temporary name, then renamed,
    so a chunk on disk is always complete)."""
    import datasets

    tmp = folder.parent / f".tmp-{folder.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    if target.backend == "compact":
        gens = generate_with_hidden(target, ids, max_new_tokens, batch_size)
        rows = [to_example(p, g.continuation) for p, g in zip(ids, gens)]
        datasets.Dataset.from_list(rows).save_to_disk(str(tmp))
        np.save(tmp / "hidden.npy", np.concatenate([g.hidden for g in gens]))
    else:
        conts = greedy_continuations(target, ids, max_new_tokens, batch_size)
        datasets.Dataset.from_list([to_example(p, q) for p, q in zip(ids, conts)]).save_to_disk(str(tmp))
    tmp.rename(folder)


def _joined_hidden(folder: Path, parts: list[Path], lengths: list[int]) -> np.ndarray | None:
    """One memory-mapped array of every part's hidden states (built once per set of parts)."""
    if not all((p / "hidden.npy").is_file() for p in parts):
        return None
    path = folder / f"hidden-{len(parts)}.npy"
    if not path.is_file():
        pieces = [np.load(p / "hidden.npy", mmap_mode="r") for p in parts]
        if sum(x.shape[0] for x in pieces) != sum(lengths):
            raise SpecdecError(f"hidden states in {folder} do not match its tokens; delete the folder to regenerate")
        return concat_memmap(path, pieces)
    return np.load(path, mmap_mode="r")


def concat_memmap(path: Path, pieces: Sequence[np.ndarray]) -> np.ndarray:
    """(rows_i, D) arrays stacked into one float16 memory map at `path` (written under a temporary name,
    then renamed, so a file there is always whole)."""
    tmp = path.with_suffix(".tmp.npy")
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16,
                                    shape=(sum(x.shape[0] for x in pieces), pieces[0].shape[1]))
    row = 0
    for x in pieces:
        out[row:row + x.shape[0]] = x
        row += x.shape[0]
    out.flush()
    del out
    tmp.rename(path)
    return np.load(path, mmap_mode="r")


def build_distill_dataset(target: LoadedModel, per_category: int = 70, seeds: tuple[int, ...] = (1, 2, 3),
                          exclude_per_category: int = 20, exclude_seed: int = 0, max_prompts: int | None = None,
                          instructions: int = 0, max_new_tokens: int = 128, batch_size: int | str = 32,
                          chunk_batches: int = 2, max_minutes: float | None = None, torch_threads: int | None = 1,
                          cache_dir: str | None = None, log: Any = print,
                          prompts: Sequence[Prompt] | None = None) -> DistillSet:
    """The distillation set for `target`; see the module docstring.

    Prompts are generated chunk by chunk (chunk_batches batches), each chunk saved with save_to_disk
    as soon as it is done. `max_minutes` caps the generation time summed over every run with these
    settings: once spent, the chunks done so far are the dataset, so reruns see the same data; raising
    it later generates more. Generation runs with `torch_threads` threads: on a busy 2-core machine
    two spinning OpenMP workers made each decode step many times slower, one thread loses little.

    `prompts`, when given, replaces the built-in ones (per_category, seeds, max_prompts and
    instructions are then unused): strings are single user turns, message lists whole conversations
    ending in a user turn (heads/prompt_sources.py, which also decontaminates them).
    """
    import datasets

    if prompts is None:
        prompts = distill_prompts(per_category, list(seeds), exclude_per_category, exclude_seed, max_prompts,
                                  instructions)
    if not prompts:
        raise SpecdecError("no distillation prompts left after excluding the benchmark; raise data.per_category")
    batch_size = generation_batch(batch_size, target, max_new_tokens)
    root = Path(cache_dir).expanduser() if cache_dir else cache_root() / "distill"
    folder = root / f"{target.name}-{_key(target, prompts, max_new_tokens, batch_size * chunk_batches)}"
    folder.mkdir(parents=True, exist_ok=True)
    progress_file = folder / "progress.json"
    spent = json.loads(progress_file.read_text())["seconds"] if progress_file.is_file() else 0.0
    budget = float("inf") if max_minutes is None else max_minutes * 60
    ids: list[list[int]] | None = None
    chunk = batch_size * chunk_batches
    parts: list[Path] = []
    for c, s in enumerate(range(0, len(prompts), chunk)):
        part = folder / f"chunk-{c:04d}"
        if not (part / "dataset_info.json").is_file():
            if spent >= budget:
                log(f"distill: generation budget of {max_minutes} min spent; training on {s} of {len(prompts)} "
                    "prompts (raise data.max_minutes for more)")
                break
            ids = ids or [target.chat_ids([{"role": "user", "content": p}] if isinstance(p, str) else p)
                          for p in prompts]
            start = time.perf_counter()
            with torch_threads_ctx(torch_threads):
                _generate_chunk(target, ids[s:s + chunk], max_new_tokens, batch_size, part)
            spent += time.perf_counter() - start
            progress_file.write_text(json.dumps({"seconds": spent}))
            log(f"distill: {min(s + chunk, len(prompts))}/{len(prompts)} prompts, {spent / 60:.1f} min")
        parts.append(part)
    if not parts:
        raise SpecdecError(f"no distillation data in {folder} and data.max_minutes={max_minutes} leaves no time to "
                           "generate any; raise data.max_minutes")
    data = datasets.concatenate_datasets([datasets.load_from_disk(str(p)) for p in parts])
    lengths = [len(x) for x in data["input_ids"]]
    hidden = _joined_hidden(folder, parts, lengths)
    if hidden is not None:
        data = data.add_column("hidden_start", np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist())
    return DistillSet(data, hidden, spent / 60)
