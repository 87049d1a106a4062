"""The user cache folder, sha256 checks and atomic writes for converted weights."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from specdec.errors import SpecdecError


def cache_root() -> Path:
    """SPECDEC_CACHE, else $XDG_CACHE_HOME/specdec, else ~/.cache/specdec."""
    env = os.environ.get("SPECDEC_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "specdec"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_sha256(path: Path, expected: str, what: str) -> None:
    got = sha256_file(path)
    if got != expected:
        raise SpecdecError(f"{what} {path} has sha256 {got[:12]}..., expected {expected[:12]}... "
                           f"(truncated or altered); delete it and run again to fetch a fresh copy")


def build_folder_atomically(final: Path, build: Callable[[Path], None]) -> Path:
    """Build a folder in a temporary sibling and rename it into place.

    A process killed half way leaves only a temporary folder, never a half-written cache entry
    that a later run would load.
    """
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another process won the race; its copy is as good as ours
            if not final.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
