"""Figures the notebooks show and save (PNG beside the executed notebook)."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt


def _save(fig, path):
    if path:
        fig.savefig(Path(path), dpi=110, bbox_inches="tight")
    return fig


def bars(labels, values, title, ylabel, path=None, log=False, threshold=None):
    fig, ax = plt.subplots(figsize=(max(4, 0.6 * len(labels) + 2), 3))
    ax.bar([str(x) for x in labels], values, color="#4c72b0")
    if threshold is not None:
        ax.axhline(threshold, color="#c44e52", ls="--", lw=1, label=f"tolerance {threshold}")
        ax.legend()
    if log:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    return _save(fig, path)


def histogram(values, title, xlabel, path=None, bins=30):
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.hist(values, bins=bins, color="#55a868")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("count")
    return _save(fig, path)


def table(rows: list[dict], cols=None, floatfmt="{:.4g}") -> str:
    """A plain-text table (no pandas needed)."""
    if not rows:
        return "(empty)"
    cols = cols or list(rows[0])
    cells = [[floatfmt.format(r.get(c)) if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols]
             for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths))
    return "\n".join([line, "-" * len(line)] + ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells])
