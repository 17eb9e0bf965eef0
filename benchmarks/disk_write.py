"""The storage side of extraction on this machine: how fast files of capture size can be written (page cache and
disk), hashed, and where scratch space lives. Prints a table; run it beside extract_throughput.py to tell whether
a capture run is bound by the server or by the disk.

usage: python benchmarks/disk_write.py [--dir /tmp/e3k-disk] [--gb 16] [--file-mb 6.3] [--threads 4]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eagle3kit import checksum


def measure(folder, gb: float = 16, file_mb: float = 6.3, threads: int = 4) -> dict:
    """Bytes/s of files of ``file_mb`` written to ``folder`` by ``threads`` threads: as the writes returned (page
    cache) and until ``os.sync()`` returned (on disk: the durable bandwidth), and each file checksum
    (``eagle3kit.checksum``) on one thread."""
    d = Path(folder)
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    os.sync()  # start with no dirty pages of earlier work
    blob = os.urandom(int(file_mb * 2**20))
    n = max(1, int(gb * 2**30 / len(blob)))
    hashes = {}
    for algorithm in checksum.ALGORITHMS:
        t = time.time()
        for _ in range(max(1, n // 20)):
            checksum.digest(blob, algorithm)
        hashes[f"{algorithm}_bytes_per_s"] = len(blob) * max(1, n // 20) / (time.time() - t)

    def one(i):
        with open(d / f"{i}.bin", "wb") as f:
            f.write(blob)
    t = time.time()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, range(n)))
    buffered = n * len(blob) / (time.time() - t)
    t2 = time.time()
    os.sync()
    synced = n * len(blob) / (time.time() - t)
    res = {"disk_files": n, "disk_file_bytes": len(blob), "disk_write_bytes_per_s": buffered,
           "disk_durable_bytes_per_s": synced, "disk_sync_seconds": time.time() - t2, **hashes}
    res["disk_writeback_bytes_per_s"] = limit_bytes_per_s(res)
    shutil.rmtree(d, ignore_errors=True)
    return res


def limit_bytes_per_s(disk: dict) -> float:
    """The disk's durable bandwidth as a limit for capture: the larger of write-then-sync and the sync phase alone
    (the bytes over the seconds ``os.sync()`` took: the device writing back with nothing else to do). Write-then-sync
    counts the buffered phase, in which the disk may idle (the dirty pages below the kernel's background threshold);
    capture writes over seconds while writeback runs, and beat it: durable graph capture ran at 1.17-1.25x of
    write-then-sync on the H100 (gpu-benchmark-graph-fp8, 2026-12-05), i.e. that figure was no limit. From a record's
    ``disk_*`` keys, so older records can be re-read."""
    total = disk["disk_files"] * disk["disk_file_bytes"]
    return max(disk["disk_durable_bytes_per_s"], total / max(disk["disk_sync_seconds"], 1e-9))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/tmp/e3k-disk")
    p.add_argument("--gb", type=float, default=16)
    p.add_argument("--file-mb", type=float, default=6.3)  # a 1,366-token SmolLM2 sample in bf16
    p.add_argument("--threads", type=int, default=4)
    a = p.parse_args(argv)
    r = measure(a.dir, a.gb, a.file_mb, a.threads)
    print(f"files {r['disk_files']} x {r['disk_file_bytes'] / 2**20:.1f} MiB = "
          f"{r['disk_files'] * r['disk_file_bytes'] / 2**30:.1f} GiB in {a.dir}")
    print(f"write (returned)      {r['disk_write_bytes_per_s'] / 2**20:10,.0f} MiB/s")
    print(f"write + sync          {r['disk_durable_bytes_per_s'] / 2**20:10,.0f} MiB/s   "
          f"(sync took {r['disk_sync_seconds']:.1f} s)")
    print(f"writeback (sync only) {r['disk_writeback_bytes_per_s'] / 2**20:10,.0f} MiB/s   (the limit capture is held to)")
    for algorithm in checksum.ALGORITHMS:
        print(f"{algorithm + ' one thread':22s}{r[f'{algorithm}_bytes_per_s'] / 2**20:10,.0f} MiB/s")
    for cmd in (["df", "-h", a.dir, "/dev/shm"], ["free", "-g"], ["sysctl", "vm.dirty_ratio", "vm.dirty_background_ratio"]):
        print(subprocess.run(cmd, capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
