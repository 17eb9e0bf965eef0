"""The capture's writer: waits for the asynchronous device-to-host copies, splits and reassembles requests, writes
files atomically, and keeps ``_status.rank<r>.json`` up to date. Nothing here raises into the caller: failures are
counted and written as markers. Inside SGLang it runs in its own process (``writer_process.py``), fed through a
shared-memory ring, so its work never competes with the scheduler for the GIL; in-process it serves tests and tools.

A job is released (``on_release``) once its last file is written: the writer process then gives its region of the
capture ring back, and the ring's size is the one bound on memory in flight (back-pressure on the server rather
than an unbounded queue or lost samples).
"""
from __future__ import annotations

import json
import queue
import threading
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from eagle3kit.capture.assemble import Piece, Reassembler, Selection
from eagle3kit.capture.format import atomic_write, status_path, write_marker, write_sample
from eagle3kit.checksum import DEFAULT as DEFAULT_CHECKSUM


STAGES = ("hash", "write", "writeback", "encode", "marker")  # a file thread's stages (format.write_sample's timing)


def stage_shares(before: dict, after: dict, seconds: float, io_threads: int) -> dict:
    """Where the writer's time went over ``seconds`` of wall time, from two snapshots of its status counts:
    ``io_busy``: the file threads' busy time over all of them (1.0: every thread busy throughout: they bind);
    ``io_<stage>``: each stage's part of that busy time; ``reassembly``: the writer loop's busy time (one thread);
    ``d2h_wait``: the scheduler-side dispatcher waiting on the device-to-host copies (one thread);
    ``backpressure``: forwards waiting on a full ring (the scheduler's thread: the writer held the server back)."""
    d = {k: (after.get(k, 0) - before.get(k, 0)) / 1e6 for k in
         ("io_busy_us", "reassembly_us", "d2h_wait_us", "backpressure_us", *(f"io_{s}_us" for s in STAGES))}
    busy = d["io_busy_us"]
    out = {"io_busy": busy / (seconds * io_threads) if seconds > 0 else float("nan")}
    out.update({f"io_{s}": d[f"io_{s}_us"] / busy if busy > 0 else float("nan") for s in STAGES})
    out.update({k[:-3]: d[k] / seconds if seconds > 0 else float("nan")
                for k in ("reassembly_us", "d2h_wait_us", "backpressure_us")})
    return out


@dataclass
class Job:
    """One forward's captured rows: tensors hold only the selected rows, in span order."""
    selection: Selection
    tensors: dict  # name -> CPU tensor [n_rows, ...]; "hidden_states" is [n_rows, n_slots, H]
    event: object | None = None  # CUDA event after the copies: the writer process's dispatcher waits on it
    tag: object = None  # the writer process's job id


class CaptureWriter:
    def __init__(self, out_dir, rank: int, metadata: dict, storage: str = "bf16", io_threads: int = 4,
                 max_pending: int = 4096, on_release=None, dp_rank: int | None = None,
                 checksum: str = DEFAULT_CHECKSUM):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.metadata, self.storage, self.checksum = rank, metadata, storage, checksum
        self.status_file = status_path(self.out_dir, rank, dp_rank)
        self.reassembler = Reassembler(max_pending)
        self.counts: Counter = Counter()
        self.ignored: Counter = Counter()
        self.last_error = ""
        self.external: dict = {}  # counts, ignored rows and last error reported by the scheduler side
        self.on_release = on_release  # called with each job once its files are written
        self._cv = threading.Condition()
        self._q: queue.Queue = queue.Queue()
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="e3k-io")
        self._io_pending = 0
        self._status_at = 0.0
        self._status_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="e3k-writer", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._q.put(job)

    def note(self, what: str, n: int = 1) -> None:
        with self._cv:
            self.counts[what] += n

    def error(self, where: str, exc: BaseException) -> None:
        self.note("errors")
        self.last_error = f"{where}: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
        self._status(force=True)

    # -- writer thread -------------------------------------------------------------------------------------
    def _loop(self):
        while True:
            job = self._q.get()
            if job is None:
                break
            writes = [1]  # this loop's own hold on the job's bytes, released below
            t = time.perf_counter_ns()
            try:
                self._handle(job, writes)
            except Exception as e:  # noqa: BLE001 - the server must keep serving
                self.error("writer", e)
            finally:
                self.note("reassembly_us", (time.perf_counter_ns() - t) // 1000)
                self._release(job, writes)
                self._q.task_done()
            self._status()

    def _release(self, job: Job, writes: list) -> None:
        """The job's memory is held until its last file is written (bounded memory, writes included)."""
        with self._cv:
            writes[0] -= 1
            done = writes[0] == 0
        if done and self.on_release is not None:
            self.on_release(job)

    def _handle(self, job: Job, writes: list):
        t = job.tensors
        row = 0
        for span in job.selection.spans:
            n = span.stop - span.start
            piece = {name: x[row:row + n] for name, x in t.items()}  # views: written straight from the job's memory
            if span.offset + n < span.expected:  # a first or middle chunk waits beyond this job: own copy
                piece = {name: x.clone() for name, x in piece.items()}
            row += n
            for outcome in self.reassembler.add(Piece(span, piece)):
                self._finish(outcome, job, writes)

    def _finish(self, outcome, job, writes):
        if outcome.status != "ok":
            self.note("incomplete")
            self._submit_io(write_marker, self.out_dir, outcome.key, self.rank,
                            {"status": "incomplete", "key": outcome.key, "rid": outcome.rid, "rank": self.rank,
                             "reason": outcome.reason, "chunks": outcome.chunks, "time": time.time()})
            return
        self.note("captured")
        self.note("chunked", int(outcome.chunks > 1))
        with self._cv:
            writes[0] += 1
        self._submit_io(self._write, outcome.key, outcome.rid, outcome.chunks, outcome.tensors,
                        on_done=lambda: self._release(job, writes))

    def _write(self, key, rid, chunks, tensors):
        timing: Counter = Counter()
        try:
            write_sample(self.out_dir, key, self.rank, tensors, self.metadata, self.storage,
                         extra_marker={"rid": rid, "chunks": chunks}, checksum=self.checksum, timing=timing)
        except OSError as e:  # a full disk, say: the client hears it from the marker now, not after its timeout
            self.note("write_failed")
            try:  # the sample's partial file is gone already (write_safetensors), so a small marker usually fits
                write_marker(self.out_dir, key, self.rank,
                             {"status": "error", "key": key, "rid": rid, "rank": self.rank, "errno": e.errno,
                              "reason": f"the capture writer could not write the sample: {type(e).__name__}: {e}",
                              "time": time.time()})
            except OSError:
                pass  # nothing fits: the client reads the writer's status and the free space instead
            raise  # counted as an error, and last_error in the status names it
        with self._cv:
            self.counts.update(timing)
            self.counts["written"] += 1

    def _submit_io(self, fn, *args, on_done=None):
        def run():
            t = time.perf_counter_ns()
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001
                self.error("io", e)
            finally:
                self.note("io_busy_us", (time.perf_counter_ns() - t) // 1000)
                if on_done is not None:
                    on_done()
                with self._cv:
                    self._io_pending -= 1
                    idle = self._io_pending == 0 and self._q.unfinished_tasks == 0
                    self._cv.notify_all()
                self._status(force=idle)  # the last write of a burst always lands in the status file
        with self._cv:
            self._io_pending += 1
        self._io.submit(run)

    # -- status --------------------------------------------------------------------------------------------
    def status(self) -> dict:
        ext = self.external
        return {"rank": self.rank, "counts": dict(self.counts + Counter(ext.get("counts", {}))),
                "ignored_rows_by_kind": dict(self.ignored + Counter(ext.get("ignored", {}))),
                "pending_partial": len(self.reassembler.pending), "ring_used_bytes": ext.get("ring_used_bytes", 0),
                "queue": self._q.qsize(), "last_error": self.last_error or ext.get("last_error", ""),
                "time": time.time()}

    def _status(self, force: bool = False):
        # made and written under one lock: an I/O thread's status made before a newer one (a flush's, carrying the
        # scheduler's last error) cannot land after it and hide it
        with self._status_lock:
            now = time.time()
            if force or now - self._status_at > 0.5:
                self._status_at = now
                try:
                    atomic_write(self.status_file, json.dumps(self.status()).encode())
                except OSError:
                    pass

    def flush(self, timeout: float = 60.0) -> dict:
        """Wait until every submitted job is written (tests, shutdown); returns the status."""
        self._q.join()
        with self._cv:
            self._cv.wait_for(lambda: self._io_pending == 0, timeout=timeout)
        self._status(force=True)
        return self.status()

    def close(self):
        self.flush()
        self._q.put(None)
        self._thread.join(timeout=10)
        self._io.shutdown(wait=True)
        self._status(force=True)
