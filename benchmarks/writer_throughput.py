"""The capture writer alone, on the CPU: forwards of captured rows pushed through the scheduler-side interface
(host ring, submit) as fast as the writer takes them. Prints MB/s written, samples/s and the latency from submit
to marker (what a client waiting on markers sees). No server, no GPU: the writer's own ceiling on this machine.

usage: python benchmarks/writer_throughput.py [--forwards 60] [--rows 8192] [--per-request 1366] [--storage bf16]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch


def main(argv=None):
    from eagle3kit.capture.hook import CaptureSession, capture_config
    from eagle3kit.capture.rid import make_rid

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--forwards", type=int, default=60)
    p.add_argument("--rows", type=int, default=8192, help="tokens per forward (SGLang's chunked prefill size)")
    p.add_argument("--per-request", type=int, default=1366, help="tokens per request")
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--storage", default="bf16")
    p.add_argument("--dir", default="/tmp/eagle3kit-writer-bench")
    p.add_argument("--out", default=None, help="folder for metrics.json")
    a = p.parse_args(argv)
    d = Path(a.dir)
    shutil.rmtree(d, ignore_errors=True)

    class Mode:
        EXTEND, DECODE = 1, 2

    cfg = capture_config(d, [2, a.layers // 2, a.layers - 3], a.layers, storage=a.storage)
    session = CaptureSession(cfg, extend_mode=Mode.EXTEND)
    session.writer.ring.buf.fill_(0)  # populate the ring's pages, as registering it with CUDA does on the GPU
    per = a.per_request
    states = torch.randn(a.rows, a.hidden).bfloat16()
    residual = torch.zeros_like(states)
    ids = torch.arange(a.rows)
    sent: dict[str, float] = {}
    t0 = time.time()
    for f in range(a.forwards):
        n_req = a.rows // per
        rids = [make_rid(f"f{f}r{i}", per) for i in range(n_req)]
        keys = [f"f{f}r{i}" for i in range(n_req)]
        fb = type("FB", (), {"forward_mode": Mode.EXTEND, "rids": rids, "extend_seq_lens_cpu": [per] * n_req,
                             "extend_prefix_lens_cpu": [0] * n_req, "input_ids": ids[:per * n_req]})()
        rows = per * n_req
        for j in sorted(session.layer_slots):
            session.on_layer(j, (None, states[:rows], fb, residual[:rows]), (states[:rows], residual[:rows]))
        now = time.time()
        sent.update({k: now for k in keys})
        session.on_end((ids[:rows], states[:rows], None, fb))
    submitted = time.time() - t0
    session.writer.flush(timeout=600)
    total = time.time() - t0
    lat = []
    nbytes = 0
    for k, t in sent.items():
        m = json.loads((d / f"{k}.rank0.json").read_text())
        lat.append(m["time"] - t)
        nbytes += m["bytes"]
    res = {"samples": len(sent), "bytes": nbytes, "seconds": total, "submit_seconds": submitted,
           "mb_per_s": nbytes / total / 2**20, "samples_per_s": len(sent) / total,
           "marker_latency_median_s": statistics.median(lat), "marker_latency_max_s": max(lat),
           "storage": a.storage}
    for k, v in res.items():
        print(f"{k:26s} {v:,.3f}" if isinstance(v, float) else f"{k:26s} {v}")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "metrics.json").write_text(json.dumps(res, indent=1))
    session.writer.close()
    shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
