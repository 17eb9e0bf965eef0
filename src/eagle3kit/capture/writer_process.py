"""The capture writer in its own process, so that splitting, hashing and writing files never take the GIL from
SGLang's scheduler.

Scheduler side (``WriterProcess``, the session's writer inside SGLang): the hook copies each captured tensor into a
region of a shared-memory ring (``ring.py``); ``submit`` hands the job to a dispatcher thread, which waits for the
job's CUDA event and sends the region offsets, shapes and the request spans through a pipe (a few hundred bytes per
forward). An acknowledgement thread releases the regions once the writer process says the job's files are written.
Writer side (``main``, ``python -m eagle3kit.capture.writer_process``): maps the same ring and runs the
``CaptureWriter`` on views of it. Scheduler-side counts (forwards, ignored rows, hook errors) travel with the jobs
and every half second, so ``_status.rank<r>.json`` shows both sides.

If the writer process dies, allocations stop blocking and raise (counted as hook errors; the server keeps serving),
and the status file says so. If the server dies, the pipe closes and the writer finishes what it holds, then exits.
"""
from __future__ import annotations

import json
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import torch

from eagle3kit.capture.format import atomic_write, status_path
from eagle3kit.capture.ring import HostRing
from eagle3kit.capture.writer import CaptureWriter, Job
from eagle3kit.checksum import DEFAULT as DEFAULT_CHECKSUM

_LEN = struct.Struct("<I")


def _send(f, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(_LEN.pack(len(data)) + data)
    f.flush()


def _recv(f):
    head = f.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    data = f.read(_LEN.unpack(head)[0])
    return pickle.loads(data)


def allow_profiler() -> None:
    """With ``EAGLE3KIT_ALLOW_PTRACE=1``, let any process of this user attach a sampling profiler (py-spy) to
    this one, as Yama's ``ptrace_scope=1`` otherwise allows only ancestors; the benchmarks set it."""
    if os.environ.get("EAGLE3KIT_ALLOW_PTRACE") == "1" and sys.platform == "linux":
        import ctypes

        PR_SET_PTRACER, PR_SET_PTRACER_ANY = 0x59616D61, ctypes.c_ulong(-1)
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class WriterProcess:
    """The scheduler side: same interface as ``CaptureWriter`` for the capture session."""

    def __init__(self, out_dir, rank: int, metadata: dict, storage: str = "bf16", io_threads: int = 4,
                 max_inflight_bytes: int = 2 << 30, max_pending: int = 4096, dp_rank: int | None = None,
                 checksum: str = DEFAULT_CHECKSUM):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.status_file = status_path(self.out_dir, rank, dp_rank)
        self.counts: Counter = Counter()
        self.ignored: Counter = Counter()
        self.last_error = ""
        self.ring = HostRing(max_inflight_bytes)
        job_r, job_w = os.pipe()
        ack_r, ack_w = os.pipe()
        spec = {"job_fd": job_r, "ack_fd": ack_w, "ring_fd": self.ring.fd, "ring_size": self.ring.size,
                "out_dir": str(self.out_dir), "rank": rank, "metadata": metadata, "storage": storage,
                "io_threads": io_threads, "max_pending": max_pending, "dp_rank": dp_rank, "checksum": checksum}
        env = dict(os.environ)
        src = str(Path(__file__).resolve().parents[2])  # eagle3kit importable in the child, installed or not
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
        env["OMP_NUM_THREADS"] = "1"  # its torch work is per file, in parallel IO threads: no spinning thread pools
        self.proc = subprocess.Popen([sys.executable, "-m", "eagle3kit.capture.writer_process", json.dumps(spec)],
                                     pass_fds=(job_r, ack_w, self.ring.fd), stdin=subprocess.DEVNULL, env=env)
        os.close(job_r)
        os.close(ack_w)
        self._jobs = os.fdopen(job_w, "wb")
        self._acks = os.fdopen(ack_r, "rb")
        self._q: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._held: dict[int, list[int]] = {}  # job id -> ring offsets
        self._next = 0
        self._flushed: dict[int, threading.Event] = {}
        self._closed = False
        self._dead = False
        self._pin_tried = False
        self._sent_counts = None
        threading.Thread(target=self._dispatch, name="e3k-dispatch", daemon=True).start()
        threading.Thread(target=self._acknowledge, name="e3k-acks", daemon=True).start()

    # -- the session's writer interface (scheduler thread) ------------------------------------------------------
    def alive(self) -> bool:
        return self.proc.poll() is None

    def host_empty(self, shape, dtype, cuda: bool) -> torch.Tensor:
        if self._dead:
            raise RuntimeError(self.last_error)
        if cuda and not self._pin_tried:  # once: a failed registration is not retried on every copy
            self._pin_tried = True
            if not self.ring.pin():
                self.note("ring_not_pinned")  # still correct: the copies are synchronous
        return self.ring.empty(shape, dtype, alive=self.alive,
                               on_wait=self._waited)

    def _waited(self, seconds: float) -> None:
        self.counts["backpressure_waits"] += 1
        self.counts["backpressure_us"] += int(seconds * 1e6)

    def discard(self, tensors) -> None:
        self.ring.release([self.ring.offset_of(t) for t in tensors])

    def note(self, what: str, n: int = 1) -> None:
        self.counts[what] += n

    def error(self, where: str, exc: BaseException) -> None:
        import traceback

        self.note("errors")
        self.last_error = f"{where}: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"

    def submit(self, job: Job) -> None:
        desc = {name: self._describe(x) for name, x in job.tensors.items()}
        offsets = sorted({d[0] for d in desc.values()})
        with self._lock:
            self._next += 1
            jid = self._next
            self._held[jid] = offsets
        self._q.put(("job", jid, job.event, {"selection": job.selection, "tensors": desc}))

    def _describe(self, x: torch.Tensor):
        return self.ring.offset_of(x), _dtype_name(x.dtype), list(x.shape)

    def flush(self, timeout: float = 60.0) -> dict:
        """Wait until every submitted job is written; returns the status the writer process wrote."""
        with self._lock:
            self._next += 1
            fid = self._next
            ev = self._flushed[fid] = threading.Event()
        self._q.put(("flush", fid, None, {}))
        if not ev.wait(timeout) and self.alive():
            self.last_error = f"flush: the writer process did not answer within {timeout:.0f} s"
        return self.status()

    def status(self) -> dict:
        try:
            return json.loads(self.status_file.read_text())
        except (OSError, ValueError):
            return {"rank": self.rank, "counts": dict(self.counts), "ignored_rows_by_kind": dict(self.ignored),
                    "last_error": self.last_error}

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._q.put(None)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.ring.close()

    # -- threads ------------------------------------------------------------------------------------------------
    def _parent_status(self) -> dict:
        while True:
            try:  # the scheduler thread may add a key meanwhile
                return {"counts": dict(self.counts), "ignored": dict(self.ignored), "last_error": self.last_error,
                        "ring_used_bytes": self.ring.used}
            except RuntimeError:
                continue

    def _dispatch(self):
        while True:
            try:
                item = self._q.get(timeout=0.5)
            except queue.Empty:
                item = ("counts", 0, None, {})
            if item is None:
                break
            kind, jid, event, body = item
            parent = self._parent_status()
            if kind == "counts" and parent == self._sent_counts:
                continue
            self._sent_counts = parent
            try:
                if event is not None:
                    t = time.perf_counter_ns()
                    event.synchronize()  # the copies into the ring are complete
                    self.counts["d2h_wait_us"] += (time.perf_counter_ns() - t) // 1000
            except Exception as e:  # noqa: BLE001 - a failed copy loses this forward, not the server
                self.error("device-to-host copy", e)
                with self._lock:
                    self.ring.release(self._held.pop(jid, []))
                continue
            try:
                _send(self._jobs, {"kind": kind, "id": jid, "parent": parent, **body})
            except (OSError, ValueError) as e:  # the writer process is gone
                self._gone(f"sending to the writer process: {e}")
                break
        try:
            self._jobs.close()
        except OSError:
            pass

    def _acknowledge(self):
        while True:
            try:
                msg = _recv(self._acks)
            except (OSError, EOFError, pickle.UnpicklingError):
                msg = None
            if msg is None:
                if not self._closed:
                    self._gone("the writer process closed its pipe")
                return
            with self._lock:
                if msg["kind"] == "release":
                    offsets = self._held.pop(msg["id"], [])
                elif msg["kind"] == "flushed":
                    ev = self._flushed.pop(msg["id"], None)
                    if ev is not None:
                        ev.set()
                    continue
            self.ring.release(offsets)

    def _gone(self, why: str):
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        self._dead = True
        self.note("writer_process_exits")
        self.last_error = f"{why} (exit code {code}); captures stop, the server keeps serving"
        self.ring.wake()
        with self._lock:
            for ev in self._flushed.values():
                ev.set()
        try:
            atomic_write(self.status_file,
                         json.dumps({**self._parent_status(), "rank": self.rank, "time": time.time(),
                                     "ignored_rows_by_kind": dict(self.ignored)}).encode())
        except OSError:
            pass


def main(argv=None) -> int:
    """The writer process: jobs in, files out, acknowledgements back."""
    spec = json.loads((argv or sys.argv[1:])[0])
    torch.set_num_threads(1)
    allow_profiler()
    ring = HostRing(spec["ring_size"], fd=spec["ring_fd"])
    acks = os.fdopen(spec["ack_fd"], "wb")
    lock = threading.Lock()

    def ack(obj):
        with lock:
            try:
                _send(acks, obj)
            except (OSError, ValueError):
                pass  # the server is gone: the files still get written

    writer = CaptureWriter(spec["out_dir"], spec["rank"], spec["metadata"], storage=spec["storage"],
                           io_threads=spec["io_threads"], max_pending=spec["max_pending"], dp_rank=spec.get("dp_rank"),
                           checksum=spec.get("checksum", DEFAULT_CHECKSUM),
                           on_release=lambda job: ack({"kind": "release", "id": job.tag}))
    jobs = os.fdopen(spec["job_fd"], "rb")
    while True:
        msg = _recv(jobs)
        if msg is None:
            break
        writer.external = msg["parent"]
        if msg["kind"] == "job":
            tensors = {name: ring.view(off, shape, getattr(torch, dt)) for name, (off, dt, shape) in
                       msg["tensors"].items()}
            writer.submit(Job(msg["selection"], tensors, tag=msg["id"]))
        elif msg["kind"] == "flush":
            writer.flush()
            ack({"kind": "flushed", "id": msg["id"]})
        else:
            writer._status()
    writer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
