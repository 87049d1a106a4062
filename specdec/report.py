"""`python -m specdec.report RUN_DIR [RUN_DIR...] [--out DIR]`: results folders -> report.md and plots.

A RUN_DIR is a folder written by `python -m specdec.run` (summary.json, answers.jsonl) or a multirun
sweep folder holding one such folder per job. The report has the overall table (with 95% intervals
when the run had repeats), strategy x category tables, the environment and the command of each run,
and PNG plots; when the runs differ in exactly one numeric setting (a sweep) it adds tau and speedup
against that setting.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec import plots
from specdec.errors import SpecdecError
from specdec.results_index import portable
from specdec.specbench import add_specbench_speedup

Summary = dict[str, Any]

# Config roots that differ between runs without changing what was measured.
_IGNORED_ROOTS = ("output_dir", "environment", "hydra", "overrides", "command", "debug", "logger")

# (column title, key in a strategy's or a category's metrics)
CATEGORY_METRICS = (("speedup", "speedup"), ("tokens/s", "tokens_per_s"), ("tau", "mean_accepted_tokens"),
                    ("alpha", "acceptance_rate"))

# (row title, config path) shown in the environment table
_ENV_ROWS = (
    ("model", "model.name"), ("model path", "model.path"), ("dtype", "environment.dtype"),
    ("backend", "environment.backend"), ("data", "data.name"), ("data path", "data.path"),
    ("data skip", "data.skip"), ("data limit", "data.limit"),
    ("max_new_tokens", "generation.max_new_tokens"),
    ("temperature", "generation.temperature"), ("top_p", "generation.top_p"), ("seed", "seed"),
    ("warmup", "warmup"), ("repeats", "repeats"), ("torch", "environment.torch"),
    ("python", "environment.python"), ("threads", "environment.threads"), ("cpu", "environment.cpu"),
    ("cpu count", "environment.cpu_count"), ("matmul", "environment.matmul"),
    ("kernel layout", "environment.kernel_layout"), ("kernels", "environment.kernels"),
    ("cuda", "environment.cuda"), ("platform", "environment.platform"), ("date", "environment.date"),
    ("commit", "environment.commit"), ("dirty", "environment.dirty"), ("device", "environment.device"),
    ("gpu", "environment.gpu"), ("compile", "environment.compile"), ("kernel target", "environment.kernel_target"),
    ("batch size", "environment.batch_size"),
)


@dataclass
class Run:
    """One results folder: its summary.json and how it was launched."""

    path: Path
    summary: Summary
    overrides: list[str]
    command: str | None
    answers: int | None  # lines in answers.jsonl, None without the file
    label: str = ""

    @property
    def config(self) -> dict[str, Any]:
        return self.summary.get("config") or {}

    @property
    def strategies(self) -> dict[str, dict[str, Any]]:
        return self.summary["strategies"]


# --- reading --------------------------------------------------------------------------------------


def _job_order(path: Path) -> tuple[int, int, str]:
    return (0, int(path.name), "") if path.name.isdigit() else (1, 0, path.name)


def find_runs(args: Sequence[str | Path]) -> list[Path]:
    """Results folders named by args; a folder without summary.json stands for its job subfolders."""
    found: list[Path] = []
    for arg in args:
        path = Path(arg).expanduser()
        if not path.is_dir():
            what = "is a file, not a folder" if path.exists() else "not found"
            raise SpecdecError(f"run folder {what}: {arg} (give folders written by python -m specdec.run)")
        if (path / "summary.json").is_file():
            jobs = [path]
        else:
            jobs = sorted((d for d in path.iterdir() if (d / "summary.json").is_file()), key=_job_order)
        if not jobs:
            raise SpecdecError(f"no summary.json in {arg} or its subfolders; give a results folder of "
                               "python -m specdec.run or a multirun sweep folder")
        found += [j for j in jobs if j.resolve() not in {f.resolve() for f in found}]
    return found


def _hydra_overrides(path: Path) -> list[str]:
    file = path / ".hydra" / "overrides.yaml"
    if not file.is_file():
        return []
    import yaml

    loaded = yaml.safe_load(file.read_text())
    return [str(o) for o in loaded] if isinstance(loaded, list) else []


def _read_answers(path: Path) -> list[dict[str, Any]] | None:
    file = path / "answers.jsonl"
    if not file.is_file():
        return None
    rows = []
    for line in file.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by a kill; the runner drops it the same way
    return rows


def _fill_from_answers(summary: Summary, rows: list[dict[str, Any]]) -> None:
    """Summaries written before the breakdowns existed get them from answers.jsonl; nothing is overwritten."""
    if all("categories" in s for s in summary["strategies"].values()) or not rows:
        return
    from specdec.metrics import add_speedup_ci, summarize

    temperature = float(((summary.get("config") or {}).get("generation") or {}).get("temperature", 0.0))
    fresh = summarize(rows, summary.get("baseline") or "", temperature, list(summary["strategies"]))
    add_speedup_ci(fresh)
    for name, s in summary["strategies"].items():
        for key, value in fresh["strategies"].get(name, {}).items():
            s.setdefault(key, value)


def load_run(path: Path) -> Run:
    file = path / "summary.json"
    try:
        summary = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise SpecdecError(f"{file} is not valid JSON ({e.msg}, line {e.lineno}); rerun the benchmark") from None
    except OSError as e:
        raise SpecdecError(f"cannot read {file}: {e.strerror}") from None
    if not isinstance(summary, dict) or not isinstance(summary.get("strategies"), dict) or not summary["strategies"]:
        raise SpecdecError(f"{file} holds no per-strategy results; it is not a summary.json of python -m specdec.run")
    rows = _read_answers(path)
    _fill_from_answers(summary, rows or [])
    if rows and not any("speedup_specbench" in s for s in summary["strategies"].values()):
        add_specbench_speedup(summary, rows)  # an older run: no tokenizer here, recorded baseline tokens
    config = summary.get("config") or {}
    overrides = config.get("overrides") or _hydra_overrides(path)
    command = config.get("command")
    return Run(path, summary, [str(o) for o in overrides], " ".join(command) if isinstance(command, list) else command,
               None if rows is None else len(rows))


def load_runs(args: Sequence[str | Path]) -> list[Run]:
    runs = [load_run(p) for p in find_runs(args)]
    keys = differing_keys(runs)
    for r in runs:
        flat = _flatten(r.config)
        r.label = ", ".join(f"{k}={_short(flat.get(k))}" for k in keys) or r.path.name
    if len({r.label for r in runs}) < len(runs):  # same settings twice: tell them apart by folder
        for r in runs:
            r.label = f"{r.path.name}: {r.label}" if r.label != r.path.name else r.label
    return runs


# --- comparing runs -------------------------------------------------------------------------------


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= _flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v  # lists stay whole: a tree spec is one setting
    return out


def differing_keys(runs: Sequence[Run]) -> list[str]:
    """Config settings (dotted paths) whose values are not the same in every run."""
    flats = [{k: v for k, v in _flatten(r.config).items() if k.split(".")[0] not in _IGNORED_ROOTS} for r in runs]
    keys = sorted(set().union(*flats)) if flats else []
    return [k for k in keys if len({json.dumps(f.get(k), sort_keys=True, default=str) for f in flats}) > 1]


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def sweep_axis(runs: Sequence[Run]) -> tuple[str, list[float]] | None:
    """(setting, its value per run) when the runs differ in exactly one numeric setting.

    A list-valued strategy setting (a token tree) counts by its size, so tree sweeps plot too.
    """
    keys = differing_keys(runs)
    if len(runs) < 2 or len(keys) != 1:
        return None
    key = keys[0]
    values = [_flatten(r.config).get(key) for r in runs]
    if all(_is_number(v) for v in values):
        return key, [float(v) for v in values]
    if key.startswith("strategy.") and all(isinstance(v, list) for v in values):
        return f"{key} (size)", [float(len(v)) for v in values]
    return None


# --- formatting -----------------------------------------------------------------------------------


def _short(v: Any, width: int = 40) -> str:
    text = portable(v if isinstance(v, str) else json.dumps(v, default=str))  # no local folder in a report
    return text if len(text) <= width else text[: width - 3] + "..."


def fmt(v: Any, digits: int = 2, scale: float = 1.0) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def _with_ci(v: float | None, ci: float | None, digits: int = 2) -> str:
    return fmt(v, digits) if v is None or ci is None else f"{v:.{digits}f} ± {ci:.{digits}f}"


def interval(ci: Any, digits: int = 2) -> str:
    """`[lo, hi]` of a 95% interval, "-" where there is none."""
    if not isinstance(ci, list) or len(ci) != 2 or any(x is None for x in ci):
        return "-"
    return f"[{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def exactness(s: dict[str, Any]) -> str:
    """The lossless column: lossy rows stand out; summaries from before the field say nothing."""
    lossless = s.get("lossless")
    return "-" if lossless is None else "yes" if lossless else "**no (lossy)**"


def weights_text(w: Any) -> str | None:
    """environment.weights in a few words, e.g. "SmolLM2-135M-Instruct.Q4_1.gguf (Q4_1 -> fp32)"."""
    if not isinstance(w, dict):
        return None if w is None else str(w)
    name = w.get("file") or w.get("source") or "-"
    if w.get("quantization"):
        return f"{name} ({w['quantization']} -> {w.get('dequantized_to') or '?'}), {w.get('source', '')}".rstrip(", ")
    return f"{name} ({w.get('format')})" if w.get("format") else name


def curves_text(curves: Any) -> str | None:
    """environment.pass_cost_curves in a few words: each curve's cost of 2, 4, 8 and 16 new tokens in
    one-token passes, e.g. "2: 1.01, 4: 1.04, 8: 1.31, 16: 1.92"."""
    if not curves:
        return None
    parts = [", ".join(f"{n}: {c[n]:.2f}" for n in ("2", "4", "8", "16") if n in c) for c in curves.values()]
    return "; ".join(parts)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], numeric: bool = True) -> str:
    rule = ["---"] + ["---:" if numeric else "---"] * (len(header) - 1)  # names left, numbers right
    lines = [header, rule, *rows]
    return "\n".join("| " + " | ".join(str(c) for c in line) + " |" for line in lines)


def _p50(s: dict[str, Any], key: str) -> float | None:
    return (s.get(key) or {}).get("p50")


# alpha for trees, named as in summary.json: alpha_longest_path (= acceptance_rate) and alpha_per_node
OVERALL_HEADER = ("strategy", "tokens/s", "speedup", "speedup 95% CI", "Spec-Bench speedup", "tau",
                  "alpha longest path", "alpha per node", "lossless", "matches baseline", "TTFT p50 (ms)",
                  "TPOT p50 (ms)", "predicted speedup", "turns")


def overall_table(summary: Summary) -> str:
    rows = []
    for name, s in summary["strategies"].items():
        reps = s.get("repeats") or {}
        rows.append([
            name, _with_ci(s.get("tokens_per_s"), reps.get("tokens_per_s_ci95")),
            _with_ci(s.get("speedup"), reps.get("speedup_ci95")), interval(s.get("speedup_ci")),
            fmt(s.get("speedup_specbench")),
            fmt(s.get("mean_accepted_tokens")), fmt(s.get("acceptance_rate")), fmt(s.get("alpha_per_node")),
            exactness(s), fmt(s.get("matches_baseline")),
            fmt(_p50(s, "ttft_distribution"), 1, 1000.0), fmt(_p50(s, "tpot_distribution"), 1, 1000.0),
            fmt(s.get("predicted_speedup")), str(s.get("turns", "-")),
        ])
    return markdown_table(OVERALL_HEADER, rows)


def ttft_turn_table(summary: Summary) -> str | None:
    """Mean TTFT per turn index (ms), for multi-turn suites only: where prefix reuse shows."""
    turns = sorted({t for s in summary["strategies"].values() for t in (s.get("ttft_s_by_turn") or {})}, key=int)
    if len(turns) < 2:
        return None
    rows = [[name, *(fmt((s.get("ttft_s_by_turn") or {}).get(t), 1, 1000.0) for t in turns),
             {True: "on", False: "off"}.get(s.get("prefix_cache"), "-")]
            for name, s in summary["strategies"].items()]
    return markdown_table(["strategy", *(f"turn {t}" for t in turns), "prefix cache"], rows)


def categories_of(summary: Summary) -> list[str]:
    return sorted({c for s in summary["strategies"].values() for c in (s.get("categories") or {})})


def category_table(summary: Summary, key: str) -> str:
    """Strategies down, categories across (the whole suite last), one metric in the cells."""
    cats = categories_of(summary)
    rows = []
    for name, s in summary["strategies"].items():
        per_cat = s.get("categories") or {}
        rows.append([name, *(fmt((per_cat.get(c) or {}).get(key)) for c in cats), fmt(s.get(key))])
    return markdown_table(["strategy", *cats, "overall"], rows)


def overall_records(summary: Summary) -> list[dict[str, Any]]:
    """The overall table as numbers (for loggers)."""
    return [{"strategy": name, "tokens_per_s": s.get("tokens_per_s"), "speedup": s.get("speedup"),
             "speedup_ci": s.get("speedup_ci"), "lossless": s.get("lossless"),
             "tau": s.get("mean_accepted_tokens"), "alpha": s.get("acceptance_rate"),
             "alpha_per_node": s.get("alpha_per_node"),
             "matches_baseline": s.get("matches_baseline"), "ttft_p50_s": _p50(s, "ttft_distribution"),
             "tpot_p50_s": _p50(s, "tpot_distribution"), "predicted_speedup": s.get("predicted_speedup")}
            for name, s in summary["strategies"].items()]


def category_records(summary: Summary) -> list[dict[str, Any]]:
    return [{"strategy": name, "category": c, **{key: m.get(key) for _, key in CATEGORY_METRICS}}
            for name, s in summary["strategies"].items() for c, m in (s.get("categories") or {}).items()]


# --- plots ----------------------------------------------------------------------------------------


def summary_plots(summary: Summary, out_dir: Path, suffix: str = "", title: str = "") -> dict[str, Path]:
    """The per-run plots that have data: speedup by category, acceptance by position, accept lengths."""
    strategies = summary["strategies"]
    made: dict[str, Path] = {}
    speedups = {name: {**{c: m.get("speedup") for c, m in (s.get("categories") or {}).items()},
                       "overall": s.get("speedup")} for name, s in strategies.items()}
    if any(v is not None for per in speedups.values() for v in per.values()):
        made["speedup by category"] = plots.speedup_by_category(
            speedups, out_dir / f"speedup_by_category{suffix}.png", title)
    curves = {name: s["acceptance_by_position"] for name, s in strategies.items() if s.get("acceptance_by_position")}
    if curves:
        made["acceptance by draft position"] = plots.acceptance_by_position(
            curves, out_dir / f"acceptance_by_position{suffix}.png", title)
    hists = {name: {int(n): int(c) for n, c in s["accept_length_histogram"].items()}
             for name, s in strategies.items() if s.get("accept_length_histogram")}
    if hists:
        made["accepted length histogram"] = plots.accept_length_histogram(
            hists, out_dir / f"accept_length_histogram{suffix}.png", title)
    return made


def sweep_plot(runs: Sequence[Run], out_dir: Path) -> Path | None:
    axis = sweep_axis(runs)
    if axis is None:
        return None
    param, xs = axis
    names = list(dict.fromkeys(n for r in runs for n in r.strategies))
    tau = {n: [r.strategies.get(n, {}).get("mean_accepted_tokens") for r in runs] for n in names}
    speedup = {n: [r.strategies.get(n, {}).get("speedup") for r in runs] for n in names}
    tps = {n: [r.strategies.get(n, {}).get("tokens_per_s") for r in runs] for n in names}
    safe = param.split(" ")[0].replace(".", "_")
    return plots.sweep(param, xs, tau, speedup, out_dir / f"sweep_{safe}.png", tps)


# --- the report -----------------------------------------------------------------------------------


def _get(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _env_config(run: Run) -> dict[str, Any]:
    """The run's config with `environment` read from summary.json's top level where it is kept there."""
    env = run.summary.get("environment")
    return run.config | {"environment": env} if isinstance(env, dict) else run.config


def environment_table(runs: Sequence[Run]) -> str:
    header = ["setting", *(r.label for r in runs)] if len(runs) > 1 else ["setting", "value"]
    rows = [[title, *(_short(_get(_env_config(r), path), 60) if _get(_env_config(r), path) is not None else "-"
                      for r in runs)]
            for title, path in _ENV_ROWS]
    rows.append(["weights", *(_short(weights_text(_get(_env_config(r), "environment.weights")), 80)
                              if _get(_env_config(r), "environment.weights") is not None else "-" for r in runs)])
    rows.append(["pass cost at start-up", *(curves_text(_get(_env_config(r), "environment.pass_cost_curves")) or "-"
                                            for r in runs)])
    rows.append(["answers.jsonl rows", *("-" if r.answers is None else str(r.answers) for r in runs)])
    return markdown_table(header, rows, numeric=False)


def _command(run: Run) -> str | None:
    if run.command:
        return portable(run.command)
    if run.overrides:
        return portable("python -m specdec.run " + " ".join(run.overrides))
    return None


def _img(title: str, path: Path, out_dir: Path) -> str:
    return f"![{title}]({path.relative_to(out_dir).as_posix()})"


def _run_section(run: Run, heading: str, out_dir: Path, suffix: str) -> list[str]:
    s = run.summary
    temperature = _get(run.config, "generation.temperature")
    lines = [f"## {heading}", "",
             f"`{_shown_path(run.path, out_dir)}`: baseline **{s.get('baseline')}**, temperature {temperature}", ""]
    if s.get("interrupted"):
        lines += ["> interrupted: these are partial results.", ""]
    if s.get("failures"):
        lines += [f"> {len(s['failures'])} answers failed: {', '.join(sorted(s['failures']))}.", ""]
    lines += ["### Overall", "", overall_table(s), ""]
    by_turn = ttft_turn_table(s)
    if by_turn:
        lines += ["### TTFT by turn (ms)", "", by_turn, "",
                  "Mean time to first token per turn; with the prefix cache on, a later turn prefills only what "
                  "the conversation added since the last one.", ""]
    reps = [st["repeats"]["n"] for st in run.strategies.values() if st.get("repeats")]
    if reps:
        lines += [f"± is the half-width of a 95% t-interval over {max(reps)} repeats; speedup's interval is over "
                  "per-repeat ratios to the baseline timed in the same repeat.", ""]
    lines += ["tau: tokens committed per target forward pass (prefill counted); alpha longest path: accepted / "
              "proposed draft tokens, for trees over the longest path of each step (the alpha of other tables); "
              "alpha per node: accepted / every verified draft node (the same for chains); predicted speedup: tau "
              "relative to the baseline's over the relative cost of a decode step.",
              ""]
    if s.get("specbench"):
        lines += ["Spec-Bench speedup: Spec-Bench's mean over questions of tokens/s, the baseline's tokens "
                  f"{s['specbench'].get('baseline_tokens')} (docs/specbench.md).", ""]
    if any("speedup_ci" in st for st in run.strategies.values()):
        lines += ["speedup 95% CI: percentile interval of a paired bootstrap over questions (both strategies' "
                  "answers to the same questions resampled together; no extra run).", ""]
    lossy = [name for name, st in run.strategies.items() if st.get("lossless") is False]
    if lossy:
        lines += [f"**Lossy**: {', '.join(lossy)} did not keep the target's output exactly (an acceptance rule "
                  "that does not preserve the target's distribution, such as typical acceptance above temperature "
                  "0); compare their speed with care.", ""]
    if categories_of(s):
        lines += ["### By category", ""]
        for title, key in CATEGORY_METRICS:
            lines += [f"#### {title}", "", category_table(s, key), ""]
    made = summary_plots(s, out_dir / "plots", suffix, run.label if suffix else "")
    if made:
        lines += ["### Plots", "", *(_img(t, p, out_dir) + "\n" for t, p in made.items())]
    command = _command(run)
    if command:
        lines += ["### Command", "", "```", command, "```", ""]
    return lines


def runs_compared_table(runs: Sequence[Run]) -> str:
    rows = [[r.label, name, fmt(s.get("tokens_per_s")), fmt(s.get("speedup")), fmt(s.get("mean_accepted_tokens")),
             fmt(s.get("acceptance_rate")), interval(s.get("speedup_ci")), exactness(s)]
            for r in runs for name, s in r.strategies.items()]
    return markdown_table(["run", "strategy", "tokens/s", "speedup", "tau", "alpha", "speedup 95% CI", "lossless"],
                          rows)


def _shown_path(path: Path, out_dir: Path) -> str:
    """The run folder relative to the report (no local absolute path in a committed report)."""
    import os

    try:
        rel = os.path.relpath(path.resolve(), out_dir.resolve())
    except ValueError:  # another drive (Windows): the folder's name alone
        return path.name
    return path.name if rel == "." else Path(rel).as_posix()


def render(runs: Sequence[Run], out_dir: Path) -> str:
    """report.md's text; writes the plots it links under out_dir/plots."""
    lines = ["# specdec report", ""]
    if len(runs) > 1:
        lines += [f"{len(runs)} runs.", "", "## Runs compared", "", runs_compared_table(runs), ""]
        sweep = sweep_plot(runs, out_dir / "plots")
        if sweep is not None:
            lines += [_img("sweep", sweep, out_dir), ""]
    for i, run in enumerate(runs):
        heading = "Results" if len(runs) == 1 else f"Run {i}: {run.label}"
        lines += _run_section(run, heading, out_dir, "" if len(runs) == 1 else f"-{i}")
    lines += ["## Environment", "", environment_table(runs), ""]
    return "\n".join(lines)


def write_report(args: Sequence[str | Path], out: str | Path | None = None) -> tuple[Path, str]:
    runs = load_runs(args)
    if out is not None:
        out_dir = Path(out).expanduser()
    elif len(args) == 1:
        out_dir = Path(args[0]).expanduser()
    else:  # several folders: beside them
        import os

        out_dir = Path(os.path.commonpath([r.path.resolve() for r in runs]))
    if out_dir.exists() and not out_dir.is_dir():
        raise SpecdecError(f"--out {out_dir} is a file; give a folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    text = render(runs, out_dir)
    path = out_dir / "report.md"
    path.write_text(text)
    return path, text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.report", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="results folder(s) or multirun sweep folder(s)")
    parser.add_argument("--out", default=None, help="folder for report.md and plots/ (default: the one RUN_DIR)")
    ns = parser.parse_args(argv)
    try:
        path, text = write_report(ns.runs, ns.out)
    except SpecdecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
