"""The user cache folder, sha256 checks and atomic writes for converted weights."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
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
    _remove_stale(final)
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


# A temporary folder this old belongs to a build that was killed (a live one finishes in minutes).
STALE_AFTER_S = 6 * 3600


def _remove_stale(final: Path) -> None:
    """Delete temporary folders that killed builds of `final` left behind, so they do not pile up."""
    now = time.time()
    for old in final.parent.glob(f".{final.name}.*"):
        try:
            if old.is_dir() and now - old.stat().st_mtime > STALE_AFTER_S:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            continue
