"""The trainer's batches: length-bucketed micro-batches, right-padded collation, and the frozen target's
hidden states (computed once and kept on disk, or saved by distillation) that the losses read."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Sampler

from specdec.models.loader import LoadedModel


class LengthBatches(Sampler[list[int]]):
    """Batches of similar lengths (less padding), in an order fixed by (seed, epoch): a resumed run
    skips exactly the (micro-)batches it had trained on.

    With `split` > 1 (gradient accumulation) the batches are drawn at batch_size x split sequences and
    each is cut into `split` consecutive micro-batches of batch_size, so that the optimizer steps see
    the sequences one batch of batch_size x split would: `batch_size=4 grad_accum=2` trains like
    `batch_size=8`. Accelerate steps after every `split` micro-batches and at the end of the data, so
    every batch but the last must give exactly `split`: the short batches (one per pool) are joined
    and cut again at the end of the epoch.
    """

    def __init__(self, lengths: list[int], batch_size: int, seed: int, epoch: int, skip: int = 0,
                 pool: int = 50, split: int = 1) -> None:
        g = torch.Generator().manual_seed(seed * 100_003 + epoch)
        perm = torch.randperm(len(lengths), generator=g).tolist()
        batches: list[list[int]] = []
        size = batch_size * split
        span = size * pool
        for s in range(0, len(perm), span):
            group = sorted(perm[s:s + span], key=lambda i: lengths[i])
            batches += [group[j:j + size] for j in range(0, len(group), size)]
        if split > 1:
            rest = sorted((i for b in batches if len(b) < size for i in b), key=lambda i: lengths[i])
            batches = [b for b in batches if len(b) == size]
            order = torch.randperm(len(batches), generator=g).tolist()
            batches = [batches[i] for i in order] + [rest[j:j + size] for j in range(0, len(rest), size)]
        else:
            order = torch.randperm(len(batches), generator=g).tolist()
            batches = [batches[i] for i in order]
        micro = [b[j:j + batch_size] for b in batches for j in range(0, len(b), batch_size)]
        self.batches = micro[skip:]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def collate(rows: list[dict[str, Any]], seq_len: int, pad_id: int, store: HiddenStore | None = None
            ) -> dict[str, Tensor]:
    """Right-padded (B, T) input_ids, labels (-100 on padding) and attention_mask; `hidden` (B, T, D)
    from `store` when the rows carry a `hidden_row`.

    A sequence longer than seq_len keeps its last seq_len tokens: the start of the prompt is cut, never
    the continuation the labels are on.
    """
    T = min(seq_len, max(len(r["input_ids"]) for r in rows))
    B = len(rows)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    labels = torch.full((B, T), -100, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.long)
    for b, r in enumerate(rows):
        n = min(T, len(r["input_ids"]))
        ids[b, :n] = torch.tensor(r["input_ids"][-n:])
        labels[b, :n] = torch.tensor(r["labels"][-n:])
        mask[b, :n] = 1
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    if store is not None and "hidden_row" in rows[0]:
        hidden = torch.zeros((B, T, store.dim), dtype=torch.float32)  # (B, T, D)
        for b, r in enumerate(rows):
            n = min(T, len(r["input_ids"]))
            end = r["hidden_row"] + min(store.seq_len, len(r["input_ids"]))
            hidden[b, :n] = torch.from_numpy(store.rows[end - n:end].astype("float32"))
        batch["hidden"] = hidden
    return batch


class NoCache:
    """Stands in for the KV cache in a training forward: attention over the batch's own tokens."""

    def reserve(self, n_new: int) -> None:
        pass

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return k, v

    def advance(self, n_new: int) -> None:
        pass


@torch.no_grad()
def target_hidden(target: LoadedModel, input_ids: Tensor, attention_mask: Tensor,
                  taps: tuple[int, ...] = ()) -> Tensor:
    """(B, T, D) final-norm hidden states of the frozen target for right-padded input_ids; with `taps`,
    the residual stream entering each of those layers follows in the same rows: (B, T, (1 + len(taps)) D)."""
    input_ids = input_ids.to(target.device)
    if target.backend == "compact":
        B, T = input_ids.shape
        pos = torch.arange(T, device=target.device).expand(B, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=target.device).tril()[None, None]  # (1, 1, T, T)
        if taps:
            _, h, seen = target.model.forward_tapped(input_ids, pos, NoCache(), causal, T, taps)
            return torch.cat([h, seen], -1).float()
        _, h = target.model(input_ids, pos, NoCache(), causal, logits_from=T)
        return h.float()
    out = target.model(input_ids=input_ids, attention_mask=attention_mask.to(target.device),
                       output_hidden_states=True)
    # hidden_states[i] is layer i's input (hidden_states[0] the embeddings), the last one the final norm's output
    return torch.cat([out.hidden_states[-1], *(out.hidden_states[i] for i in taps)], -1).float()


def hidden_taps(trainable: Any, target: LoadedModel) -> tuple[int, ...]:
    """The target layers whose inputs `trainable` reads beside the final state (EAGLE-3's), else ()."""
    taps = getattr(trainable, "target_taps", None)
    return tuple(taps(target)) if taps is not None else ()


@dataclass
class HiddenStore:
    """The target's hidden states of a whole dataset, fp16, as one flat (rows, D) memory-mapped array.

    Example j owns rows hidden_row[j] .. hidden_row[j] + min(seq_len, len(input_ids[j])): the states of
    its last seq_len tokens, the ones collate keeps. A flat array rather than an Arrow column of nested
    lists, because converting 3M floats per batch to and from Python lists cost seconds per step.
    """

    rows: Any  # numpy.memmap (N, D) float16
    seq_len: int

    @property
    def dim(self) -> int:
        return int(self.rows.shape[1])


def with_cached_hidden(data: Any, target: LoadedModel, seq_len: int, batch_size: int,
                       folder: Path | None = None, taps: tuple[int, ...] = ()) -> tuple[Any, HiddenStore]:
    """Compute the target's hidden states (with `taps`, those layers' inputs too; see target_hidden) once
    (resumable across reruns only as a whole: the file is complete or rebuilt), store them next to the
    dataset; returns the data with a `hidden_row` column."""
    if folder is None and data.cache_files:
        folder = Path(data.cache_files[0]["filename"]).parent
    lengths = [min(seq_len, len(x)) for x in data["input_ids"]]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    D = target.hidden_size * (1 + len(taps))
    tapped = f"-taps{'.'.join(map(str, taps))}" if taps else ""  # the untapped key as before: its files stay valid
    key = hashlib.sha256(f"{data._fingerprint}-{target.folder.name}-{seq_len}{tapped}".encode()).hexdigest()[:16]
    path = (folder or Path(os.environ.get("TMPDIR", "/tmp"))) / f"hidden-{key}.f16"
    done = path.with_suffix(".done")
    shape = (int(offsets[-1]), D)
    if not done.exists():
        rows = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=shape)
        order = sorted(range(len(lengths)), key=lengths.__getitem__)  # similar lengths: little padding
        for s in range(0, len(order), batch_size):
            idx = order[s:s + batch_size]
            batch = collate([data[i] for i in idx], seq_len, 0)
            h = target_hidden(target, batch["input_ids"], batch["attention_mask"], taps).half().cpu().numpy()
            for b, i in enumerate(idx):
                rows[offsets[i]:offsets[i + 1]] = h[b, :lengths[i]]
            if s // batch_size % 20 == 0:
                print(f"target hidden states: {s + len(idx)}/{len(order)}", flush=True)
        rows.flush()
        del rows
        done.write_text("ok\n")
    store = HiddenStore(np.load(path, mmap_mode="r"), seq_len)
    return data.add_column("hidden_row", offsets[:-1].tolist()), store


def with_generated_hidden(data: Any, hidden: Any, seq_len: int) -> tuple[Any, HiddenStore]:
    """The store over hidden states saved at generation time, where example j's tokens own rows
    hidden_start[j] ..; `hidden_row` points at the last seq_len of them, as collate expects."""
    rows = [s + n - min(seq_len, n) for s, n in zip(data["hidden_start"], map(len, data["input_ids"]))]
    return data.add_column("hidden_row", rows), HiddenStore(hidden, seq_len)
