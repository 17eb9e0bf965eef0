"""Captures from capture servers on other hosts: each capture host's finished samples travel to the trainer's stream
folder through torch.distributed's gloo transport (TCP), so the trainer's client reads them as it reads a server on
its own host (DESIGN.md "Across hosts": why torch.distributed and not Mooncake's transfer engine).

On each capture host, beside its SGLang capture server (capture_dir=D on a RAM filesystem), one sender:
``eagle3kit relay --capture-dir D --to TRAINER:PORT --index i --of N``. It follows the writer's journal in D, and
for each capture sends its marker and file, then removes them from D (the bytes move, never pile up there), and it
sends the writers' status files when they change. On the trainer, ``LiveConfig.relay_port`` starts the receiver: it
writes each sample into the stream folder's samples/ and appends its marker to the journal there, the same files
the capture hook writes, so the client, the checks and the bound are the same-host path's.

A group per trainer rank: the receiver is rank 0 (its TCPStore listens on PORT), the N senders ranks 1..N. A message
is a header (kind, name bytes, marker bytes, file bytes), the name and marker, and the file's bytes.
"""
from __future__ import annotations

import datetime
import json
import os
import threading
import time
from pathlib import Path

SAMPLE, STATUS, BYE = 1, 2, 3


class RelayError(RuntimeError):
    pass


def _group(host: str, port: int, rank: int, world: int, timeout_s: float):
    import torch.distributed as dist

    t = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world, rank == 0, timeout=t)
    return dist.ProcessGroupGloo(store, rank, world, t)


def _atomic(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".relay-tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class RelayReceiver:
    """The trainer's end: samples from ``senders`` capture hosts into ``samples_dir``, on a thread, until every sender
    said goodbye or ``close``. ``counts``: samples, bytes, statuses received."""

    def __init__(self, samples_dir, port: int, senders: int, host: str = "0.0.0.0", timeout_s: float = 600):
        self.samples_dir, self.port, self.senders = Path(samples_dir), port, senders
        self.host, self.timeout_s = host, timeout_s
        self.counts = {"relay_samples": 0, "relay_bytes": 0, "relay_statuses": 0}
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    def start(self) -> "RelayReceiver":
        """Starts the receiving thread (once: a later call does nothing)."""
        if self._thread is not None:
            return self
        self.samples_dir.mkdir(parents=True, exist_ok=True)
        self._pg = None

        def run():
            try:
                self._pg = _group(self.host, self.port, 0, self.senders + 1, self.timeout_s)
                self._ready.set()
                self._serve()
            except BaseException as e:  # noqa: BLE001 - kept for close() and the stream's summary
                self.error = e
                self._ready.set()

        self._thread = threading.Thread(target=run, name="e3k-relay", daemon=True)
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Whether every sender has joined (the group is up) within ``timeout`` seconds."""
        return self._ready.wait(timeout) and self.error is None

    def _serve(self) -> None:
        import torch

        from eagle3kit.capture.format import write_marker

        left = self.senders
        while left:
            head = torch.empty(4, dtype=torch.int64)
            work = self._pg.recv_anysource([head], 0)
            work.wait()
            src = work.source_rank()
            kind, n_name, n_marker, n_file = (int(x) for x in head)
            raw = b""
            if n_name + n_marker:
                body = torch.empty(n_name + n_marker, dtype=torch.uint8)
                self._pg.recv([body], src, 1).wait()
                raw = body.numpy().tobytes()
            data = None
            if n_file:  # received in place and written from there (no copy of the sample's bytes)
                data = torch.empty(n_file, dtype=torch.uint8)
                self._pg.recv([data], src, 2).wait()
            name = raw[:n_name].decode()
            if kind == BYE:
                left -= 1
            elif kind == STATUS:
                _atomic(self.samples_dir / name, raw[n_name:])
                self.counts["relay_statuses"] += 1
            elif kind == SAMPLE:
                marker = json.loads(raw[n_name:])
                if data is not None:
                    _atomic(self.samples_dir / name, memoryview(data.numpy()))
                write_marker(self.samples_dir, marker["key"], int(marker.get("rank", 0)), marker)
                self.counts["relay_samples"] += 1
                self.counts["relay_bytes"] += n_file
            else:
                raise RelayError(f"relay message of unknown kind {kind} from sender {src}")

    def close(self, wait_s: float = 0.0) -> dict:
        """The counts; waits up to ``wait_s`` for the senders' goodbyes. A receiver that failed raises its error."""
        if self._thread is not None:
            self._thread.join(wait_s)
        if self.error is not None:
            raise RelayError(f"relay receiver on port {self.port}: {type(self.error).__name__}: {self.error}")
        return dict(self.counts)


class RelaySender:
    """A capture host's end: follows writer ``rank``'s journal in ``capture_dir`` and moves each capture to the
    receiver at ``to`` ("host:port") as sender ``index`` (1..of) of ``of``."""

    def __init__(self, capture_dir, to: str, index: int, of: int, rank: int = 0, timeout_s: float = 600):
        host, _, port = to.rpartition(":")
        if not host or not port.isdigit():
            raise RelayError(f"--to {to!r}: give the trainer's host:port (its live relay_port)")
        if not 1 <= index <= of:
            raise RelayError(f"--index {index} of {of}: senders are numbered 1 to --of")
        self.capture_dir, self.host, self.port = Path(capture_dir), host, int(port)
        self.index, self.of, self.rank, self.timeout_s = index, of, rank, timeout_s
        self.sent = {"samples": 0, "bytes": 0, "statuses": 0}

    def run(self, stop: threading.Event | None = None, poll: float = 0.005, status_every: float = 1.0) -> dict:
        """Until ``stop`` is set (or SIGINT): every capture the journal names, then goodbye. Returns what it sent."""
        from eagle3kit.capture.format import JournalTail, sample_name

        self.capture_dir.mkdir(parents=True, exist_ok=True)
        pg = _group(self.host, self.port, self.index, self.of + 1, self.timeout_s)
        tail = JournalTail(self.capture_dir, self.rank)
        tail.offset, tail.inode = 0, None  # every capture of the journal, also those written before this started
        stop = stop or threading.Event()
        statuses: dict[str, float] = {}
        last_status = 0.0
        try:
            while True:
                markers = tail.read()
                for m in markers:
                    name = m.get("file") or ""
                    path = self.capture_dir / name if name else None
                    data = bytearray()
                    if path is not None and m.get("status") == "ok":
                        try:
                            data = _read(path)
                        except FileNotFoundError:  # the client sees a failed capture and asks for it again
                            m = {**m, "status": "error", "reason": f"relay: {name} is missing on the capture host"}
                            name = ""
                    self._send(pg, SAMPLE, name, json.dumps(m).encode(), data)
                    self.sent["samples"] += 1
                    self.sent["bytes"] += len(data)
                    for p in (path, self.capture_dir / f"{sample_name(m['key'], self.rank)}.json"):
                        if p is not None:
                            p.unlink(missing_ok=True)
                if time.time() - last_status >= status_every or stop.is_set():
                    last_status = time.time()
                    for p in sorted(self.capture_dir.glob("_status.*.json")):
                        t = p.stat().st_mtime
                        if statuses.get(p.name) != t:
                            statuses[p.name] = t
                            self._send(pg, STATUS, p.name, p.read_bytes(), bytearray())
                            self.sent["statuses"] += 1
                if stop.is_set() and not markers:
                    break
                if not markers:
                    time.sleep(poll)
        finally:
            self._send(pg, BYE, "", b"", bytearray())
        return dict(self.sent)

    def _send(self, pg, kind: int, name: str, marker: bytes, data) -> None:
        import torch

        n = name.encode()
        pg.send([torch.tensor([kind, len(n), len(marker), len(data)], dtype=torch.int64)], 0, 0).wait()
        if n or marker:
            pg.send([torch.frombuffer(bytearray(n + marker), dtype=torch.uint8)], 0, 1).wait()
        if len(data):  # the file's own buffer, sent as it was read
            pg.send([torch.frombuffer(data, dtype=torch.uint8)], 0, 2).wait()


def _read(path: Path) -> bytearray:
    """The file's bytes in a writable buffer (torch.frombuffer shares it, no copy)."""
    with open(path, "rb") as f:
        buf = bytearray(os.fstat(f.fileno()).st_size)
        f.readinto(buf)
    return buf
