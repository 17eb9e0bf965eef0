"""Disk full mid-extraction (#12), on a small filesystem of the test's own (tmpfs): the run stops cleanly, says what
was kept and what failed, leaves no temporary file, and resumes to a complete, verified data set once space is
freed. The real extraction (CLI, reference engine) runs; a filler file takes the free space once two samples exist."""
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from eagle3kit.store import read_manifest, verify


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}): needs root or CAP_SYS_ADMIN")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_full_disk_stops_the_run_cleanly_and_a_rerun_resumes(small_fs, target_path):
    out = small_fs / "data"
    filler = small_fs / "filler"
    cmd = [sys.executable, "-m", "eagle3kit.cli", "extract", "--target", str(target_path), "--out", str(out),
           "--max-samples", "24", "--max-tokens", "160"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def fill_after_two_samples():
        deadline = time.time() + 600
        while time.time() < deadline and len(list((out / "samples").glob("*.safetensors"))) < 2:
            time.sleep(0.02)
        with open(filler, "wb") as f:  # every byte left, as another process filling the disk would
            try:
                while True:
                    f.write(b"\0" * 65536)
            except OSError:
                pass

    t = threading.Thread(target=fill_after_two_samples, daemon=True)
    t.start()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    t.join(5)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert "the disk is full" in r.stderr and "rerun the same command" in r.stderr and "Traceback" not in r.stderr
    assert not list(small_fs.rglob("*.tmp")), list(small_fs.rglob("*.tmp"))  # no half-written file
    kept = read_manifest(out)  # the last group's lines may not have fit: those samples are captured again
    assert len(kept) < 24 and not verify(out).problems  # what the manifest holds is complete
    print(r.stderr[-1500:])
    assert "wrote" in r.stderr and ("failures.json" in r.stderr or "not listed on disk" in r.stderr)

    filler.unlink()  # space freed: the same command resumes
    r2 = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert r2.returncode == 0, r2.stderr[-2000:]
    summary = json.loads(r2.stdout)
    assert summary["already_done"] >= len(kept) and summary["failed"] == 0
    lines = [json.loads(x)["key"] for x in (out / "manifest.jsonl").read_text().splitlines() if x.strip()]
    assert len(lines) == len(set(lines)) == summary["samples"]  # nothing lost, nothing twice
    assert verify(out).passed and not (out / "failures.json").exists()
    assert shutil.disk_usage(small_fs).free > 0
