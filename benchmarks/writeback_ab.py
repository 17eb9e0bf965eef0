"""Early writeback on or off (``E3K_EARLY_WRITEBACK``), the writer alone (benchmarks/writer_throughput.py), rounds in
turn: page-cache and durable GB/s of each, every round and the medians, and the durable ratio (on / off).
A preset of benchmarks/writer_ab.py, under the names gpu-benchmark-early-writeback recorded.

usage: python benchmarks/writeback_ab.py --out DIR [--rounds 6] [writer_throughput args, default: --kimi --forwards 10]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from writer_ab import FIGURES, durable_ratios, emit, run_rounds  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=6)
    a, rest = p.parse_known_args(argv)
    args = rest or ["--kimi", "--forwards", "10", "--storage", "bf16"]
    runs = run_rounds([("off", [], {"E3K_EARLY_WRITEBACK": "0"}), ("on", [], {"E3K_EARLY_WRITEBACK": "1"})], args,
                      a.rounds)
    res = {"writeback_rounds": a.rounds, "writeback_args": " ".join(args)}
    for name, rows in runs.items():
        for k in FIGURES:
            vals = [x[k] for x in rows]
            res[f"{k}_early_{name}_median"] = statistics.median(vals)
            res[f"{k}_early_{name}_rounds"] = " ".join(f"{v:.3f}" for v in vals)
    ratios = durable_ratios(runs, "on", "off")
    res["durable_ratio_early_on_vs_off"] = statistics.median(ratios)
    res["durable_ratio_early_on_vs_off_rounds"] = " ".join(f"{v:.3f}" for v in ratios)
    res["durable_ratio_early_on_vs_off_spread"] = max(ratios) - min(ratios)
    emit(res, a.out, width=45)
    return 0


if __name__ == "__main__":
    sys.exit(main())
