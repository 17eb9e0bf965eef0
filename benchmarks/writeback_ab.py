"""Early writeback on or off (``E3K_EARLY_WRITEBACK``), the writer alone (benchmarks/writer_throughput.py), rounds in
turn: page-cache and durable GB/s of each, every round and the medians, and the durable ratio (on / off).

usage: python benchmarks/writeback_ab.py --out DIR [--rounds 6] [writer_throughput args, default: --kimi --forwards 10]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def one(early: bool, args: list[str]) -> dict:
    """One run of the writer benchmark in its own process (the flag is read when the writer's modules load); its
    figures as it merges them (``--out``)."""
    env = {**os.environ, "E3K_EARLY_WRITEBACK": "1" if early else "0"}
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, str(HERE / "writer_throughput.py"), *args, "--out", out], env=env,
                       capture_output=True, text=True, check=True)
        m = json.loads((Path(out) / "metrics.json").read_text())
    st = m["writer_storage"]
    return {k: m[f"{k}_{st}"] for k in ("writer_gb_per_s", "writer_durable_gb_per_s")}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=6)
    a, rest = p.parse_known_args(argv)
    args = rest or ["--kimi", "--forwards", "10", "--storage", "bf16"]
    runs = {"off": [], "on": []}
    for r in range(a.rounds):
        for name in ("off", "on"):
            f = one(name == "on", args)
            runs[name].append(f)
            print(f"round {r} early writeback {name}: page cache {f['writer_gb_per_s']:.3f} GB/s, "
                  f"durable {f['writer_durable_gb_per_s']:.3f} GB/s", flush=True)
    res = {"writeback_rounds": a.rounds, "writeback_args": " ".join(args)}
    for name, rows in runs.items():
        for k in ("writer_gb_per_s", "writer_durable_gb_per_s"):
            vals = [x[k] for x in rows]
            res[f"{k}_early_{name}_median"] = statistics.median(vals)
            res[f"{k}_early_{name}_rounds"] = " ".join(f"{v:.3f}" for v in vals)
    ratios = [on["writer_durable_gb_per_s"] / off["writer_durable_gb_per_s"] for on, off in zip(runs["on"], runs["off"])]
    res["durable_ratio_early_on_vs_off"] = statistics.median(ratios)
    res["durable_ratio_early_on_vs_off_rounds"] = " ".join(f"{v:.3f}" for v in ratios)
    res["durable_ratio_early_on_vs_off_spread"] = max(ratios) - min(ratios)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(res, indent=1, sort_keys=True))
    for k, v in res.items():
        print(f"{k:45s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
