"""PNG plots of specdec results, drawn on bare matplotlib Figures.

Figures are built without pyplot, so nothing here switches the caller's backend (a notebook keeps
its own) and no display is needed: Figure.savefig renders PNGs with Agg.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.figure import Figure

Value = float | None


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    return path


def speedup_by_category(speedups: Mapping[str, Mapping[str, Value]], path: Path, title: str = "") -> Path:
    """Grouped bars: one group per category (the overall figure last), one bar per strategy.

    speedups: strategy -> {category: speedup}; missing or None values leave a gap.
    """
    strategies = list(speedups)
    categories: list[str] = []
    for per_cat in speedups.values():
        categories += [c for c in per_cat if c not in categories]
    fig = Figure(figsize=(max(6.0, 1.1 * len(categories) * max(1, len(strategies)) / 2 + 2), 4.0))
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(strategies))
    for i, name in enumerate(strategies):
        xs = [j + (i - (len(strategies) - 1) / 2) * width for j in range(len(categories))]
        ys = [speedups[name].get(c) for c in categories]
        ax.bar([x for x, y in zip(xs, ys) if y is not None], [y for y in ys if y is not None], width, label=name)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")  # the baseline's own level
    ax.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
    ax.set_ylabel("speedup over baseline")
    ax.set_title(title or "speedup by category")
    ax.legend(fontsize="small")
    return _save(fig, path)


def acceptance_by_position(curves: Mapping[str, Sequence[float]], path: Path, title: str = "") -> Path:
    """Acceptance rate of the k-th draft token (k from 1), one line per drafting strategy."""
    fig = Figure(figsize=(6.0, 4.0))
    ax = fig.add_subplot()
    for name, rates in curves.items():
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=name)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0.0, 1.05)
    ax.set_title(title or "acceptance by draft position")
    ax.legend(fontsize="small")
    return _save(fig, path)


def accept_length_histogram(hists: Mapping[str, Mapping[int, int]], path: Path, title: str = "") -> Path:
    """Share of target passes that committed n tokens, side by side per strategy."""
    seen = {n for h in hists.values() for n in h}
    lengths = list(range(min(seen), max(seen) + 1)) if seen else []  # empty lengths show as gaps
    fig = Figure(figsize=(max(6.0, 0.5 * len(lengths) + 3), 4.0))
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(hists))
    for i, (name, hist) in enumerate(hists.items()):
        total = sum(hist.values()) or 1
        xs = [n + (i - (len(hists) - 1) / 2) * width for n in lengths]
        ax.bar(xs, [hist.get(n, 0) / total for n in lengths], width, label=name)
    ax.set_xticks(lengths)
    ax.set_xlabel("tokens committed per target pass")
    ax.set_ylabel("share of passes")
    ax.set_title(title or "accepted length histogram")
    ax.legend(fontsize="small")
    return _save(fig, path)


def sweep(param: str, xs: Sequence[float], tau: Mapping[str, Sequence[Value]],
          speedup: Mapping[str, Sequence[Value]], path: Path,
          tokens_per_s: Mapping[str, Sequence[Value]] | None = None) -> Path:
    """tau, speedup (and tokens/s) against the one parameter the runs differ in, one line per strategy."""
    panels = [("tau (tokens per target pass)", tau), ("speedup", speedup)]
    if tokens_per_s is not None:
        panels.append(("tokens/s", tokens_per_s))
    fig = Figure(figsize=(5.0 * len(panels), 4.0))
    for k, (label, series) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), k + 1)
        for name, ys in series.items():
            pts = sorted((x, y) for x, y in zip(xs, ys) if y is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        if label == "speedup":
            ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")  # the baseline's own level
        ax.set_xticks(sorted(set(xs)))  # the swept values themselves, not a linear grid
        ax.set_xlabel(param)
        ax.set_ylabel(label)
        ax.legend(fontsize="small")
    fig.suptitle(f"{param} sweep")
    return _save(fig, path)
