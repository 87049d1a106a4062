"""logger=wandb: a tiny-llama sweep writes offline W&B runs, one per job, grouped by sweep, that hold the
config, the turns (logged as they are answered), the summary, plots, and the results folder as an artifact;
a trained checkpoint is logged as a model artifact.

No network, account or API key: the subprocess gets an empty HOME and no WANDB_* variables of the caller.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("wandb")

from wandb.proto import wandb_internal_pb2  # noqa: E402

from specdec.errors import SpecdecError  # noqa: E402
from specdec.loggers import NullLogger, WandbLogger, artifact_name  # noqa: E402
from specdec.run import run  # noqa: E402
from tests.run_helpers import make_cfg  # noqa: E402

BLOCK = 32768  # the .wandb file is a LevelDB-style log: 32 KiB blocks of checksummed record chunks
HEADER = 7  # ':W&B', a 2-byte magic, a version byte
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> list[wandb_internal_pb2.Record]:
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos = [], b"", HEADER
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block tail too short for a chunk header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (FULL, FIRST):
            pending = chunk
        elif kind in (MIDDLE, LAST):
            pending += chunk
        if kind in (FULL, LAST):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            records.append(rec)
    return records


def summary_items(records: list[wandb_internal_pb2.Record]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for rec in records:
        if rec.WhichOneof("record_type") == "summary":
            for item in rec.summary.update:
                out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def artifacts(records: list[wandb_internal_pb2.Record]) -> list[tuple[str, str, set[str]]]:
    """(type, name, paths in its manifest) of every artifact the run logged."""
    out = []
    for rec in records:
        if rec.WhichOneof("record_type") != "artifact":
            continue
        art = rec.artifact
        paths = {entry.path for entry in art.manifest.contents}
        if not paths and art.manifest.manifest_file_path and Path(art.manifest.manifest_file_path).is_file():
            manifest = json.loads(Path(art.manifest.manifest_file_path).read_text())
            paths = set(manifest.get("contents") or {})
        out.append((art.type, art.name, paths))
    return out


def offline_env(tmp_path: Path) -> dict[str, str]:
    """No network, account or key; W&B's own folders (artifact staging, cache) under tmp_path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    return env | {"HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1", "WANDB_DATA_DIR": str(tmp_path / "data"),
                  "WANDB_CACHE_DIR": str(tmp_path / "cache"), "WANDB_CONFIG_DIR": str(tmp_path / "config")}


def test_tiny_sweep_writes_grouped_offline_wandb_runs(tmp_path: Path) -> None:
    # a multirun of two jobs: each job one offline run, both in the sweep's group
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "specdec.run", "-m", "model=tiny-llama", "strategy=greedy", "data.limit=1",
         "generation.max_new_tokens=3,4", "warmup=0", "logger=wandb", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path, env=offline_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for job, max_new in ((0, 3), (1, 4)):
        out = sweep / str(job)
        summary = json.loads((out / "summary.json").read_text())
        runs = list((out / "wandb").glob("offline-run-*"))
        assert len(runs) == 1, "expected one offline run under each job's folder"
        run_dir = runs[0]
        assert f"wandb sync {run_dir}" in proc.stderr
        records = read_records(next(run_dir.glob("run-*.wandb")))
        kinds = [r.WhichOneof("record_type") for r in records]
        assert {"run", "history", "summary", "artifact"} <= set(kinds)

        # the resolved config, and the run's place among the sweep's
        run_rec = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        config = {item.key: json.loads(item.value_json) for item in run_rec.config.update}
        assert config["model"]["name"] == "tiny-llama"
        assert config["generation"]["max_new_tokens"] == max_new
        assert "environment" in config
        assert run_rec.run_group == "sweep" and run_rec.job_type == "greedy"
        assert run_rec.display_name.startswith(f"job{job} ") and f"generation.max_new_tokens={max_new}" in \
            run_rec.display_name

        # the summary, equal to summary.json's numbers
        logged = summary_items(records)
        greedy = summary["strategies"]["greedy"]
        for key in ("tokens_per_s", "speedup", "mean_accepted_tokens", "new_tokens", "wall_time_s"):
            assert logged[f"greedy/{key}"] == pytest.approx(greedy[key])
        for cat, metrics in greedy["categories"].items():
            assert logged[f"greedy/{cat}/tokens_per_s"] == pytest.approx(metrics["tokens_per_s"])

        # per-turn rows, one history step each
        turns = [r.history for r in records if r.WhichOneof("record_type") == "history"]
        turn_keys = {item.key or "/".join(item.nested_key) for h in turns for item in h.item}
        assert {"turn/greedy/new_tokens", "turn/greedy/tokens_per_s", "turn/greedy/tau"} <= turn_keys

        # tables and plots as media; the results folder as an artifact, not as loose files
        files = run_dir / "files"
        assert list((files / "media" / "table").rglob("overall_*.table.json"))
        pngs = list((files / "media" / "images").rglob("speedup_by_category_*.png"))
        assert pngs and pngs[0].stat().st_size > 0
        assert not (files / "summary.json").exists()
        results = [a for a in artifacts(records) if a[0] == "results"]
        assert len(results) == 1
        _, name, paths = results[0]
        assert name.startswith("results-") and {"summary.json", "answers.jsonl"} <= paths
        assert "plots/speedup_by_category.png" in paths and ".hydra/config.yaml" in paths
        assert not any(p.startswith("wandb/") for p in paths)


class OrderLogger(NullLogger):
    """Records, at each call, how many answers are on disk: a turn is logged as soon as it is written."""

    calls: list[tuple[str, int]] = []

    def start(self, config: dict[str, Any], output_dir: Path, **grouping: Any) -> None:
        self.answers = output_dir / "answers.jsonl"
        OrderLogger.calls = [("start", 0)]
        OrderLogger.grouping = grouping

    def _on_disk(self) -> int:
        return len(self.answers.read_text().splitlines()) if self.answers.is_file() else 0

    def log_turn(self, row: dict[str, Any]) -> None:
        OrderLogger.calls.append(("turn", self._on_disk()))

    def log_summary(self, summary: dict[str, Any], files: list[Path] | None = None) -> None:
        OrderLogger.calls.append(("summary", self._on_disk()))


def test_turns_are_logged_as_they_are_answered(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, "strategies=[greedy,prompt_lookup]", "data.limit=2",
                   f"logger._target_={__name__}.OrderLogger")
    run(cfg)
    calls = OrderLogger.calls
    turns = [n for kind, n in calls if kind == "turn"]
    assert calls[0] == ("start", 0) and calls[-1] == ("summary", len(turns))
    assert turns == list(range(1, len(turns) + 1)) and len(turns) >= 4  # each right after its own line
    assert OrderLogger.grouping == {"group": None, "job_type": "greedy,prompt_lookup", "job_name": None}


def test_a_trained_checkpoint_is_a_model_artifact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(key)
    for key, value in offline_env(tmp_path).items():
        if key.startswith("WANDB_"):
            monkeypatch.setenv(key, value)
    folder = tmp_path / "smollm2-135m-draft"
    (folder / "checkpoints").mkdir(parents=True)
    for name in ("model.safetensors", "config.json", "README.md", "checkpoints/state.safetensors"):
        (folder / name).write_bytes(b"x" * 16)
    logger = WandbLogger(mode="offline")
    logger.start({"head": "draft"}, tmp_path / "logs")
    logger.log_checkpoint(folder, metadata={"steps": 3})
    with pytest.raises(SpecdecError, match="does not exist"):
        logger.log_checkpoint(tmp_path / "missing")
    run_dir = Path(logger.run.dir).parent
    logger.finish()
    records = read_records(next(run_dir.glob("run-*.wandb")))
    assert artifacts(records) == [("model", "smollm2-135m-draft", {"model.safetensors", "config.json", "README.md"})]
    assert artifact_name("results/run 1:x") == "results-run-1-x"


def test_unknown_mode_is_one_line() -> None:
    with pytest.raises(SpecdecError, match="logger.mode='cloud'"):
        WandbLogger(mode="cloud")
    assert WandbLogger(mode="dryrun").mode == "offline"
