"""`pip install .` ships what the installed package reads: the Hydra configs (specdec/configs, a link to
the top-level configs/ in the repository), the shipped drafters in heads/checkpoints and the tuned trees,
and the `slurm` extra; installed elsewhere, the package finds them next to itself."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PARTS = ("pyproject.toml", "README.md", "specdec", "heads", "configs")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel `pip wheel . --no-deps --no-build-isolation` builds, from a copy of the sources (so
    that no build/ or egg-info folder of an earlier build, nor of this one, is in the working tree)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    def ignore(folder: str, entries: list[str]) -> set[str]:
        skip = {e for e in entries if e == "__pycache__" or e.endswith((".egg-info", ".pyc"))}
        if Path(folder).parent.name == "checkpoints":  # a drafter's resumable training state
            skip |= {e for e in entries if e == "checkpoints"}
        return skip

    for part in PARTS:
        path = REPO / part
        if path.is_dir():
            shutil.copytree(path, src / part, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(path, src / part)
    dist = root / "dist"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                           "--no-index", "-q", "-w", str(dist)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    wheels = list(dist.glob("specdec-*.whl"))
    assert len(wheels) == 1
    return wheels[0]


def _tracked(folder: Path, patterns: tuple[str, ...]) -> set[str]:
    return {p.relative_to(REPO).as_posix() for pattern in patterns for p in folder.glob(pattern) if p.is_file()}


def test_wheel_holds_configs_checkpoints_and_the_slurm_extra(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {"specdec/" + p for p in _tracked(REPO / "configs", ("*.yaml", "**/*.yaml"))}
    assert "specdec/configs/run.yaml" in configs and "specdec/configs/strategy/greedy.yaml" in configs
    assert configs <= names, sorted(configs - names)[:10]
    metadata = _tracked(REPO / "heads" / "checkpoints", ("*/*.json", "*/README.md"))
    assert metadata, "heads/checkpoints holds no shipped drafter"
    assert metadata <= names, sorted(metadata - names)
    weights = _tracked(REPO / "heads" / "checkpoints", ("*/*.safetensors",))
    assert weights <= names, sorted(weights - names)
    assert _tracked(REPO / "heads" / "trees", ("*.yaml",)) <= names
    assert not any(n.startswith("heads/checkpoints/") and n.count("/") > 3 for n in names)  # no training state
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    assert "Provides-Extra: slurm" in text and "hydra-submitit-launcher" in text


def test_installed_package_finds_its_configs_from_any_directory(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "target"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                           str(target), str(wheel)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    # every checkpoint folder a strategy config names through ${specdec.repo:...}, resolved by the installed
    # package for the default model
    script = textwrap.dedent("""
        import json
        from pathlib import Path

        from hydra import compose, initialize_config_dir
        from omegaconf import OmegaConf

        import specdec
        from specdec.cli_checks import CONFIG_DIR, options, strategy_config

        print(Path(specdec.__file__).resolve())
        assert CONFIG_DIR == Path(specdec.__file__).resolve().parent / "configs", CONFIG_DIR
        found = []

        def walk(node):
            if isinstance(node, dict):
                for v in node.values():
                    walk(v)
            elif isinstance(node, str) and "/heads/checkpoints/" in node:
                found.append(node)

        for name in options("strategy"):
            with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
                cfg = compose("run", overrides=[f"strategy={name}", "output_dir=out"])
            walk(OmegaConf.to_container(strategy_config(cfg, name)))
        print(json.dumps(found))
    """)
    env = {**os.environ, "PYTHONPATH": str(target)}
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    where, found = run.stdout.strip().splitlines()[-2:]
    assert where.startswith(str(target.resolve())), where  # the installed copy, not the checkout's
    paths = [Path(p) for p in json.loads(found)]
    assert paths, "no strategy config names a checkpoint through ${specdec.repo:...}"
    for path in paths:
        assert path.is_relative_to(target.resolve()), path
        if (REPO / path.relative_to(target.resolve())).exists():  # shipped in the repository: shipped installed
            assert path.exists(), path
