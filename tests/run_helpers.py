"""Composing run configs as the CLI would, and running the CLI itself, for the runner's tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from specdec.cli_checks import CONFIG_DIR

REPO = CONFIG_DIR.parent


def make_cfg(out_dir: Path, *overrides: str) -> DictConfig:
    """The composed `run` config for `python -m specdec.run model=tiny-llama ... overrides`."""
    base = ["model=tiny-llama", f"output_dir={out_dir}", "warmup=0", "generation.max_new_tokens=3"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose("run", overrides=[*base, *overrides])


def write_questions(path: Path, n: int, turns: int = 1, long: int | None = None) -> Path:
    """n Spec-Bench style questions; with `long`, question q1 is a turn of that many words."""
    rows = []
    for i in range(n):
        text = " ".join(["word"] * long) if long is not None and i == 1 else f"Question {i}: name a colour."
        rows.append({"question_id": f"q{i}", "category": "c", "turns": [text] + [f"And then? ({t})" for t in
                                                                                 range(1, turns)]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_answers(out_dir: Path) -> list[dict[str, Any]]:
    path = out_dir / "answers.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def cli(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`python -m specdec.run model=tiny-llama ARGS` in a subprocess."""
    return subprocess.run([sys.executable, "-m", "specdec.run", "model=tiny-llama", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env=cli_env())


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("HYDRA_FULL_ERROR", None)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def one_error_line(stderr: str) -> str:
    """The single `error: ...` line a failed CLI run must print (and nothing that looks like a traceback)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), stderr
    return lines[0]
