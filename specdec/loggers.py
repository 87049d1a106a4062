"""Experiment loggers: none, or Weights & Biases (offline unless configured otherwise)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


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
    """Logs the resolved config, one row per turn, the summary and any tables or plots given."""

    def __init__(self, project: str = "specdec", entity: str | None = None, mode: str = "offline",
                 name: str | None = None, tags: list[str] | None = None) -> None:
        self.kwargs = {"project": project, "entity": entity, "mode": mode, "name": name, "tags": list(tags or [])}
        self.run: Any = None
        self.step = 0

    def start(self, config: dict[str, Any], output_dir: Path) -> None:
        import wandb

        output_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(config=config, dir=str(output_dir), reinit="finish_previous", **self.kwargs)

    def log_turn(self, row: dict[str, Any]) -> None:
        keys = ("new_tokens", "wall_time_s", "ttft_s", "decode_steps", "prompt_tokens")
        metrics = {f"turn/{row['strategy']}/{k}": row[k] for k in keys if row.get(k) is not None}
        if row["wall_time_s"] > 0:
            metrics[f"turn/{row['strategy']}/tokens_per_s"] = row["new_tokens"] / row["wall_time_s"]
        self.run.log(metrics, step=self.step)
        self.step += 1

    def log_summary(self, summary: dict[str, Any], files: list[Path] | None = None) -> None:
        import wandb

        for name, s in summary["strategies"].items():
            for k, v in s.items():
                if isinstance(v, int | float) and not isinstance(v, bool):
                    self.run.summary[f"{name}/{k}"] = v
        for f in files or []:
            if f.suffix == ".png":
                self.run.log({f"plots/{f.stem}": wandb.Image(str(f))}, step=self.step)
            elif f.is_file():
                self.run.save(str(f), base_path=str(f.parent), policy="now")

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
