"""The data-scaling table of a run: each drafter's training tokens (from its checkpoint's metadata)
beside its held-apart tau, alpha and speedup, smallest data first.

    python experiments/scaling_table.py experiments/results/heldapart_magpie/eagle_scaling-DATE
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from specdec.results_index import portable

META_FILES = ("eagle.json", "medusa.json", "config.json")


def _train_meta(folder: Path) -> dict[str, Any] | None:
    for name in META_FILES:
        if (folder / name).is_file():
            meta = json.loads((folder / name).read_text())
            return meta.get("train") or meta.get("specdec", {}).get("train")
    return None


def rows(run: Path, repo: Path) -> list[dict[str, Any]]:
    summary = json.loads((run / "summary.json").read_text())["strategies"]
    out = []
    for name, s in summary.items():
        cfg = s.get("config") or {}
        path = next((part["path"] for part in cfg.values() if isinstance(part, dict) and "path" in part), None)
        # a run in another checkout (a worktree) records that checkout's absolute path
        meta = _train_meta(repo / portable(path)) if path else None
        if meta is None:
            continue
        ci = s.get("speedup_ci") or [None, None]
        out.append({"strategy": name, "tokens": meta["target_tokens"], "sequences": meta["sequences"],
                    "steps": meta["steps"], "val_acc": meta.get("val/acc"), "tau": s["mean_accepted_tokens"],
                    "alpha": s["acceptance_rate"], "speedup": s["speedup"], "ci": ci})
    return sorted(out, key=lambda r: (r["tokens"], r["strategy"]))


def table(run: Path, repo: Path) -> str:
    head = ("drafter", "training target tokens", "sequences", "steps", "validation acc", "tau", "alpha",
            "speedup [95% CI]")
    lines = ["| " + " | ".join(head) + " |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows(run, repo):
        acc = f"{r['val_acc']:.3f}" if r["val_acc"] is not None else "-"
        lines.append(f"| {r['strategy']} | {r['tokens']:,} | {r['sequences']:,} | {r['steps']} | {acc} | "
                     f"{r['tau']:.2f} | {r['alpha']:.2f} | {r['speedup']:.2f}x [{r['ci'][0]:.2f}, {r['ci'][1]:.2f}] |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2 or not (Path(sys.argv[1]) / "summary.json").is_file():
        sys.exit("usage: python experiments/scaling_table.py RUN_DIR (a run folder holding summary.json)")
    print(table(Path(sys.argv[1]), Path(__file__).resolve().parent.parent))
