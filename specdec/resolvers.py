"""OmegaConf resolvers the configs use; registered when `specdec` is imported.

`${specdec.repo:experiments/data/x.jsonl}` is a path inside this repository, wherever the command was
launched from (a SLURM job's working directory is often elsewhere, so `${oc.env:PWD}` is not enough).
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

REPO_ROOT = Path(__file__).resolve().parent.parent


def repo_path(relative: str = "") -> str:
    return str(REPO_ROOT / relative)


def register() -> None:
    # replace=True: importing twice (tests, reloads) must not fail on an existing name
    OmegaConf.register_new_resolver("specdec.repo", repo_path, replace=True)
