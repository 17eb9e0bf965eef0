"""Writer settings against each other, the writer alone (benchmarks/writer_throughput.py), rounds in turn: page-cache
and durable GB/s of each variant, every round and the medians, and each variant's durable ratio to the first one's in
the same round (median, every round, spread).

usage: python benchmarks/writer_ab.py --out DIR [--rounds 4] --variant NAME="ARGS" [--variant ...] [-- COMMON ARGS]

A variant's ARGS are writer_throughput arguments; a ``NAME=VALUE`` word in capitals among them is set in the
environment instead (``E3K_EARLY_WRITEBACK=0``). COMMON ARGS go to every run (default: --kimi --forwards 10).
Example (#13, the writer's file threads and checksum; the first variant is the baseline):
  python benchmarks/writer_ab.py --out /tmp/ab --variant sha256-4="--checksum sha256 --io-threads 4" \\
      --variant xxh3-4="--checksum xxh3_128 --io-threads 4" --variant xxh3-8="--checksum xxh3_128 --io-threads 8" \\
      -- --forwards 200 --storage bf16
Metrics: ``ab_<name>_<figure>_median`` / ``_rounds`` for writer_gb_per_s and writer_durable_gb_per_s (and, what set
the pace, writer_submit_seconds and writer_backpressure_seconds: the forwards' time waiting on a full ring), and
``ab_durable_ratio_<name>_vs_<first>`` with ``_rounds`` and ``_spread``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIGURES = ("writer_gb_per_s", "writer_durable_gb_per_s")
PACE = ("writer_submit_seconds", "writer_backpressure_seconds")  # what set the pace (see writer_throughput)


def parse_variant(text: str) -> tuple[str, list[str], dict]:
    """``NAME=ARGS`` -> (name, writer_throughput arguments, environment)."""
    name, sep, rest = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.+-]+", name):
        raise ValueError(f"--variant {text!r}: write NAME=\"ARGS\" (NAME in letters, digits, '_.+-')")
    args, env = [], {}
    for word in shlex.split(rest):
        m = re.fullmatch(r"([A-Z][A-Z0-9_]*)=(.*)", word)
        if m:
            env[m.group(1)] = m.group(2)
        else:
            args.append(word)
    return name, args, env


def one(args: list[str], env: dict) -> dict:
    """One run of the writer benchmark in its own process (settings read when the writer's modules load take
    effect); its figures as it merges them (``--out``)."""
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, str(HERE / "writer_throughput.py"), *args, "--out", out],
                       env={**os.environ, **env}, capture_output=True, text=True, check=True)
        m = json.loads((Path(out) / "metrics.json").read_text())
    st = m["writer_storage"]
    return {k: m[f"{k}_{st}"] for k in FIGURES + PACE if f"{k}_{st}" in m}


def run_rounds(variants: list[tuple[str, list[str], dict]], common: list[str], rounds: int) -> dict[str, list]:
    """Every variant once per round, in turn (a slow spell of the machine hits all of them alike)."""
    runs: dict[str, list] = {name: [] for name, _, _ in variants}
    for r in range(rounds):
        for name, args, env in variants:
            f = one([*common, *args], env)
            runs[name].append(f)
            pace = "".join(f", {k.removeprefix('writer_')} {f[k]:.2f}" for k in PACE if k in f)
            print(f"round {r} {name}: page cache {f['writer_gb_per_s']:.3f} GB/s, "
                  f"durable {f['writer_durable_gb_per_s']:.3f} GB/s{pace}", flush=True)
    return runs


def durable_ratios(runs: dict[str, list], name: str, base: str) -> list[float]:
    return [x["writer_durable_gb_per_s"] / b["writer_durable_gb_per_s"] for x, b in zip(runs[name], runs[base])]


def summarize(runs: dict[str, list]) -> dict:
    base = next(iter(runs))
    res = {"ab_variants": " ".join(runs), "ab_baseline": base, "ab_rounds": len(runs[base])}
    for name, rows in runs.items():
        for k in FIGURES + PACE:
            vals = [x[k] for x in rows if k in x]
            if not vals:
                continue
            res[f"ab_{name}_{k}_median"] = statistics.median(vals)
            res[f"ab_{name}_{k}_rounds"] = " ".join(f"{v:.3f}" for v in vals)
        if name != base:
            ratios = durable_ratios(runs, name, base)
            key = f"ab_durable_ratio_{name}_vs_{base}"
            res[key] = statistics.median(ratios)
            res[f"{key}_rounds"] = " ".join(f"{v:.3f}" for v in ratios)
            res[f"{key}_spread"] = max(ratios) - min(ratios)
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--variant", action="append", required=True, help='NAME="writer_throughput ARGS" (twice or more)')
    p.add_argument("common", nargs="*", help="after --: arguments of every run")
    a = p.parse_args(argv)
    variants = [parse_variant(v) for v in a.variant]
    if len(variants) < 2 or len({v[0] for v in variants}) != len(variants):
        p.error("name two or more variants, each once")
    res = summarize(run_rounds(variants, a.common or ["--kimi", "--forwards", "10"], a.rounds))
    res["ab_common_args"] = " ".join(a.common)
    emit(res, a.out)
    return 0


def emit(res: dict, out: str, width: int = 55) -> None:
    """``res`` into ``out``/metrics.json, and printed a figure a line."""
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "metrics.json").write_text(json.dumps(res, indent=1, sort_keys=True))
    for k, v in res.items():
        print(f"{k:{width}s} {v}")


if __name__ == "__main__":
    sys.exit(main())
