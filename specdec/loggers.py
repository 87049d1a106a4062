"""Experiment loggers: none, or Weights & Biases (offline unless configured otherwise).

The interface every logger has (`NullLogger` does nothing at each step):

- `start(config, output_dir, group=, job_type=, job_name=)`: before the first answer. `group` ties the
  jobs of one multirun together (their sweep folder), `job_type` says what a job compares (its
  strategies), `job_name` names the job; all may be None.
- `log_turn(row)`: one answers.jsonl row, as soon as it is on disk.
- `log_summary(summary, files)`: summary.json's contents once the run ends, with the results files.
- `log_checkpoint(folder, ...)`: a trained drafter's folder (heads/train.py).
- `finish()`: last.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from specdec.errors import SpecdecError

# What a results folder holds, relative to it: the files a results artifact carries (never the
# logger's own wandb/ folder, nor temporary files).
RESULT_FILES = ("summary.json", "answers.jsonl", "report.md", "plots/*.png", ".hydra/*.yaml")


class NullLogger:
    """Logs nothing; the base of every logger (see the module docstring for when each method runs)."""

    def start(self, config: dict[str, Any], output_dir: Path, *, group: str | None = None,
              job_type: str | None = None, job_name: str | None = None) -> None:
        pass

    def log_turn(self, row: dict[str, Any]) -> None:
        pass

    def log_summary(self, summary: dict[str, Any], files: list[Path] | None = None) -> None:
        pass

    def log_checkpoint(self, folder: Path, name: str | None = None, metadata: dict[str, Any] | None = None) -> None:
        pass

    def finish(self) -> None:
        pass


def artifact_name(text: str) -> str:
    """`text` as a W&B artifact name: letters, digits, '-', '_' and '.' only (others become '-')."""
    return re.sub(r"[^\w.\-]+", "-", text).strip("-") or "artifact"


class WandbLogger(NullLogger):
    """Logs the resolved config, one history row per turn as it is answered, the summary with its tables
    and plots, and the results folder (and trained checkpoints) as W&B Artifacts.

    Offline by default: the run is written under OUTPUT_DIR/wandb and needs no network, account or API
    key (upload later with `wandb sync`, artifacts included). Only mode=online talks to a server, and so
    needs a login. The jobs of one multirun share a W&B group (their sweep folder) unless `group` is set.
    """

    MODES = ("offline", "online", "disabled")

    def __init__(self, project: str = "specdec", entity: str | None = None, mode: str = "offline",
                 name: str | None = None, tags: list[str] | None = None, group: str | None = None,
                 job_type: str | None = None) -> None:
        mode = {"dryrun": "offline", "run": "online"}.get(mode, mode)  # wandb's older names
        if mode not in self.MODES:
            raise SpecdecError(f"logger.mode={mode!r} (or WANDB_MODE) is not one of {', '.join(self.MODES)}")
        self.kwargs: dict[str, Any] = {"project": project, "entity": entity, "mode": mode, "name": name,
                                       "tags": list(tags or []), "group": group, "job_type": job_type}
        self.mode = mode
        self.run: Any = None
        self.step = 0
        self.output_dir: Path | None = None

    def start(self, config: dict[str, Any], output_dir: Path, *, group: str | None = None,
              job_type: str | None = None, job_name: str | None = None) -> None:
        import wandb

        output_dir.mkdir(parents=True, exist_ok=True)
        self.output_dir = output_dir
        kwargs = dict(self.kwargs)
        # what the config sets wins over what the run derives
        for key, value in (("group", group), ("job_type", job_type), ("name", job_name)):
            if kwargs.get(key) is None and value is not None:
                kwargs[key] = value
        if kwargs.get("job_type") is not None:
            kwargs["job_type"] = str(kwargs["job_type"])[:64]  # W&B's limit
        # logger.mode (whose default reads WANDB_MODE) is passed to init, where it outranks the
        # environment: logger.mode=offline stays offline. The system monitor is off: its sampling
        # process would compete for the cores being timed.
        settings = wandb.Settings(silent=True, x_disable_stats=True, console="off")
        try:
            self.run = wandb.init(config=config, dir=str(output_dir), reinit="finish_previous", settings=settings,
                                  **kwargs)
        except wandb.errors.UsageError as e:
            raise SpecdecError(f"W&B could not start a {self.mode} run ({' '.join(str(e).split())}); run "
                               "`wandb login` or use logger.mode=offline") from None

    def log_turn(self, row: dict[str, Any]) -> None:
        """One turn's numbers under turn/STRATEGY/..., one history step per turn, logged as it happens."""
        keys = ("new_tokens", "wall_time_s", "ttft_s", "decode_steps", "prompt_tokens")
        prefix = f"turn/{row['strategy']}"
        metrics: dict[str, Any] = {f"{prefix}/{k}": row[k] for k in keys if row.get(k) is not None}
        if row["wall_time_s"] > 0:
            metrics[f"{prefix}/tokens_per_s"] = row["new_tokens"] / row["wall_time_s"]
        if row.get("accept_lengths"):
            metrics[f"{prefix}/tau"] = sum(row["accept_lengths"]) / len(row["accept_lengths"])
        self.run.log(metrics, step=self.step)
        self.step += 1

    def log_summary(self, summary: dict[str, Any], files: list[Path] | None = None) -> None:
        """The summary's numbers as run summary keys, its tables and plots as media, and the results
        folder (summary.json, answers.jsonl, plots, Hydra's config) as a `results` artifact."""
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
        artifact = wandb.Artifact(artifact_name(f"results-{self.run.id}"), type="results",
                                  description="a specdec.run results folder",
                                  metadata=_results_metadata(summary))
        added = set()
        if self.output_dir is not None:
            for pattern in RESULT_FILES:
                for f in sorted(self.output_dir.glob(pattern)):
                    if f.is_file():
                        rel = f.relative_to(self.output_dir).as_posix()
                        artifact.add_file(str(f), name=rel)
                        added.add(f.resolve())
        for f in files or []:  # anything given that lives elsewhere, under its own name
            if f.is_file() and f.resolve() not in added:
                artifact.add_file(str(f), name=f.name)
        self.run.log_artifact(artifact)

    def log_checkpoint(self, folder: Path, name: str | None = None, metadata: dict[str, Any] | None = None) -> None:
        """A trained drafter's folder (weights, config, card) as a `model` artifact named after the folder
        (e.g. smollm2-135m-draft); each call is a new version of it. Resumable state is left out."""
        import wandb

        folder = Path(folder)
        if not folder.is_dir():
            raise SpecdecError(f"checkpoint folder {folder} does not exist; save the drafter before logging it")
        artifact = wandb.Artifact(artifact_name(name or folder.name), type="model",
                                  description=f"trained drafter from {folder}", metadata=metadata or {})
        count = 0
        # the files directly in the folder (weights, config, card); not checkpoints/, the resumable state
        for f in sorted(folder.iterdir()):
            if f.is_file() and not f.name.startswith(".") and not f.name.endswith(".tmp"):
                artifact.add_file(str(f), name=f.name)
                count += 1
        if count == 0:
            raise SpecdecError(f"checkpoint folder {folder} holds no files; save the drafter "
                               "before logging it")
        self.run.log_artifact(artifact)

    def finish(self) -> None:
        """Close the run. Its files are complete when this returns: `run.finish()` alone can leave W&B's
        service still writing the offline log (seen with an artifact just logged), so the service is
        waited for too (the next run in this process starts a new one)."""
        import wandb

        if self.run is None:
            return
        run_dir = Path(self.run.dir).parent
        self.run.finish()
        self.run = None
        wandb.teardown()
        if self.mode == "offline":
            print(f"wandb: offline run in {run_dir}; upload it with `wandb sync {run_dir}`", file=sys.stderr)


def _results_metadata(summary: dict[str, Any]) -> dict[str, Any]:
    """What identifies a results folder at a glance: its baseline, strategies and their headline numbers."""
    config = summary.get("config") or {}
    meta: dict[str, Any] = {"baseline": summary.get("baseline"), "command": config.get("command"),
                            "strategies": list(summary.get("strategies") or {})}
    for name, s in (summary.get("strategies") or {}).items():
        for key in ("tokens_per_s", "speedup", "mean_accepted_tokens"):
            if _is_number(s.get(key)):
                meta[f"{name}/{key}"] = s[key]
    return meta


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
