"""Figures the notebooks show and save (PNG beside the executed notebook)."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt


def _save(fig, path):
    if path:
        fig.savefig(Path(path), dpi=110, bbox_inches="tight")
    return fig


def say_empty(ax, what: str) -> bool:
    """A panel without data says so in the panel (``what``: which data it lacks and why), with no ticks to suggest a
    scale; empty axes read as a plot that failed, or as values of 0. Returns True when it wrote, so a caller can
    write ``if not data: say_empty(...)``: nothing is written where the panel holds a line, a bar or an image."""
    if ax.lines or ax.patches or ax.collections or ax.images or ax.containers:
        return False
    ax.text(0.5, 0.5, what, ha="center", va="center", wrap=True, fontsize=8, color="#555555", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])
    return True


def bars(labels, values, title, ylabel, path=None, log=False, threshold=None, xlabel=None):
    """Bars with each value written on it, on a scale where they are visible (a bar of 0 or 0.002 still reads)."""
    fig, ax = plt.subplots(figsize=(max(4, 0.6 * len(labels) + 2), 3))
    ax.bar([str(x) for x in labels], values, color="#4c72b0")
    for i, v in enumerate(values):
        ax.annotate(f"{v:.3g}", (i, v), ha="center", va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
    if threshold is not None:
        ax.axhline(threshold, color="#c44e52", ls="--", lw=1, label=f"tolerance {threshold}")
        ax.legend(fontsize=7)
    positive = [v for v in values if v > 0]
    if threshold and positive and max(values) < threshold / 10:
        log = True  # a bar of 0.002 under a line at 0.1 does not read on a linear axis
    if log:
        ax.set_yscale("log")
    else:
        top = max([*values, threshold or 0, 0])
        ax.set_ylim(0, top * 1.2 if top > 0 else 1)  # all zero (bitwise equal): an axis that shows it
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    if xlabel:
        ax.set_xlabel(xlabel)
    return _save(fig, path)


def train_curves(log: list[dict], evals: list[dict], ttt_steps: int, loss: str, baseline: float, path=None):
    """Training loss per TTT position (train_log.jsonl) and held-out acceptance per position (evals.jsonl)."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.3))
    for k in range(ttt_steps):
        pts = [(r["step"], r[f"loss_pos{k}"]) for r in log if f"loss_pos{k}" in r]
        if pts:
            a.plot(*zip(*pts), lw=0.8, label=f"position {k}")
        e = [(r["step"], r[f"heldout_acc_pos{k}"]) for r in evals if f"heldout_acc_pos{k}" in r]
        if e:
            b.plot(*zip(*e), "o-", ms=3, label=f"position {k}")
    say_empty(a, "no training steps logged")
    if not say_empty(b, "no held-out evaluation logged"):
        b.axhline(baseline, color="grey", ls=":", label="most frequent token (pos 0)")
    a.set(xlabel="optimizer step", ylabel=f"training loss ({loss}, nats)", title="training loss per TTT position")
    b.set(xlabel="optimizer step", ylabel="held-out acceptance through k (fraction)",
          title="held-out acceptance per position")
    a.legend(fontsize=6)
    b.legend(fontsize=6)
    fig.tight_layout()
    return _save(fig, path)


def capture_pace(rows: list[dict], path=None):
    """A live run's capture side through the run (``LiveStream``'s pace log): tokens/s per interval, and the samples
    buffered ahead of the trainer."""
    fig, ax = plt.subplots(figsize=(6, 3))
    if rows:
        x = [r["t"] / 60 for r in rows]
        ax.plot(x, [r["capture_tokens_per_s"] for r in rows], marker="o", ms=3, label="captured tokens/s")
        ax.set_ylim(bottom=0)
        ax2 = ax.twinx()
        ax2.plot(x, [r["buffered"] for r in rows], color="#dd8452", lw=1, label="buffered samples (right)")
        ax2.set_ylim(bottom=0)
        ax.legend(handles=ax.lines + ax2.lines, fontsize=7, loc="lower right")
        ax.set_xlabel("minutes since the first capture")
    say_empty(ax, "no capture interval logged (not a live run, or it captured nothing)")
    ax.set_title("capture side of the live run")
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
    cols = cols or list(dict.fromkeys(k for r in rows for k in r))  # every row's keys, first seen first
    cells = [[floatfmt.format(r.get(c)) if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols]
             for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths))
    return "\n".join([line, "-" * len(line)] + ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells])
