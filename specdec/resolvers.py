"""OmegaConf resolvers the configs use; registered when `specdec` is imported.

`${specdec.repo:experiments/data/x.jsonl}` is a path inside this repository, wherever the command was
launched from (a SLURM job's working directory is often elsewhere, so `${oc.env:PWD}` is not enough).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

REPO_ROOT = Path(__file__).resolve().parent.parent


def repo_path(relative: str = "") -> str:
    return str(REPO_ROOT / relative)


def repo_relative(obj: Any) -> Any:
    """`obj` (JSON-like) with every path inside this checkout written relative to its root, so a result
    records the same config from any checkout of the repository (a worktree, a clone, a CI runner)."""
    if isinstance(obj, dict):
        return {k: repo_relative(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [repo_relative(v) for v in obj]
    if isinstance(obj, str):
        return re.sub(r"(?<![\w./-])" + re.escape(str(REPO_ROOT)) + "/", "", obj)
    return obj


def register() -> None:
    # replace=True: importing twice (tests, reloads) must not fail on an existing name
    OmegaConf.register_new_resolver("specdec.repo", repo_path, replace=True)
