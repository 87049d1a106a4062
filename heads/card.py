"""The card shipped beside a trained drafter: how it was made and how well it predicts.

Written by `python -m heads.train` from the run's own facts (command, commit, machine, data, steps,
losses, held-out metrics), so a shipped artifact always says how to reproduce it.
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

from specdec.provenance import cpu_name, git_commit

CARD = "README.md"


def machine() -> str:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{cpu_name()}, {os.cpu_count()} CPU cores, {gpu}; "
            f"torch {torch.__version__}, Python {platform.python_version()}")


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def write_card(out_dir: Path, name: str, model: str, meta: dict[str, Any], argv: list[str] | None = None) -> Path:
    """README.md in out_dir from heads.train's metadata (steps, losses, `val/...` metrics, config)."""
    argv = sys.argv[1:] if argv is None else argv
    cfg = meta.get("config", {})
    data, train = cfg.get("data", {}), cfg.get("train", {})
    val = {k.removeprefix("val/"): v for k, v in meta.items() if k.startswith("val/")}
    lines = [
        f"# {name} for {model}",
        "",
        "Trained by specdec's own command on the target's own greedy continuations (self-distillation);",
        "the target stays frozen. Retrain or train for another model with the command below.",
        "",
        f"- Command: `python -m heads.train {shlex.join(argv)}`",  # quoted: lists and {mappings} reach Hydra whole
        f"- Date: {meta.get('date')}; commit {git_commit() or 'unknown'}",
        f"- Machine: {machine()}",
        f"- Data: {meta.get('sequences')} training sequences, {meta.get('target_tokens')} target tokens "
        f"(prompts: {_prompts(data, meta.get('prompt_sources'))}; continuations of {data.get('max_new_tokens')} "
        "tokens, generated in "
        f"{meta.get('data_dtype', 'fp32')} in {_fmt(meta.get('data_minutes'))} min, "
        f"budget {data.get('max_minutes')} min{' per source' if len(meta.get('prompt_sources') or []) > 1 else ''})",
        f"- Training: {meta.get('steps')} steps, {_fmt(meta.get('epochs'))} epochs, {_fmt(meta.get('minutes'))} min "
        f"(budget {train.get('max_minutes')} min), batch {train.get('batch_size')}, lr {train.get('lr')}, "
        f"sequence length {train.get('seq_len')}, mixed precision {train.get('mixed_precision', 'no')}",
        f"- Loss: first {_fmt(meta.get('first_loss'))}, last {_fmt(meta.get('last_loss'))}",
        f"- Head: {head_settings(cfg.get('head', {}))}",
        "",
    ]
    if start := cfg.get("head", {}).get("init_from"):  # fine-tuned: the data above add to the start's own
        lines.insert(-2, f"- Started from: the drafter in `{start}` (its card names its own data), not fresh weights")
        total = meta.get("minutes_in_all")
        lines.insert(-2, f"- Training in all: {_fmt(total)} min, the start's and this run's" if total is not None else
                     "- Training in all: unknown (the start's record predates the count: add the minutes on its card)")
    if val:
        lines += [f"## Held-out validation ({train.get('val_fraction')} of the sequences)", "",
                  "| metric | value |", "|---|---|", *(f"| {k} | {_fmt(v)} |" for k, v in val.items()), ""]
    if not torch.cuda.is_available():
        lines += gpu_lines(cfg, meta)
    path = out_dir / CARD
    path.write_text("\n".join(lines).replace("budget None min", "no time limit"))
    return path


def head_settings(head: dict[str, Any]) -> str:
    """Every `head.*` setting the run used, defaults included: the command names only its overrides, and a
    default may change later (EAGLE's head.kl_weight did), so the card states the whole recipe."""
    skip = {"_target_", "name", "init_from"}
    return " ".join(f"`{k}={v}`" for k, v in head.items() if k not in skip) or "(none)"


def gpu_lines(cfg: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    """A CPU run's card: what its command would do differently on a CUDA machine, read from the code's
    rules (loader, distillation batch, training budgets), not measured."""
    model, data, train = (cfg.get(k) or {} for k in ("model", "data", "train"))
    out = ["## On a GPU", "", "Not measured (this run had none). The same command on a CUDA machine:", ""]
    if model.get("matmul") in ("numba", "numpy"):
        out.append(f"- stops at once with one line: `model.matmul={model['matmul']}` runs fp32 on the CPU only. "
                   "Drop it.")
    if model.get("dtype", "auto") == "auto" and data.get("dtype") is None:
        out.append("- loads the target in bf16 (`model.dtype=auto`): the continuations it distills, and the hidden "
                   "states saved with them, are then the bf16 model's, not this run's fp32 ones. Add "
                   "`model.dtype=fp32` to distill from the fp32 model (the GPU's kernels round differently, so a few "
                   "continuations may still differ).")
    if data.get("batch_size", "auto") == "auto":
        out.append("- distills in batches of up to 256 prompts (`data.batch_size=auto`), not 64.")
    cut = [s for s in meta.get("prompt_sources") or [] if s.get("kept") is not None and s["sequences"] < s["kept"]]
    if cut and data.get("max_minutes") is not None:
        out.append(f"- distills every prompt: here the {data['max_minutes']}-minute generation budget stopped "
                   + ", ".join(f"{s['source']} at {s['sequences']} of {s['kept']}" for s in cut) + ".")
    steps, epochs, planned = meta.get("steps"), meta.get("epochs"), train.get("epochs")
    timed_out = (train.get("max_minutes") is not None and train.get("max_steps") is None
                 and isinstance(epochs, (int, float)) and isinstance(planned, (int, float)) and epochs < planned - 1e-3)
    if timed_out:
        out.append(f"- trains all `train.epochs={planned}`: here the {train['max_minutes']}-minute budget stopped "
                   f"it at {steps} steps, so the weights would differ. `train.max_steps={steps}` "
                   "keeps this run's length (the learning rate decays over it).")
    else:
        plural = "" if steps == 1 else "s"
        out.append(f"- runs the same {steps} optimizer step{plural} within its budgets, in far less time.")
    return out + [""]


def _prompts(data: dict[str, Any], sources: list[dict[str, Any]] | None) -> str:
    """Where the prompts came from: each data.source entry (heads/data_mix.py's account), else the built-in ones."""
    builtin = (f"offline suite, {data.get('per_category')} per category for seeds {data.get('seeds')}, plus up to "
               f"{data.get('instructions', 0)} general chat instructions from heads/instruction_prompts.py, "
               "benchmark prompts excluded")
    if not sources:
        return builtin
    parts = []
    for s in sources:
        if s["source"] == "builtin":
            parts.append(f"built-in ({builtin}): {s['sequences']} sequences")
        else:
            own = "".join(f", {k.replace('_', ' ')} {s[k]}" for k in ("max_minutes", "max_prompts") if k in s)
            parts.append(f"data.source={s['source']} (split {s['split']}, turns {s['turns']}{own}), {s['kept']} "
                         f"prompts from {s['rows']} rows, {s['contaminated']} dropped for sharing a 13-word n-gram "
                         f"with evaluation questions: {s['sequences']} sequences")
    return "; ".join(parts)
