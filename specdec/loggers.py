"""Experiment loggers: none, or Weights & Biases (offline unless configured otherwise)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

from specdec.errors import SpecdecError


class NullLogger:
    def start(self, config: dict[str, Any], output_dir: Path) -> None:
        pass

    def log_turn(self, row: dict[str, Any]) -> None:
        pass

    def log_summary(self, summary: dict[str, Any], files: list[Path] | None = None) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbLogger(NullLogger):
    """Logs the resolved config, one row per turn, the summary with its tables, and the report's plots.

    Offline by default: the run is written under OUTPUT_DIR/wandb and needs no network, account or API
    key (upload later with `wandb sync`). Only mode=online talks to a server, and so needs a login.
    """

    MODES = ("offline", "online", "disabled")

    def __init__(self, project: str = "specdec", entity: str | None = None, mode: str = "offline",
                 name: str | None = None, tags: list[str] | None = None) -> None:
        mode = {"dryrun": "offline", "run": "online"}.get(mode, mode)  # wandb's older names
        if mode not in self.MODES:
            raise SpecdecError(f"logger.mode={mode!r} (or WANDB_MODE) is not one of {', '.join(self.MODES)}")
        self.kwargs = {"project": project, "entity": entity, "mode": mode, "name": name, "tags": list(tags or [])}
        self.mode = mode
        self.run: Any = None
        self.step = 0
        self.output_dir: Path | None = None

    def start(self, config: dict[str, Any], output_dir: Path) -> None:
        import wandb

        output_dir.mkdir(parents=True, exist_ok=True)
        self.output_dir = output_dir
        # logger.mode (whose default reads WANDB_MODE) is passed to init, where it outranks the
        # environment: logger.mode=offline stays offline. The system monitor is off: its sampling
        # process would compete for the cores being timed.
        settings = wandb.Settings(silent=True, x_disable_stats=True, console="off")
        try:
            self.run = wandb.init(config=config, dir=str(output_dir), reinit="finish_previous", settings=settings,
                                  **self.kwargs)
        except wandb.errors.UsageError as e:
            raise SpecdecError(f"W&B could not start a {self.mode} run ({' '.join(str(e).split())}); run "
                               "`wandb login` or use logger.mode=offline") from None

    def log_turn(self, row: dict[str, Any]) -> None:
        keys = ("new_tokens", "wall_time_s", "ttft_s", "decode_steps", "prompt_tokens")
        prefix = f"turn/{row['strategy']}"
        metrics = {f"{prefix}/{k}": row[k] for k in keys if row.get(k) is not None}
        if row["wall_time_s"] > 0:
            metrics[f"{prefix}/tokens_per_s"] = row["new_tokens"] / row["wall_time_s"]
        if row.get("accept_lengths"):
            metrics[f"{prefix}/tau"] = sum(row["accept_lengths"]) / len(row["accept_lengths"])
        self.run.log(metrics, step=self.step)
        self.step += 1

    def log_summary(self, summary: dict[str, Any], files: list[Path] | None = None) -> None:
        import wandb

        from specdec import report

        self.run.summary.update(flat_summary(summary))
        media: dict[str, Any] = {}
        for key, records in (("overall", report.overall_records(summary)),
                             ("by_category", report.category_records(summary))):
            if records:
                cols = list(records[0])
                media[f"tables/{key}"] = wandb.Table(columns=cols, data=[[r[c] for c in cols] for r in records])
        pngs = [f for f in files or [] if f.suffix == ".png"]
        if self.output_dir is not None:
            pngs += list(report.summary_plots(summary, self.output_dir / "plots").values())
        for f in pngs:
            media[f"plots/{f.stem}"] = wandb.Image(str(f))
        self.run.log(media, step=self.step)
        # Copies in the run's files/ folder travel with it (and with `wandb sync`); run.save would
        # symlink, and warn that later changes are not picked up.
        for f in files or []:
            if f.suffix != ".png" and f.is_file():
                shutil.copy2(f, Path(self.run.dir) / f.name)

    def finish(self) -> None:
        if self.run is None:
            return
        run_dir = Path(self.run.dir).parent
        self.run.finish()
        self.run = None
        if self.mode == "offline":
            print(f"wandb: offline run in {run_dir}; upload it with `wandb sync {run_dir}`", file=sys.stderr)


def flat_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """summary.json's numbers as W&B summary keys: STRATEGY/metric, STRATEGY/CATEGORY/metric."""
    flat: dict[str, Any] = {"baseline": summary.get("baseline")}
    for name, s in summary["strategies"].items():
        flat |= {f"{name}/{k}": v for k, v in s.items() if _is_number(v)}
        for cat, m in (s.get("categories") or {}).items():
            flat |= {f"{name}/{cat}/{k}": v for k, v in m.items() if _is_number(v)}
        reps = s.get("repeats") or {}
        flat |= {f"{name}/repeats/{k}": v for k, v in reps.items() if _is_number(v)}
    return flat


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
