"""Training data from several prompt sources at once: `data.source=[builtin, FILE, HUB_ID, ...]`.

Each source is distilled on its own (heads/distill_data.py: its own cache folder, its own generation
budget of data.max_minutes), so adding a source to a mix reuses what the others already generated.
`builtin` names the built-in prompts (data.per_category, seeds, instructions); any other entry is a
`datasets` source read by heads/prompt_sources.py with the run's data.split/field/turns/shuffle. An entry
may be a mapping instead, `{path: FILE, turns: all, max_minutes: 22}`, whose keys (ENTRY_KEYS) replace the
run's for that source only: one-turn and multi-turn files, each with its own budget, in one mix.
The joined set keeps every source's examples in the order listed; hidden states, when every source
has them, are joined once into one memory map under the cache root.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from heads.distill_data import DistillSet, build_distill_dataset, concat_memmap
from heads.prompt_sources import source_prompts
from specdec.errors import SpecdecError
from specdec.models.loader import LoadedModel

BUILTIN = "builtin"
# what a mapping entry of data.source may set for its own source (beside `path`)
ENTRY_KEYS = ("split", "subset", "field", "turns", "shuffle", "max_minutes", "max_prompts")
SOURCE_ONLY = ("split", "subset", "field", "turns", "shuffle")  # read from source_cfg; the rest from data_cfg
Entry = str | dict[str, Any]


def source_list(source: Any) -> list[Entry]:
    """data.source as a list of entries: null -> [builtin], a string -> [it], a list as it is; a
    mapping entry must have `path` and only ENTRY_KEYS besides."""
    if source is None:
        return [BUILTIN]
    raw = list(source) if isinstance(source, (list, tuple)) else [source]
    entries: list[Entry] = []
    for e in raw:
        if isinstance(e, Mapping):
            opts = dict(e)
            bad = sorted(set(opts) - {"path", *ENTRY_KEYS})
            if "path" not in opts or bad:
                raise SpecdecError(f"data.source entry {opts} needs `path` and may set only {', '.join(ENTRY_KEYS)}"
                                   f"{f', not {bad}' if bad else ''}; e.g. {{path: FILE, turns: all}}")
            entries.append(opts)
        else:
            entries.append(str(e))
    names = [entry_name(e) for e in entries]
    if not names or len(set(names)) != len(names):
        raise SpecdecError(f"data.source={source} lists no source or one twice; give each source once")
    return entries


def entry_name(entry: Entry) -> str:
    return str(entry["path"]) if isinstance(entry, dict) else entry


def build_mix(generator: LoadedModel, sources: Sequence[Entry], source_cfg: dict[str, Any],
              data_cfg: dict[str, Any], log: Callable[[str], Any] = print
              ) -> tuple[DistillSet, list[dict[str, Any]]]:
    """The distillation set of every entry of `sources`, joined, and per entry what its prompts were
    ({source, split, turns, kept, rows, contaminated, ...}; the built-in entry: {source: builtin})."""
    sets: list[DistillSet] = []
    accounts: list[dict[str, Any]] = []
    for entry in sources:
        src = entry_name(entry)
        opts = entry if isinstance(entry, dict) else {}
        own_source = source_cfg | {k: v for k, v in opts.items() if k in SOURCE_ONLY}
        own_data = data_cfg | {k: v for k, v in opts.items() if k in ENTRY_KEYS and k not in SOURCE_ONLY}
        prompts = None
        account: dict[str, Any] = {"source": src} | {k: opts[k] for k in ("max_minutes", "max_prompts") if k in opts}
        if src != BUILTIN:
            prompts, stats = source_prompts(
                src, split=str(own_source.get("split") or "train"), subset=own_source.get("subset"),
                field=own_source.get("field"), turns=str(own_source.get("turns") or "first"),
                max_prompts=own_data.get("max_prompts"), shuffle=bool(own_source.get("shuffle", True)),
                exclude_per_category=int(own_data["exclude_per_category"]),
                exclude_seed=int(own_data["exclude_seed"]), log=log)
            account |= {"split": own_source.get("split"), "turns": own_source.get("turns")} | asdict(stats)
        sets.append(build_distill_dataset(generator, **own_data, log=log, prompts=prompts))
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
