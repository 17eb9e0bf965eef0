"""``eagle3kit compare RUN...`` and notebook 06: the metrics.json of any set of runs side by side.

A run is a folder (a pipeline run of ``eagle3kit run``, a training out_dir, a GPU record: the metrics.json files
under it merged into one row, named by the folder) or one metrics.json file. The table shows what makes experiments
differ (data, engine, layers, storage, loss, TTT, serving setting) beside what they reached (held-out accuracy,
offline tau, online accept length, speedup, break-even); the plots draw accept length and speedup against the
number of draft steps for every run that has a sweep, and by run the offline figures beside the online one.

Offline, two figures differ in kind: tau weighs every draft position alike, while the serving walk counts round by
round as SGLang does (``offline.walk``), so the walk is the one to hold against online accept length; the walk on
the stored replies of the conversations the online batch served (``offline_walk_same_replies``) separates the
drafter's fidelity from the choice of prompts (``gpu-drafter-pipeline-8``: walk on the held-out set 17 % above
online, on those replies 4.9 %), as far as online decoding keeps to them (``main_common_prefix_with_stored``).
A folder is one run: every metrics.json under it is merged (a GPU record's phases, a pipeline's steps).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

COLUMNS = ["run", "extract_engine", "extract_regenerated", "layer_ids", "storage", "train_loss", "train_ttt_steps",
           "train_lm_head", "train_samples", "train_tokens", "train_acc_pos0", "baseline_acc_pos0", "offline_tau",
           "offline_walk_accept_length", "offline_walk_same_replies", "main_common_prefix_with_stored",
           "online_serving", "online_accept_length", "online_accept_length_ci95_low", "online_accept_length_ci95_high",
           "online_speedup", "breakeven_accept_length", "plain_ms_per_token", "online_cycle_ms",
           "online_speedup_marginal", "breakeven_marginal_accept_length", "online_request_fixed_ms",
           "plain_request_fixed_ms", "online_first_token_ms", "plain_first_token_ms", "online_best_setting",
           "online_best_baseline", "online_best_speedup", "online_best_speedup_rounds_min", "online_best_speedup_rounds_max",
           "online_best_speedup_pooled",
           "online_best_speedup_ci95_low", "online_best_speedup_ci95_high",
           "negative_control_accept_length",
           "negative_control_accept_cost_ci95_low", "engine_control_accept_length", "fp8_accept_rel_diff"]


BARS = [("offline_tau", "offline tau ({steps})"),
        ("offline_walk_accept_length", "offline walk, held out ({steps})"),
        ("offline_walk_same_replies", "offline walk, batch 1's stored replies"),
        ("online_accept_length", "online accept length ({steps}), 95 % over prompts")]
LEGACY_SERVING = "3,1,4"  # the serving setting of runs recorded before 05 wrote online_serving (every one used it)


def serving_of(row: dict) -> tuple[int, int, int] | None:
    """(steps, topk, draft tokens) a run's main drafter was served and measured at (``online_serving``, "3,1,4"; a
    run recorded before 05 wrote it was served at (3,1,4), as training evaluates tau at 3 steps); None where the
    value is not three integers."""
    nums = [int(x) for x in re.findall(r"\d+", str(row.get("online_serving", LEGACY_SERVING)))]
    return (nums[0], nums[1], nums[2]) if len(nums) == 3 else None


def _steps_label(rows) -> str:
    steps = {(serving_of(r) or (None,))[0] for r in rows}
    return f"{steps.pop()} steps" if len(steps) == 1 and None not in steps else "each run's serving steps"


FIGURES = ("offline_tau", "online_accept_length", "train_acc_pos0")  # a row needs one of them


def _row(path: Path, skipped: list) -> dict | None:
    """A run's figures: a metrics.json, or every metrics.json under a folder merged (the deepest first, so a run's
    own summary wins over its steps'). What cannot be read is told in ``skipped``."""
    if not path.exists():
        skipped.append(f"{path}: no such file or folder (give a run folder or a metrics.json)")
        return None
    files = [path] if path.is_file() else sorted(path.rglob("metrics.json"), key=lambda f: (-len(f.parts), str(f)))
    m: dict = {}
    for f in files:
        try:
            d = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            skipped.append(f"{f}: unreadable, left out ({type(e).__name__}: {str(e)[:120]})")
            continue
        if isinstance(d, dict):
            m.update(d)
        else:
            skipped.append(f"{f}: not a flat metrics object ({type(d).__name__}), left out")
    if not any(k in m for k in FIGURES):
        skipped.append(f"{path}: none of {', '.join(FIGURES)} in {len(files)} metrics.json file(s): no row")
        return None
    return {"run": path.parent.name if path.is_file() else path.name, "_path": str(path), **m}


def collect(paths, skipped: list | None = None) -> list[dict]:
    """One row per path given (a folder: its metrics.json files merged), each named by its folder (and a file's stem
    where it is not metrics.json), or by as many of the folders above as keep the names apart (records/-12/serve and
    records/-13/serve: -12/serve, -13/serve). ``skipped``: a list that receives a line for each path or file left
    out, and why (missing, unreadable, no figures)."""
    rows, skipped = [], skipped if skipped is not None else []
    for p in map(Path, paths):
        r = _row(p, skipped)
        if r is not None:
            rows.append(r)
    for r, name in zip(rows, _distinct_names([Path(r["_path"]) for r in rows])):
        r["run"] = name
    return rows


def _distinct_names(paths: list[Path]) -> list[str]:
    """Each path's last folder (a file: its folder, and its stem unless metrics.json), with as many folders above it
    as tell it apart from the others."""
    parts = [(*p.parent.parts, p.stem) if p.is_file() and p.name != "metrics.json" else
             p.parent.parts if p.is_file() else p.parts for p in paths]
    depth = [1] * len(parts)
    while True:
        names = ["/".join(f[-d:]) for f, d in zip(parts, depth)]
        longer = [i for i, n in enumerate(names) if names.count(n) > 1 and depth[i] < len(parts[i])]
        if not longer:
            return names
        for i in longer:
            depth[i] += 1


def table(rows: list[dict]) -> str:
    from eagle3kit.plots import table as fmt

    cols = [c for c in COLUMNS if any(c in r for r in rows)]
    # each serving variant's main against plain on SGLang's defaults (05's <variant>_speedup_vs_plain), after the best
    cols += sorted({k for r in rows for k in r if k.endswith("_speedup_vs_plain")})
    return fmt([{c: r.get(c, "") for c in cols} for r in rows], cols, floatfmt="{:.3f}")


# the claims a headline may state: main's figures (at the run's serving setting) and each chain setting's
HEADLINE_KEYS = ("offline_tau", "offline_walk_accept_length", "online_accept_length", "online_speedup",
                 "online_speedup_c8", "online_speedup_c32", "breakeven_accept_length")
HEADLINE_SETTING = re.compile(r"steps\d+_(accept_length|speedup)")  # a chain setting's figure: its setting in its name


def headlines(rows: list[dict]) -> list[dict]:
    """Each claim as every comparable run measured it: per figure (``HEADLINE_KEYS`` at one serving setting, or a
    chain setting's own ``steps<n>_accept_length`` / ``_speedup``), the median over the runs that have it, their
    count and range, and every run's value in the order given. Never the best run: a headline is this median with
    its runs listed (the fastest of four runs is the top of their spread, not what a user should expect). The
    within-run pick of the fastest setting (``online_best_*``) is no claim here for the same reason."""
    import statistics

    groups: dict = {}
    for r in rows:
        setting = ",".join(map(str, serving_of(r) or ("?",)))
        for k, v in r.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v):
                continue
            if k in HEADLINE_KEYS:
                groups.setdefault((k, setting), []).append((r["run"], float(v)))
            elif HEADLINE_SETTING.fullmatch(k):
                groups.setdefault((k, ""), []).append((r["run"], float(v)))
    out = []
    for (k, setting), runs in sorted(groups.items(), key=lambda g: (_claim_order(g[0][0]), g[0])):
        vals = [v for _, v in runs]
        out.append({"claim": k, "setting": setting, "median": statistics.median(vals), "runs": len(runs),
                    "min": min(vals), "max": max(vals), "each": runs})
    return out


def _claim_order(key: str) -> tuple:
    return (HEADLINE_KEYS.index(key), 0) if key in HEADLINE_KEYS else \
        (len(HEADLINE_KEYS), int(re.search(r"\d+", key).group()))


def headline_table(rows: list[dict]) -> str:
    """``headlines`` as text: claim, serving setting, median over runs, how many, their range, each run's value."""
    from eagle3kit.plots import table as fmt

    return fmt([{"claim": h["claim"], "serving": h["setting"], "median": h["median"], "runs": h["runs"],
                 "range": f"{h['min']:.3f}-{h['max']:.3f}",
                 "each run": ", ".join(f"{run} {v:.3f}" for run, v in h["each"])} for h in headlines(rows)],
               floatfmt="{:.3f}")


def headline_metrics(rows: list[dict]) -> dict:
    """``headlines`` as flat metrics for 06's record: ``headline_<claim>[_<setting>]_median`` and ``_runs``."""
    m = {}
    for h in headlines(rows):
        key = f"headline_{h['claim']}" + (f"_{h['setting'].replace(',', '_')}" if h["setting"] else "")
        m[f"{key}_median"], m[f"{key}_runs"] = h["median"], h["runs"]
    return m


def sweep(row: dict, kind: str) -> list[tuple[int, float]]:
    """(steps, value) of a run's chain sweep: kind 'accept' (online), 'speedup', 'offline' (tau) or 'walk' (the
    offline serving walk, for every chain length evaluated)."""
    pat = {"accept": r"steps(\d+)_accept_length$", "speedup": r"steps(\d+)_speedup$",
           "offline": r"offline_tau_steps(\d+)$", "walk": r"offline_walk_accept_length_(\d+)$"}[kind]
    pts = sorted((int(m.group(1)), v) for k, v in row.items() if (m := re.match(pat, k)) and isinstance(v, (int, float)))
    return pts


def plot(rows: list[dict], path=None):
    import matplotlib.pyplot as plt

    from eagle3kit.plots import say_empty

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    a, b, c = axes
    noted = 0  # break-even lines written so far
    for r in rows:
        on, off, walk, sp = sweep(r, "accept"), sweep(r, "offline"), sweep(r, "walk"), sweep(r, "speedup")
        if on:
            line, = a.plot(*zip(*on), "o-", label=f"{r['run']} online")
            color = {"color": line.get_color()}
        else:
            color = {}
        if walk:
            a.plot(*zip(*walk), "s--", label=f"{r['run']} offline walk", **color)
        if off:
            a.plot(*zip(*off), "x:", alpha=0.6, label=f"{r['run']} offline tau", **color)
        if sp:
            nan = float("nan")  # each point's range over its rounds, each paired with plain's round of that moment
            lo = [v - r.get(f"steps{n}_speedup_rounds_min", nan) for n, v in sp]
            hi = [r.get(f"steps{n}_speedup_rounds_max", nan) - v for n, v in sp]
            # the medians' ratio may round a hair past equal rounds' (matplotlib refuses a negative error); nan stays
            lo, hi = ([e if math.isnan(e) else max(e, 0.0) for e in x] for x in (lo, hi))
            bar = b.errorbar(*zip(*sp), yerr=[lo, hi], fmt="o-", capsize=3, label=r["run"])
            if r.get("breakeven_accept_length"):  # one line per run, in its colour
                b.annotate(f"break-even accept {r['breakeven_accept_length']:.2f} "
                           f"({(serving_of(r) or ('?',))[0]} steps)",
                           (0.02, 0.92 - 0.06 * noted),
                           xycoords="axes fraction", fontsize=7, color=bar[0].get_color())
                noted += 1
    a.set(xlabel="draft steps (chain)", ylabel="accept length (tokens / verify)", title="accept length vs steps")
    say_empty(a, "no run has a sweep over draft steps\n(05 with online=True on a GPU, or offline tau by steps)")
    if not say_empty(b, "no speedup measured: no run served its drafter\n(05 with online=True, on a GPU)"):
        b.axhline(1.0, color="grey", ls=":", lw=1)
    b.set(xlabel="draft steps (chain)", ylabel="speedup vs plain, batch 1", title="speedup vs steps")
    names = [r["run"] for r in rows]
    bars = [(k, label.format(steps=_steps_label(rows))) for k, label in BARS
            if any(isinstance(r.get(k), (int, float)) for r in rows)]
    width = 0.8 / max(1, len(bars))
    for j, (k, label) in enumerate(bars):
        vals = [r.get(k) if isinstance(r.get(k), (int, float)) else 0 for r in rows]
        err = None
        if k == "online_accept_length" and any("online_accept_length_ci95_low" in r for r in rows):
            nan = float("nan")  # the prompts' 95 % interval, where the run has one (no bar drawn where it has none)
            err = [[v - r.get("online_accept_length_ci95_low", nan) for v, r in zip(vals, rows)],
                   [r.get("online_accept_length_ci95_high", nan) - v for v, r in zip(vals, rows)]]
        c.bar([i - 0.4 + (j + 0.5) * width for i in range(len(rows))], vals, width, label=label, yerr=err, capsize=3)
    c.set(title="offline vs online by run")
    if not say_empty(c, "no run has offline tau, the offline walk or online accept length"):
        top = max([r.get(k) for r in rows for k, _ in bars if isinstance(r.get(k), (int, float))]
                  + [r.get("online_accept_length_ci95_high", 0) for r in rows] + [1.0])
        c.set_ylim(0, 1.45 * top)  # room above the bars for the legend
        c.set_xticks(list(range(len(rows))), names, rotation=30, ha="right", fontsize=7)
        c.set(ylabel="tokens per verify")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    fig.tight_layout()
    if path:
        fig.savefig(Path(path), dpi=110, bbox_inches="tight")
    return fig


CONTROLS = [("trained (SGLang states)", "online", ""), ("layer ids off by one", "negative_control", "offbyone"),
            ("final slot post-norm", "postnorm", "postnorm"), ("states from transformers", "engine", "engine"),
            ("fp8 storage", "fp8", "fp8"), ("original replies", "original", "original"),
            ("lm_head frozen", "frozen_head", "frozen_head"),
            ("same recipe, training seed 1", "seed1", "seed1")]  # (label, metrics key, doctor key)


def control_label(m: dict, label: str, key: str, doctor: str) -> str:
    """A control's bar label: the mistake, whether the doctor flags it before serving, what it costs against the
    trained drafter on the same prompts (the paired 95 % interval; above 0: the cost exceeds the prompts' spread),
    and its offline tau on its held-out split with the change against the trained drafter's
    (``experiment.control_offline``: tens of thousands of rows, finer than the prompts served)."""
    parts = [label]
    if doctor and m.get(f"{doctor}_doctor_ok") is not None:
        parts.append("doctor flags it" if m[f"{doctor}_doctor_ok"] is False else "doctor: ok")
    lo, hi = m.get(f"{key}_accept_cost_ci95_low"), m.get(f"{key}_accept_cost_ci95_high")
    if lo is not None and hi is not None:
        parts.append(f"cost [{lo:+.2f}, {hi:+.2f}]")
    tau, rel = m.get(f"{doctor}_offline_tau" if doctor else "offline_tau"), m.get(f"{doctor}_offline_rel_diff")
    if tau is not None:
        parts.append(f"offline tau {tau:.3f}" + (f" ({rel:+.1%})" if doctor and rel is not None else ""))
    return "\n".join([parts[0], " · ".join(parts[1:])]) if len(parts) > 1 else parts[0]


def controls_plot(m: dict, title: str, path=None):
    """One run's accept length per experiment: the trained drafter against each mistake, each labelled with the
    doctor's verdict and its paired cost interval against the trained drafter."""
    import matplotlib.pyplot as plt

    items = [(control_label(m, label, k, d), m[f"{k}_accept_length"], m.get(f"{k}_accept_length_ci95_low"),
              m.get(f"{k}_accept_length_ci95_high")) for label, k, d in CONTROLS
             if m.get(f"{k}_accept_length") is not None][::-1]
    fig, ax = plt.subplots(figsize=(7.5, 0.62 * len(items) + 1.2))
    err = [[v - (lo if lo is not None else v) for _, v, lo, _ in items],
           [(hi if hi is not None else v) - v for _, v, _, hi in items]]
    ax.barh([k for k, *_ in items], [v for _, v, *_ in items], color="#4c72b0",
            xerr=err if any(err[0]) or any(err[1]) else None, capsize=3)
    for i, (_, v, *_r) in enumerate(items):
        ax.annotate(f"{v:.3f}", (0, i), xytext=(4, 0), textcoords="offset points", va="center", fontsize=7,
                    color="white")
    if m.get("breakeven_accept_length"):
        ax.axvline(m["breakeven_accept_length"], color="#c44e52", ls="--", lw=1, label="break-even (batch 1)")
        ax.legend(fontsize=7)
    ax.axvline(1.0, color="grey", ls=":", lw=1)
    ax.tick_params(axis="y", labelsize=7)
    s, t, d = serving_of(m) or ("?", "?", "?")
    ax.set_xlabel(f"online accept length in SGLang ({s} steps, topk {t}, {d} draft tokens; 95 % over prompts)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    if path:
        fig.savefig(Path(path), dpi=110, bbox_inches="tight")
    return fig


def write_report(rows: list[dict], out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    text = f"{table(rows)}\n\neach claim over the runs that measured it (median, never the best run):\n" \
           f"{headline_table(rows)}"
    (out / "compare.txt").write_text(text + "\n")
    plot(rows, out / "compare.png")
    return f"{text}\n\nwritten: {out / 'compare.txt'}, {out / 'compare.png'}"
