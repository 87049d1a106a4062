"""logger=wandb: a tiny-llama run writes an offline W&B run that holds the config, turns, summary and plots.

No network, account or API key: the subprocess gets an empty HOME and no WANDB_* variables.
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
from specdec.loggers import WandbLogger  # noqa: E402

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


def test_tiny_run_writes_an_offline_wandb_run(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env |= {"HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1"}
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "specdec.run", "model=tiny-llama", "strategy=greedy", "data.limit=1",
         "generation.max_new_tokens=4", "warmup=0", "logger=wandb", f"output_dir={out}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())

    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, "expected one offline run under the output dir"
    run_dir = runs[0]
    assert f"wandb sync {run_dir}" in proc.stderr
    records = read_records(next(run_dir.glob("run-*.wandb")))
    kinds = {r.WhichOneof("record_type") for r in records}
    assert {"run", "history", "summary"} <= kinds

    # the resolved config
    run_rec = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    config = {item.key: json.loads(item.value_json) for item in run_rec.config.update}
    assert config["model"]["name"] == "tiny-llama"
    assert config["generation"]["max_new_tokens"] == 4
    assert "environment" in config

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

    # tables and plots as media files, results files copied in
    files = run_dir / "files"
    assert list((files / "media" / "table").rglob("overall_*.table.json"))
    pngs = list((files / "media" / "images").rglob("speedup_by_category_*.png"))
    assert pngs and pngs[0].stat().st_size > 0
    assert json.loads((files / "summary.json").read_text())["strategies"]["greedy"]["new_tokens"] == \
        greedy["new_tokens"]


def test_unknown_mode_is_one_line() -> None:
    with pytest.raises(SpecdecError, match="logger.mode='cloud'"):
        WandbLogger(mode="cloud")
    assert WandbLogger(mode="dryrun").mode == "offline"
