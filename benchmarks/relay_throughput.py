"""The relay alone (live/relay.py): captures written into a capture folder as the hook's writer writes them (file,
marker, journal line), moved by a sender process to a receiver into another folder, both on RAM filesystems. Prints
each round's GB/s (bytes of sample files over the time from the first write to the last arrival), the median and the
spread, and what that carries in tokens/s at Kimi-K2.5's geometry (4 slots of hidden 7168 in bf16: 57,344 B a token).
On one host the transport is loopback TCP; across hosts the network bounds it.

usage: python benchmarks/relay_throughput.py [--samples 200] [--sample-mb 8] [--rounds 3] [--out DIR (metrics.json)]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KIMI_BYTES_PER_TOKEN = 4 * 7168 * 2


def one_round(samples: int, sample_mb: float, port: int) -> float:
    from eagle3kit.capture.format import sample_name, write_marker
    from eagle3kit.live.relay import RelayReceiver

    root = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="e3k-relay-bench-"))
    cap, dest = root / "capture", root / "trainer"
    cap.mkdir()
    try:
        receiver = RelayReceiver(dest, port, 1, host="127.0.0.1", timeout_s=120).start()
        sender = subprocess.Popen([sys.executable, "-m", "eagle3kit.cli", "relay", "--capture-dir", str(cap), "--to",
                                   f"127.0.0.1:{port}", "--index", "1", "--of", "1", "--timeout", "120"],
                                  stdout=subprocess.DEVNULL)
        data = os.urandom(int(sample_mb * 2 ** 20))
        if not receiver.wait_ready(120):  # the group is up: the clock starts with the writes
            raise SystemExit(f"the relay sender did not join: {receiver.error}")
        t0 = time.perf_counter()
        for i in range(samples):
            name = f"{sample_name(f'k{i}', 0)}.safetensors"
            (cap / name).write_bytes(data)
            write_marker(cap, f"k{i}", 0, {"status": "ok", "key": f"k{i}", "rank": 0, "file": name,
                                           "bytes": len(data)})
        while receiver.counts["relay_samples"] < samples and receiver.error is None:
            time.sleep(0.001)
        took = time.perf_counter() - t0
        sender.send_signal(2)
        sender.wait(60)
        receiver.close(wait_s=10)
        return samples * len(data) / took / 1e9
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--sample-mb", type=float, default=8.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--port", type=int, default=29731)
    p.add_argument("--out", help="write DIR/metrics.json")
    a = p.parse_args(argv)
    rates = [one_round(a.samples, a.sample_mb, a.port + r) for r in range(a.rounds)]
    med = statistics.median(rates)
    print("rounds GB/s: " + " / ".join(f"{r:.3f}" for r in rates))
    print(f"median {med:.3f} GB/s (spread {min(rates):.3f}-{max(rates):.3f}); at Kimi-K2.5's 57,344 B a token "
          f"(bf16, 4 slots): {med * 1e9 / KIMI_BYTES_PER_TOKEN:,.0f} tokens/s")
    if a.out:
        import json

        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "metrics.json").write_text(json.dumps({
            "relay_gb_per_s": med, "relay_gb_per_s_rounds": rates, "relay_samples": a.samples,
            "relay_sample_mb": a.sample_mb, "relay_kimi_tokens_per_s": med * 1e9 / KIMI_BYTES_PER_TOKEN,
            "cpus": os.cpu_count()}, indent=1))


if __name__ == "__main__":
    main()
