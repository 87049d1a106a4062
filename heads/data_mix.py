"""Training data from several prompt sources at once: `data.source=[builtin, FILE, HUB_ID, ...]`.

Each source is distilled on its own (heads/distill_data.py: its own cache folder, its own generation
budget of data.max_minutes), so adding a source to a mix reuses what the others already generated.
`builtin` names the built-in prompts (data.per_category, seeds, instructions); any other entry is a
`datasets` source read by heads/prompt_sources.py with the run's data.split/field/turns/shuffle.
The joined set keeps every source's examples in the order listed; hidden states, when every source
has them, are joined once into one memory map under the cache root.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from heads.distill_data import DistillSet, build_distill_dataset, concat_memmap
from heads.prompt_sources import source_prompts
from specdec.errors import SpecdecError
from specdec.models.loader import LoadedModel

BUILTIN = "builtin"


def source_list(source: Any) -> list[str]:
    """data.source as a list of entries: null -> [builtin], a string -> [it], a list as it is."""
    if source is None:
        return [BUILTIN]
    entries = [str(s) for s in source] if isinstance(source, (list, tuple)) else [str(source)]
    if not entries or len(set(entries)) != len(entries):
        raise SpecdecError(f"data.source={source} lists no source or one twice; give each source once")
    return entries


def build_mix(generator: LoadedModel, sources: Sequence[str], source_cfg: dict[str, Any],
              data_cfg: dict[str, Any], log: Callable[[str], Any] = print
              ) -> tuple[DistillSet, list[dict[str, Any]]]:
    """The distillation set of every entry of `sources`, joined, and per entry what its prompts were
    ({source, split, turns, kept, rows, contaminated, ...}; the built-in entry: {source: builtin})."""
    sets: list[DistillSet] = []
    accounts: list[dict[str, Any]] = []
    for src in sources:
        prompts = None
        account: dict[str, Any] = {"source": src}
        if src != BUILTIN:
            prompts, stats = source_prompts(
                src, split=str(source_cfg.get("split") or "train"), subset=source_cfg.get("subset"),
                field=source_cfg.get("field"), turns=str(source_cfg.get("turns") or "first"),
                max_prompts=data_cfg.get("max_prompts"), shuffle=bool(source_cfg.get("shuffle", True)),
                exclude_per_category=int(data_cfg["exclude_per_category"]),
                exclude_seed=int(data_cfg["exclude_seed"]), log=log)
            account |= {"split": source_cfg.get("split"), "turns": source_cfg.get("turns")} | asdict(stats)
        sets.append(build_distill_dataset(generator, **data_cfg, log=log, prompts=prompts))
        account["sequences"] = len(sets[-1].data)
        accounts.append(account)
    return join_sets(sets), accounts


def join_sets(sets: Sequence[DistillSet]) -> DistillSet:
    """One set from several, examples in order; hidden states joined when every set has them."""
    import datasets

    if len(sets) == 1:
        return sets[0]
    minutes = sum(s.minutes for s in sets)
    if any(s.hidden is None for s in sets):
        parts = [s.data.remove_columns([c for c in ("hidden_start",) if c in s.data.column_names]) for s in sets]
        return DistillSet(datasets.concatenate_datasets(parts), None, minutes)
    arrays = [s.hidden for s in sets if s.hidden is not None]
    offsets = np.cumsum([0] + [a.shape[0] for a in arrays[:-1]])
    parts = [s.data.map(lambda r, o=int(o): {"hidden_start": r["hidden_start"] + o})
             for s, o in zip(sets, offsets)]
    return DistillSet(datasets.concatenate_datasets(parts), _joined(arrays), minutes)


def _joined(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """(rows_i, D) float16 memory maps as one, written once beside the first one's cache folder."""
    names = [str(getattr(a, "filename", "")) for a in arrays]
    key = hashlib.sha256("\0".join(f"{n}:{a.shape}" for n, a in zip(names, arrays)).encode()).hexdigest()[:12]
    root = Path(names[0]).parent.parent if names[0] else Path.cwd()
    path = root / f"mix-{key}" / "hidden.npy"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        return concat_memmap(path, arrays)
    return np.load(path, mmap_mode="r")
