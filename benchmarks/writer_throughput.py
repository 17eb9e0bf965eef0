"""The capture writer alone: forwards of captured rows pushed through the scheduler-side interface (the hook's
add and fp8 encoding on ``--device``, host ring, submit) as fast as the writer takes them. Prints MB/s written,
samples/s and the latency from submit to marker (what a client waiting on markers sees). No server: the writer's
own ceiling on this machine.

usage: python benchmarks/writer_throughput.py [--forwards 60] [--rows 8192] [--per-request 1366] [--storage bf16]
       python benchmarks/writer_throughput.py --kimi [--storage fp8]   # Kimi-K2.5's geometry (#13)

``--kimi``: hidden 7168, 61 layers (aux 2, 30, 58 + the final slot: 4 slots), requests of 1,611 tokens (the mean
that makes the users' 924 GB for 10 K samples at 4 bf16 slots of 7168). Only rank 0 of a TP group writes, so the
writer's tokens/s is the prefill tokens/s of a whole 8-GPU server it keeps up with. ``durable`` figures include
``os.sync()`` after the last marker (the bytes on disk, not in the page cache). Metrics: ``writer_gb_per_s``,
``writer_durable_gb_per_s``, ``writer_tokens_per_s``, ``writer_bytes_per_token`` (each ``_<storage>`` in a metrics.json
written with ``--out``) and, at hidden 7168,
``writer_gb_per_s_h7168_<storage>`` and ``kimi_10k_samples_gb_<storage>`` (10 K samples of 1,611 tokens re-estimated
with the bytes per token measured here).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

KIMI_TOKENS_PER_SAMPLE = 1611  # 924 GB / 10 K samples / (4 slots x 7168 x 2 bytes)
PER_STORAGE = {"samples", "bytes", "seconds", "durable_seconds", "submit_seconds", "writer_start_seconds", "mb_per_s",
               "samples_per_s",
               "writer_gb_per_s", "writer_durable_gb_per_s", "writer_tokens_per_s", "writer_durable_tokens_per_s",
               "bytes_per_token", "marker_latency_median_s", "marker_latency_max_s", "backpressure_seconds",
               "backpressure_waits", "share_io_busy", "share_io_hash", "share_io_write", "share_io_writeback",
               "share_io_encode", "share_io_marker", "share_reassembly", "share_d2h_wait", "share_backpressure"}  # merged per storage


def merged_names(res: dict, storage: str) -> dict:
    """The figures as merged into a metrics.json that other benchmarks share (bench writes the capture's own
    ``bytes_per_token_<storage>`` there): every name the writer's (``writer_``/``kimi_``), per storage where it differs."""
    out = {}
    for k, v in res.items():
        name = k if k.startswith(("writer_", "kimi_")) else f"writer_{k}"
        out[f"{name}_{storage}" if k in PER_STORAGE else name] = v
    return out


def main(argv=None):
    from eagle3kit.capture.hook import CaptureSession, capture_config
    from eagle3kit.capture.rid import make_rid
    from eagle3kit.capture.writer import stage_shares
    from eagle3kit.checksum import ALGORITHMS, DEFAULT as DEFAULT_CHECKSUM

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--forwards", type=int, default=60)
    p.add_argument("--rows", type=int, default=8192, help="tokens per forward (SGLang's chunked prefill size)")
    p.add_argument("--per-request", type=int, default=1366, help="tokens per request")
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--storage", default="bf16")
    p.add_argument("--dir", default="/tmp/eagle3kit-writer-bench")
    p.add_argument("--out", default=None, help="folder for metrics.json (merged into one that is there)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the synthetic forwards' states live (the hook adds and, for fp8, encodes them there)")
    p.add_argument("--io-threads", type=int, default=4, help="the writer process's file threads (capture_config)")
    p.add_argument("--checksum", default=DEFAULT_CHECKSUM, choices=ALGORITHMS,
                   help="what the markers name each file by (capture_config, eagle3kit.checksum)")
    p.add_argument("--ring-mb", type=int, default=2048,
                   help="the host ring's size (capture_config's max_inflight_mb): what a pass can run ahead of the disk")
    p.add_argument("--kimi", action="store_true", help="Kimi-K2.5's geometry: --hidden 7168 --layers 61 "
                   "--per-request 1611")
    a = p.parse_args(argv)
    if a.kimi:
        a.hidden, a.layers, a.per_request = 7168, 61, KIMI_TOKENS_PER_SAMPLE
    d = Path(a.dir)
    shutil.rmtree(d, ignore_errors=True)

    class Mode:
        EXTEND, DECODE = 1, 2

    cfg = capture_config(d, [2, a.layers // 2, a.layers - 3], a.layers, storage=a.storage, io_threads=a.io_threads,
                         checksum=a.checksum, max_inflight_mb=a.ring_mb)
    t_start = time.time()
    session = CaptureSession(cfg, extend_mode=Mode.EXTEND)
    session.writer.ring.buf.fill_(0)  # populate the ring's pages, as registering it with CUDA does on the GPU
    # the writer process answers once it has started (it imports torch: 1.8 s on the CPU machine). In a server it
    # starts with the server, long before any capture; until 2026-12-06 this benchmark's clock ran through it
    session.writer.flush(timeout=120)
    started = time.time() - t_start
    per = a.per_request
    states = torch.randn(a.rows, a.hidden, device=a.device).bfloat16()
    residual = torch.zeros_like(states)
    ids = torch.arange(a.rows, device=a.device)
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
    counts = session.writer.flush(timeout=600).get("counts", {})
    total = time.time() - t0
    os.sync()  # the bytes on disk: what a sample counted as done must mean
    durable = time.time() - t0
    lat = []
    nbytes = 0
    for k, t in sent.items():
        m = json.loads((d / f"{k}.rank0.json").read_text())
        lat.append(m["time"] - t)
        nbytes += m["bytes"]
    tokens = len(sent) * per
    res = {"samples": len(sent), "bytes": nbytes, "seconds": total, "durable_seconds": durable,
           "submit_seconds": submitted, "writer_start_seconds": started, "mb_per_s": nbytes / total / 2**20, "samples_per_s": len(sent) / total,
           "writer_gb_per_s": nbytes / total / 1e9, "writer_durable_gb_per_s": nbytes / durable / 1e9,
           "writer_tokens_per_s": tokens / total, "writer_durable_tokens_per_s": tokens / durable,
           "bytes_per_token": nbytes / tokens, "hidden": a.hidden, "slots": len(session.layer_slots),
           "marker_latency_median_s": statistics.median(lat), "marker_latency_max_s": max(lat),
           "storage": a.storage, "device": a.device, "io_threads": a.io_threads, "ring_mb": a.ring_mb,
           "checksum": a.checksum,
           # the time forwards waited on a full ring (the writer behind) out of the submit time: near 0 means the
           # producer side (the hook's copies) set the pace, near submit_seconds that the writer process did
           "backpressure_seconds": session.writer.counts["backpressure_us"] / 1e6,
           "backpressure_waits": session.writer.counts["backpressure_waits"],
           # where the writer's time went (capture.writer.stage_shares): the file threads' busy share, each stage's
           # part of it, the reassembly loop's and the copies' wait
           **{f"share_{k}": v for k, v in stage_shares({}, counts, total, a.io_threads).items()}}
    if a.hidden == 7168:
        if a.storage == "bf16":  # the default storage: the figure #13 asks for under its plain name
            res["writer_gb_per_s_h7168"] = res["writer_durable_gb_per_s"]
        res[f"writer_gb_per_s_h7168_{a.storage}"] = res["writer_gb_per_s"]
        res[f"writer_durable_gb_per_s_h7168_{a.storage}"] = res["writer_durable_gb_per_s"]
        res[f"kimi_keepup_prefill_tokens_per_s_{a.storage}"] = res["writer_durable_tokens_per_s"]
        res[f"kimi_10k_samples_gb_{a.storage}"] = res["bytes_per_token"] * KIMI_TOKENS_PER_SAMPLE * 10_000 / 1e9
    for k, v in res.items():
        print(f"{k:26s} {v:,.3f}" if isinstance(v, float) else f"{k:26s} {v}")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        from eagle3kit.metrics import update_json

        update_json(Path(a.out) / "metrics.json", merged_names(res, a.storage))
    session.writer.close()
    shutil.rmtree(d, ignore_errors=True)
    return res


if __name__ == "__main__":
    main()
