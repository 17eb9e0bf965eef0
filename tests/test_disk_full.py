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
from tests.conftest import fill_disk, tmpfs


@pytest.fixture
def small_fs(tmp_path):
    with tmpfs(tmp_path / "fs", "24m") as mnt:
        yield mnt


@pytest.mark.slow
def test_a_full_disk_stops_the_run_cleanly_and_a_rerun_resumes(small_fs, target_path, capsys):
    # 8 conversations: the disk fills after 2 samples, so the stop and the resume each have samples of their own (the
    # resume captures every sample the stop did not keep; more conversations only add capture time)
    n = 8
    out = small_fs / "data"
    filler = small_fs / "filler"
    cmd = [sys.executable, "-m", "eagle3kit.cli", "extract", "--target", str(target_path), "--out", str(out),
           "--max-samples", str(n), "--max-tokens", "160"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def fill_after_two_samples():
        deadline = time.time() + 600
        while time.time() < deadline and len(list((out / "samples").glob("*.safetensors"))) < 2:
            time.sleep(0.02)
        fill_disk(filler)

    t = threading.Thread(target=fill_after_two_samples, daemon=True)
    t.start()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    t.join(5)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert "the disk is full" in r.stderr and "rerun the same command" in r.stderr and "Traceback" not in r.stderr
    assert not list(small_fs.rglob("*.tmp")), list(small_fs.rglob("*.tmp"))  # no half-written file
    kept = read_manifest(out)  # the last group's lines may not have fit: those samples are captured again
    assert len(kept) < n and not verify(out).problems  # what the manifest holds is complete
    print(r.stderr[-1500:])
    assert "wrote" in r.stderr and ("failures.json" in r.stderr or "not listed on disk" in r.stderr)

    filler.unlink()  # space freed: the same command resumes (run here: the stop above is the process's own)
    from eagle3kit.cli import main

    capsys.readouterr()
    rc = main(cmd[3:])
    out2, err2 = capsys.readouterr()
    assert rc == 0, err2[-2000:]
    summary = json.loads(out2)
    assert summary["already_done"] >= len(kept) and summary["failed"] == 0
    lines = [json.loads(x)["key"] for x in (out / "manifest.jsonl").read_text().splitlines() if x.strip()]
    assert len(lines) == len(set(lines)) == summary["samples"]  # nothing lost, nothing twice
    assert verify(out).passed and not (out / "failures.json").exists()
    assert shutil.disk_usage(small_fs).free > 0


def test_a_full_disk_under_the_servers_writer_fails_captures_at_once_with_enospc(small_fs):
    """The writer SGLang's scheduler hands its copies to (``WriterProcess``, its own process, real files) on a full
    disk: each sample's write fails, no half-written file stays, and the capture client fails the requests at once
    with errno ENOSPC, which is what makes the extraction stop with its disk-full report (it waited 600 s per
    request before). Two depths: a few hundred KB left (the sample does not fit, the writer's error marker does),
    then nothing left (not even the writer's status can be written: the client sees the free space)."""
    import torch

    from eagle3kit.capture.assemble import select_rows
    from eagle3kit.capture.client import CaptureClient
    from eagle3kit.capture.rid import parse_rid
    from eagle3kit.capture.writer import Job
    from eagle3kit.capture.writer_process import WriterProcess
    from eagle3kit.extract import _disk_full
    from test_client import endpoint

    out = small_fs / "samples"
    out.mkdir()
    # one file thread: with two, a sample's partial temporary file can hold the last free bytes while the other
    # thread writes its error marker, which then fails too (the client reports that case itself after FULL_AFTER,
    # the "nothing fits" depth below): the "markers fit" depth would depend on the threads' order
    writer = WriterProcess(out, 0, {"layer_ids": [1, 2]}, io_threads=1)
    filler = small_fs / "filler"

    def respond(port, method, path, body):  # SGLang's /generate, with the capture hook's hand-off to the writer
        key, n = parse_rid(body["rid"])
        hs = torch.randn(n, 2, 4096).bfloat16()  # 16 KB a token: a sample of 64 tokens is 1 MB
        host = writer.host_empty(hs.shape, hs.dtype, cuda=False).copy_(hs)
        tok = writer.host_empty((n,), torch.int64, cuda=False).copy_(torch.arange(n))
        writer.submit(Job(select_rows([body["rid"]], [n], [0]), {"hidden_states": host, "token_ids": tok}))
        return 200, {"meta_info": {"cached_tokens": 0}}

    server = endpoint(respond)
    runs = {}
    try:
        client = CaptureClient(f"http://127.0.0.1:{server.server_port}", out, timeout=120)
        (ok,) = client.capture_many([("before", list(range(64)))], concurrency=1)  # space left: a sample
        assert ok["status"] == "ok", ok
        for depth, leave in (("markers fit", 256 << 10), ("nothing fits", 0)):
            fill_disk(filler, leave)
            t0 = time.time()
            done = client.capture_many([(f"{depth[0]}{i}", list(range(64 + i))) for i in range(4)], concurrency=2)
            runs[depth] = (time.time() - t0, done, writer.flush())
    finally:
        server.shutdown()
        writer.close()
    took, done, st = runs["markers fit"]
    assert took < 10, took  # the markers came at once
    assert all(m["status"] == "error" and _disk_full(m) and "the capture writer could not write" in m["reason"]
               for m in done), done
    assert st["counts"].get("write_failed", 0) == 4 and "No space left on device" in st["last_error"], st
    took, done, _ = runs["nothing fits"]
    assert took < 30, took  # FULL_AFTER, not the 120-s timeout
    assert all(m["status"] == "error" and _disk_full(m) and "bytes free" in m["reason"] for m in done), done
    assert not list(small_fs.rglob("*.tmp")), list(small_fs.rglob("*.tmp"))  # no half-written file
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["before.rank0.safetensors"]  # what was written stays
