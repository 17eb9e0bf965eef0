"""The live stream alone: captured rows pushed through the capture hook's interface (add, host ring, writer process)
into a folder on a RAM filesystem, and taken by consumer processes as a training rank's loader workers take them
(``live.source.check_capture``: the file read once, its checksum against the marker, token ids against the request,
shape, finite values; then the file goes). No server, no training: the stream's own ceiling, hook to trainer.

usage: python benchmarks/live_stream.py [--forwards 40] [--rows 8192] [--per-request 1366] [--consumers 2]
       python benchmarks/live_stream.py --kimi [--storage fp8]   # Kimi-K2.5's geometry: hidden 7168, 4 slots

Prints every round and their median and spread: GB/s and tokens/s from the first forward to the last sample taken by a
consumer, the marker-to-taken latency, and the peak bytes held in the stream folder. ``--out``: merged into that
folder's metrics.json as ``live_stream_gb_per_s[_h7168]_<storage>`` (median) and the rounds.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import time
from pathlib import Path

import torch

KIMI_TOKENS_PER_SAMPLE = 1611


def consume(stream_dir: str, keys: list, per: int, n_states: int, hidden: int, q) -> None:
    """One loader worker: each of ``keys`` as it arrives, checked, then removed. Puts (bytes, seconds of the last
    take, max latency after its marker) on ``q``."""
    from eagle3kit.live.source import check_capture

    d = Path(stream_dir)
    samples = d / "samples"
    nbytes, worst = 0, 0.0
    q.put("ready")
    for key in keys:
        f, r = (int(x) for x in key[1:].split("r"))
        want = list(range(r * per, (r + 1) * per))
        marker_path = samples / f"{key}.rank0.json"
        while True:
            try:
                m = json.loads(marker_path.read_text())
                break
            except (OSError, ValueError):
                time.sleep(0.0005)
        check_capture(d, m, want, n_states, hidden)
        worst = max(worst, time.time() - m["time"])
        nbytes += m["bytes"]
        (samples / m["file"]).unlink()
        marker_path.unlink()
    q.put((nbytes, time.time(), worst))


def one_round(a, d: Path) -> dict:
    from eagle3kit.capture.hook import CaptureSession, capture_config
    from eagle3kit.capture.rid import make_rid

    class Mode:
        EXTEND, DECODE = 1, 2

    shutil.rmtree(d, ignore_errors=True)
    (d / "samples").mkdir(parents=True)
    aux = [2, a.layers // 2, a.layers - 3]
    cfg = capture_config(d / "samples", aux, a.layers, storage=a.storage, io_threads=a.io_threads,
                         max_inflight_mb=a.ring_mb)
    session = CaptureSession(cfg, extend_mode=Mode.EXTEND)
    session.writer.ring.buf.fill_(0)
    session.writer.flush(timeout=120)  # the writer process answers: started, as in a server long before captures
    per = a.per_request
    n_req = a.rows // per
    keys = [f"f{f}r{i}" for f in range(a.forwards) for i in range(n_req)]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=consume, args=(str(d), keys[w::a.consumers], per, len(aux) + 1, a.hidden, q))
             for w in range(a.consumers)]
    for p in procs:
        p.start()
    for _ in procs:  # the consumers have imported torch before the clock starts (a trainer's workers are up)
        assert q.get(timeout=300) == "ready"
    states = torch.randn(a.rows, a.hidden, device=a.device).bfloat16()
    residual = torch.zeros_like(states)
    ids = torch.arange(a.rows, device=a.device)
    peak = 0
    t0 = time.time()
    for f in range(a.forwards):
        rids = [make_rid(f"f{f}r{i}", per) for i in range(n_req)]
        fb = type("FB", (), {"forward_mode": Mode.EXTEND, "rids": rids, "extend_seq_lens_cpu": [per] * n_req,
                             "extend_prefix_lens_cpu": [0] * n_req, "input_ids": ids[:per * n_req]})()
        rows = per * n_req
        for j in sorted(session.layer_slots):
            session.on_layer(j, (None, states[:rows], fb, residual[:rows]), (states[:rows], residual[:rows]))
        session.on_end((ids[:rows], states[:rows], None, fb))
        peak = max(peak, sum(e.stat().st_size for e in os.scandir(d / "samples") if e.name.endswith(".safetensors")))
    got = [q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    seconds = max(t for _, t, _ in got) - t0
    nbytes = sum(b for b, _, _ in got)
    tokens = len(keys) * per
    session.writer.close()
    shutil.rmtree(d, ignore_errors=True)
    return {"gb_per_s": nbytes / seconds / 1e9, "tokens_per_s": tokens / seconds, "bytes": nbytes,
            "samples": len(keys), "seconds": seconds, "taken_latency_max_s": max(w for _, _, w in got),
            "peak_stream_mb": peak / 2 ** 20}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--forwards", type=int, default=40)
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--per-request", type=int, default=1366)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--storage", default="bf16", choices=["bf16", "fp8"])
    p.add_argument("--consumers", type=int, default=2, help="loader worker processes of the training rank")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--io-threads", type=int, default=4)
    p.add_argument("--ring-mb", type=int, default=2048)
    p.add_argument("--dir", default="/dev/shm/eagle3kit-live-stream-bench")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None)
    p.add_argument("--kimi", action="store_true", help="--hidden 7168 --layers 61 --per-request 1611")
    a = p.parse_args(argv)
    if a.kimi:
        a.hidden, a.layers, a.per_request = 7168, 61, KIMI_TOKENS_PER_SAMPLE
    rounds = [one_round(a, Path(a.dir)) for _ in range(a.rounds)]
    gb = [r["gb_per_s"] for r in rounds]
    for i, r in enumerate(rounds):
        print(f"round {i}: {r['gb_per_s']:.3f} GB/s, {r['tokens_per_s']:,.0f} tokens/s, {r['samples']} samples, "
              f"peak {r['peak_stream_mb']:.0f} MB in the stream, latency max {r['taken_latency_max_s']:.3f} s")
    med = statistics.median(gb)
    print(f"median {med:.3f} GB/s (spread {min(gb):.3f}-{max(gb):.3f}), hidden {a.hidden}, {a.storage}, "
          f"{a.consumers} consumers, device {a.device}")
    suffix = f"_h{a.hidden}_{a.storage}" if a.hidden == 7168 else f"_{a.storage}"
    res = {f"live_stream_gb_per_s{suffix}": med,
           f"live_stream_tokens_per_s{suffix}": statistics.median(r["tokens_per_s"] for r in rounds),
           f"live_stream_gb_per_s{suffix}_rounds": " ".join(f"{x:.3f}" for x in gb),
           f"live_stream_peak_mb{suffix}": max(r["peak_stream_mb"] for r in rounds),
           f"live_stream_bytes_per_token{suffix}": rounds[0]["bytes"] / (rounds[0]["samples"] * a.per_request)}
    if a.out:
        from eagle3kit.metrics import update_json

        Path(a.out).mkdir(parents=True, exist_ok=True)
        update_json(Path(a.out) / "metrics.json", res)
    return res


if __name__ == "__main__":
    main()
