"""`eagle3kit verify` (store.verify: read, checksum (xxh3-128 by default, or sha256), decode, token ids, finite
values) over a data set, by one thread and by several, in alternating rounds on the same files. Prints a table with
every round, the median and the spread.

The data set is written here with the capture's own writer (capture.format.write_sample, the manifest as extraction
writes it) from random states of the embedded default's shape (4 slots, hidden 576) or Kimi-K2.5's (--kimi: hidden
7168); nothing is downloaded. The files are read from the page cache after the first round (the cache is what a
check right after extraction reads; `--drop-caches` as root reads from the disk each round).

usage: python benchmarks/verify_throughput.py [--samples 200] [--tokens 1024] [--storage bf16] [--workers 1 8]
       [--rounds 3] [--dir /tmp/e3k-verify] [--kimi] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import torch


def make_dataset(d: Path, samples: int, tokens: int, hidden: int, storage: str, slots: int = 4) -> int:
    """A data set ``verify`` accepts, written as extraction writes one (its settings, the capture's sample writer, the
    manifest writer); returns its bytes on disk."""
    from eagle3kit import checksum
    from eagle3kit.capture.format import write_sample
    from eagle3kit.store import ManifestWriter, check_settings, token_sha256

    shutil.rmtree(d, ignore_errors=True)
    (d / "samples").mkdir(parents=True)
    layer_ids = list(range(1, slots + 1))
    check_settings(d, {"layer_ids": layer_ids, "hidden_size": hidden, "storage": storage})
    g = torch.Generator().manual_seed(0)
    total, manifest = 0, ManifestWriter(d)
    for i in range(samples):
        key = f"s{i:07d}"
        ids = torch.randint(0, 49152, (tokens,), generator=g)
        hs = torch.randn(tokens, slots, hidden, generator=g).to(torch.bfloat16)
        m = write_sample(d / "samples", key, 0, {"hidden_states": hs, "token_ids": ids},
                         {"engine": "benchmark", "layer_ids": layer_ids}, storage)
        total += m["bytes"]
        manifest.append({"key": key, "index": i, "split": "train", "n_tokens": tokens, "file": m["file"],
                         "bytes": m["bytes"], **checksum.carry(m), "token_sha256": token_sha256(ids),
                         "loss_spans": [[0, tokens]], "storage": storage}, d / "samples" / m["file"])
    manifest.close()
    return total


def main(argv=None) -> dict:
    from eagle3kit.store import verify

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--storage", default="bf16", choices=["bf16", "fp8"])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, min(8, os.cpu_count() or 1)])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/e3k-verify")
    ap.add_argument("--kimi", action="store_true", help="hidden 7168 (Kimi-K2.5) instead of 576")
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before each pass (root)")
    ap.add_argument("--out", help="folder for metrics.json")
    a = ap.parse_args(argv)
    d = Path(a.dir)
    hidden = 7168 if a.kimi else 576
    t = time.time()
    nbytes = make_dataset(d, a.samples, a.tokens, hidden, a.storage)
    print(f"data set: {a.samples} samples x {a.tokens} tokens, hidden {hidden}, {a.storage}, {nbytes / 1e9:.2f} GB "
          f"written in {time.time() - t:.1f} s; {os.cpu_count()} cores", flush=True)
    verify(d, workers=1)  # the first pass reads the files into the page cache: not timed
    secs: dict[int, list[float]] = {w: [] for w in a.workers}
    for r in range(a.rounds):
        for w in a.workers:  # alternating: a drift of the machine hits every setting alike
            if a.drop_caches:
                os.sync()
                Path("/proc/sys/vm/drop_caches").write_text("3\n")
            t = time.time()
            rep = verify(d, workers=w)
            secs[w].append(time.time() - t)
            if not rep.passed or rep.ok != a.samples:
                raise SystemExit(f"verify failed on the benchmark's own data: {rep.problems[:3]}")
    base = statistics.median(secs[a.workers[0]])
    print(f"{'workers':>8} {'rounds (s)':>28} {'median s':>9} {'GB/s':>7} {'spread':>7} {'vs ' + str(a.workers[0]):>7}")
    m = {"verify_samples": a.samples, "verify_tokens": a.tokens, "verify_hidden": hidden, "verify_storage": a.storage,
         "verify_bytes": nbytes, "verify_cores": os.cpu_count(), "verify_page_cache": not a.drop_caches}
    for w, s in secs.items():
        med = statistics.median(s)
        spread = (max(s) - min(s)) / med
        print(f"{w:>8} {' '.join(f'{x:.2f}' for x in s):>28} {med:>9.2f} {nbytes / med / 1e9:>7.2f} {spread:>7.1%} "
              f"{base / med:>7.2f}")
        m.update({f"verify_w{w}_seconds_rounds": s, f"verify_w{w}_gb_per_s": nbytes / med / 1e9,
                  f"verify_w{w}_spread": spread, f"verify_w{w}_speedup": base / med})
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "metrics.json").write_text(json.dumps(m, indent=1))
    shutil.rmtree(d, ignore_errors=True)
    return m


if __name__ == "__main__":
    main()
