"""Where published checkpoints come from, and how their tensors are read safely.

A *source* is a local folder or, only when the caller asks for it (`hub=True`), a Hugging Face hub id
("owner/name") fetched with huggingface_hub into its usual cache. Nothing here touches the network on
the default path.

Tensors are read from safetensors files, or from `.bin` / `.pt` pickles through
`torch.load(weights_only=True)`: that unpickler rebuilds tensors and plain containers only and refuses
any other object, so a checkpoint cannot run code while it loads. A file that needs more than that is
refused with one line; it is never unpickled in full.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor

from specdec.errors import SpecdecError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


def resolve_source(source: str | Path, hub: bool = False, revision: str | None = None,
                   patterns: Iterable[str] = ("*.json", "*.safetensors", "*.bin", "*.pt")) -> Path:
    """The local folder holding `source`: the folder itself, or (hub=True only) a hub snapshot of the
    files matching `patterns`."""
    folder = Path(source).expanduser()
    if folder.is_dir():
        return folder
    if folder.exists():
        raise SpecdecError(f"{folder} is a file; pass the folder that holds the checkpoint and its config.json")
    if not hub:
        raise SpecdecError(f"no folder {folder}; pass a local checkpoint folder, or set hub=true (--hub) to fetch "
                           f"{source} from the Hugging Face hub")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(source), revision=revision, allow_patterns=list(patterns)))
    except Exception as e:  # network, auth, unknown repo: all one line for the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SpecdecError(f"cannot fetch {source} from the Hugging Face hub ({first[:160]}); check the id and "
                           "your connection, or download it and pass the folder") from None


def read_json(path: Path) -> dict:
    """A JSON object from `path`, or a one-line error naming the file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SpecdecError(f"cannot read {path} ({type(e).__name__}: {e}); is the checkpoint complete?") from None
    if not isinstance(data, dict):
        raise SpecdecError(f"{path} is not a JSON object; is it the checkpoint's config.json?")
    return data


def load_tensors(path: Path, keep: str | None = None) -> dict[str, Tensor]:
    """Every tensor in one file (safetensors, or a pickle read with weights_only=True), on the CPU;
    with `keep`, only the names starting with it (safetensors then reads nothing else)."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys() if keep is None or k.startswith(keep)}  # noqa: SIM118
    if path.suffix not in PICKLE_SUFFIXES:
        raise SpecdecError(f"{path} is neither safetensors nor a .bin/.pt checkpoint")
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError, EOFError) as e:
        raise SpecdecError(f"{path} holds more than tensors (torch.load(weights_only=True) refused it: "
                           f"{str(e).strip().splitlines()[0][:120]}); specdec never unpickles a checkpoint in "
                           "full: convert it to safetensors with a tool you trust") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()):
        raise SpecdecError(f"{path} is not a flat mapping of names to tensors; convert it to safetensors")
    return {k: v for k, v in state.items() if keep is None or k.startswith(keep)}


def load_first(folder: Path, names: Iterable[str], keep: str | None = None) -> tuple[Path, dict[str, Tensor]] | None:
    """The tensors of the first of `names` present in `folder` (a sharded checkpoint through its
    `NAME.index.json`), or None when none is there."""
    for name in names:
        index = folder / f"{name}.index.json"
        if index.is_file():
            shards = sorted(set(read_json(index).get("weight_map", {}).values()))
            state: dict[str, Tensor] = {}
            for shard in shards:
                state |= load_tensors(folder / shard, keep)
            return index, state
        if (folder / name).is_file():
            return folder / name, load_tensors(folder / name, keep)
    return None
