"""The producer side of the live stream, in the trainer's main process: it asks for captures in the order the
trainer will read them, as far ahead as the stream's byte bound allows, and asks again for what failed or was
rejected (``source.LiveSource`` is the consumer). See ``DESIGN.md`` beside this file.

Feeders hand captures to the stream folder (``<stream>/samples``, on a RAM filesystem):
  * ``ReferenceFeeder``: the transformers reference engine, in this process (CPU demo and tests);
  * ``SGLangFeeder``: capture servers (started here, restarted when they die, or running ones: ``urls``) through
    ``CaptureClient.capture_stream``: the hooks' writer process writes each capture where the trainer reads it.
"""
from __future__ import annotations

import collections
import json
import os
import statistics
import threading
import time
from pathlib import Path

from eagle3kit.capture.format import atomic_write, sample_name
from eagle3kit.live.source import CACHE, CONSUMED, REJECTS, STATUS, epoch_key


HEADER_BYTES = 4096  # a sample file's safetensors header and metadata, at most


class ReferenceFeeder:
    """Captures by the transformers reference engine, one sample at a time, in the producer's thread."""

    def __init__(self, engine, storage: str = "bf16"):
        self.engine, self.storage = engine, storage

    def prepare(self, samples_dir: Path) -> None:
        samples_dir.mkdir(parents=True, exist_ok=True)

    def run(self, samples_dir: Path, take, on_done) -> None:
        while True:
            got = take(1)
            if got is None:
                return
            if not got:
                time.sleep(0.002)
                continue
            for key, ids in got:
                try:
                    m = self.engine.capture(samples_dir, key, ids, storage=self.storage)
                except Exception as e:  # noqa: BLE001 - counted and asked again by the stream
                    m = {"status": "error", "key": key, "reason": f"{type(e).__name__}: {e}"}
                on_done(key, m)

    def recover(self, reason: str) -> bool:
        return False

    def close(self) -> None:
        pass


class SGLangFeeder:
    """Capture servers whose hooks write into the stream folder: ``urls`` (running; their capture folder must be the
    stream's), or one started here by ``start_server()`` and started again when it dies."""

    def __init__(self, urls=(), concurrency: int = 64, timeout: float = 600, start_server=None, expect=None,
                 relay=None):
        self.urls, self.concurrency, self.timeout = list(urls), concurrency, timeout
        self.start_server, self.expect = start_server, expect
        self.relay = relay  # live.relay.RelayReceiver: the urls write on other hosts, their samples come here
        self.server = None
        self.prepared = False
        self.restarts = 0
        self.dying_s = 30.0  # recover(): how long a server that refuses requests may take to exit or answer again

    def prepare(self, samples_dir: Path) -> None:
        """Once (open_live starts its server while rendering, the regeneration before its replies): the relay
        started, given servers checked, or a server started here."""
        samples_dir.mkdir(parents=True, exist_ok=True)
        if self.prepared:
            return
        self.prepared = True
        if self.relay is not None:
            self.relay.start()
        if self.urls:
            from eagle3kit.capture.server import check_capture_server

            expect = dict(self.expect or {})
            if self.relay is not None:  # their capture folders are on their hosts: the relay brings the samples
                expect.pop("capture_dir", None)
            for url in self.urls:
                check_capture_server(url, expect)
        elif self.server is None:
            self.server = self.start_server()
            self.urls = [self.server.url]

    def run(self, samples_dir: Path, take, on_done) -> None:
        from eagle3kit.capture.client import CaptureClient

        CaptureClient(self.urls, samples_dir, timeout=self.timeout).capture_stream(
            take, self.concurrency, on_done=on_done)

    def recover(self, reason: str) -> bool:
        """A server started here that died, or that no longer answers its /health: started again (its captures in
        flight are asked again by the stream). A SIGKILLed server refuses connections a moment before its process
        can be reaped (its GPU memory is released first): so a failure while the process still runs waits up to
        ``dying_s`` for it to exit or to answer, and only a server that answers is left alone. Running servers
        (``urls``) are someone else's: their failures are retried on the next one."""
        if self.server is None or self.server.proc is None:
            return False
        from eagle3kit.capture.server import healthy

        proc, deadline = self.server.proc, time.time() + self.dying_s
        while proc.poll() is None:
            if healthy(self.server.url, timeout=20):  # SGLang answers /health after a generation step: busy, slower
                return False
            if time.time() > deadline:
                break
            time.sleep(0.2)
        state = f"exit {proc.returncode}" if proc.returncode is not None else f"no answer for {self.dying_s:.0f} s"
        print(f"[live] the capture server died ({state}; {reason[:200]}): starting it again", flush=True)
        self.server.stop()
        self.server = self.start_server()
        self.restarts += 1
        return True

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.relay is not None and self.relay.error is not None:
            print(f"[live] relay: {type(self.relay.error).__name__}: {self.relay.error}", flush=True)


class LiveStream:
    """Asks ``feeder`` for the captures of ``source``'s schedule, keeping the bytes asked for and not yet trained on
    within ``budget_bytes`` (``bytes_per_token`` estimates a capture before it exists; once written, its real size
    counts). Counts what it asked, what came, what failed, what was rejected and what the trainer took, per epoch."""

    def __init__(self, feeder, source, bytes_per_token: float, budget_bytes: int, cache_bytes: int = 0,
                 max_attempts: int = 5, status_every: float = 0.5, owns_dir: bool = False, log_path=None,
                 log_every: float = 60.0):
        self.feeder, self.source = feeder, source
        self.dir = Path(source.stream_dir)
        self.samples_dir = self.dir / "samples"
        self.bpt, self.budget, self.cache_budget = float(bytes_per_token), int(budget_bytes), int(cache_bytes)
        self.max_attempts, self.status_every = max_attempts, status_every
        self.owns_dir = owns_dir  # made for this run (not running servers' folder): removed at close
        self._lock = threading.Lock()
        self._reap_lock = threading.Lock()  # one reader of the consumed file at a time (producer, or schedule)
        self._epoch, self._order, self._pos = 0, [], 0
        self._retry: collections.deque = collections.deque()
        self._out: dict[str, dict] = {}  # key -> {i, bytes, attempts, state: asked | buffered}
        self._attempts: collections.Counter = collections.Counter()
        self._expected: dict[int, collections.Counter] = {}  # epoch -> sample index -> times in its order
        self._consumed: dict[int, collections.Counter] = {}
        self._cached: dict[int, int] = {}  # sample index -> bytes kept in the cache
        self._complete: set[int] = set()
        self._closed = False
        self._thread = None
        self.fatal = None
        self.n = collections.Counter()  # asked, captured, failed, rejected, consumed, from_cache, evicted, ...
        self.peak_stream_bytes = 0  # measured: the files in the stream folder
        self.peak_accounted_bytes = 0  # what the bound is held against: estimates of those asked + files buffered
        self._consumed_off = 0
        self._last_status = 0.0
        # the capture side's pace through the run: one line per ``log_every`` seconds (the last, shorter one at close)
        self.log_path, self.log_every = (Path(log_path) if log_path else None), float(log_every)
        self._log_t0 = self._log_last = None
        self._log_n = collections.Counter()
        self.log_rows: list[dict] = []

    def estimate(self, n_tokens: int) -> int:
        """A capture's bytes before it exists: the tensors and the file's header and metadata (at most a few KB)."""
        return int(n_tokens * self.bpt) + HEADER_BYTES

    # -- called by the trainer (main thread) --
    def prepare(self) -> None:
        for sub in ("samples", REJECTS, CACHE):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self.feeder.prepare(self.samples_dir)

    def capture_now(self, items: list[tuple[str, list]]) -> dict[str, dict]:
        """Synchronous captures outside the schedule (the held-out set): key -> marker, each tried up to
        ``max_attempts`` times."""
        todo, got = list(items), {}
        ids = dict(items)
        for _ in range(self.max_attempts):
            pending = list(todo)
            markers = {}

            def take(n):
                if not pending:
                    return None
                out = pending[:n]
                del pending[:n]
                return out

            def done(key, m):
                markers[key] = m
            self.feeder.run(self.samples_dir, take, done)
            todo = []
            for key, m in markers.items():
                if m.get("status") == "ok":
                    got[key] = m
                else:
                    todo.append((key, ids[key]))
                    if not self.feeder.recover(str(m.get("reason", ""))):
                        time.sleep(1)
            if not todo:
                return got
        raise RuntimeError(f"{len(todo)} held-out captures failed {self.max_attempts} times (first: {todo[0][0]}); "
                           f"see the capture server's log")

    def schedule(self, epoch: int, order: list[int]) -> None:
        """``order``: positions in ``source.samples`` this rank reads in ``epoch``, in reading order. An earlier
        epoch handed over before is complete: what it had asked and not handed out is dropped. What the trainer took
        so far is read first, so the new epoch's asks see every sample the epoch cache holds."""
        self._reap()
        with self._lock:
            for e in list(self._expected):
                if e < epoch:
                    self._complete.add(e)
            self._epoch, self._order, self._pos = epoch, list(order), 0
            self._expected[epoch] = collections.Counter(self.source.samples[i].index for i in order)
            self._consumed.setdefault(epoch, collections.Counter())
            self._retry.clear()
            stale = [k for k, o in self._out.items() if o["epoch"] != epoch]
            for k in stale:
                self._drop(k)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="e3k-live", daemon=True)
            self._thread.start()

    def progress(self) -> dict:
        with self._lock:
            asked = sum(1 for o in self._out.values() if o["state"] == "asked")
            buffered = sum(1 for o in self._out.values() if o["state"] == "buffered")
        return {"in_flight": asked, "buffered": buffered}

    def close(self, last_epoch_complete: bool = False) -> dict:
        """Stop asking; the counts of the run (``summary``). A second call only returns them."""
        if self._closed:
            return self.summary()
        if last_epoch_complete:
            self._complete.add(self._epoch)
        self._closed = True
        if self._thread is not None:
            self._thread.join(timeout=self.feeder.timeout if hasattr(self.feeder, "timeout") else 60)
        self._reap()
        self._log(force=True)
        self.feeder.close()
        if self.owns_dir:  # what was asked and not trained on (a run cut mid-epoch) goes with the folder
            import shutil

            shutil.rmtree(self.dir, ignore_errors=True)
        return self.summary()

    def summary(self) -> dict:
        rates = sorted(r["capture_tokens_per_s"] for r in self.log_rows if r["seconds"] >= self.log_every / 2)
        pace = {"live_capture_minutes_logged": len(rates)}
        if rates:  # the whole intervals' tokens/s (a last stub shorter than half an interval left out)
            pace.update(live_capture_tokens_per_s_median=statistics.median(rates),
                        live_capture_tokens_per_s_min=rates[0], live_capture_tokens_per_s_max=rates[-1])
        lost = dup = 0
        for e in self._complete:
            want, got = self._expected.get(e, {}), self._consumed.get(e, collections.Counter())
            lost += sum(max(0, n - got.get(i, 0)) for i, n in want.items())
            dup += sum(max(0, n - want.get(i, 0)) for i, n in got.items())
        return {"live_samples_asked": self.n["asked"], "live_samples_captured": self.n["captured"],
                "live_capture_failures": self.n["failed"], "live_samples_rejected": self.n["rejected"],
                "live_samples_trained": self.n["consumed"], "live_samples_from_cache": self.n["from_cache"],
                "live_cache_evicted": self.n["evicted"], "live_samples_lost": lost, "live_samples_duplicated": dup,
                "live_epochs_complete": len(self._complete),
                "live_distinct_samples": len({i for c in self._consumed.values() for i in c}),
                "live_peak_stream_mb": self.peak_stream_bytes / 2 ** 20,
                "live_peak_accounted_mb": self.peak_accounted_bytes / 2 ** 20,
                "live_stream_bound_mb": self.budget / 2 ** 20,
                "live_server_restarts": getattr(self.feeder, "restarts", 0), **pace,
                **{f"live_{k}": v for k, v in getattr(getattr(self.feeder, "relay", None), "counts", {}).items()}}

    # -- the producer thread --
    def _run(self) -> None:
        try:
            self.feeder.run(self.samples_dir, self._take, self._done)
        except BaseException as e:  # noqa: BLE001 - the trainer learns it through the status file
            self.fatal = f"{type(e).__name__}: {e}"
            self._write_status(force=True)

    def _take(self, n: int):
        self._reap()
        self._write_status()
        if self._closed or self.fatal:
            if self.fatal:
                self._write_status(force=True)
            return None
        out = []
        with self._lock:
            while len(out) < n:
                if self._retry:
                    i = self._retry[0]
                elif self._pos < len(self._order):
                    i = self._order[self._pos]
                else:
                    break
                s = self.source.samples[i]
                key = epoch_key(self._epoch, s.index)
                if key in self._out:  # the same sample twice in one epoch's order: the second after the first went
                    break
                est = self._cached.get(s.index) or self.estimate(s.n_tokens)
                if self._out and self._accounted() + est > self.budget:
                    break
                if self._retry:
                    self._retry.popleft()
                else:
                    self._pos += 1
                self._out[key] = {"i": i, "index": s.index, "bytes": est, "epoch": self._epoch, "state": "asked"}
                if s.index in self._cached and self._from_cache(key, s.index):
                    continue
                self.n["asked"] += 1
                out.append((key, s.input_ids))
        return out

    def _done(self, key: str, marker: dict) -> None:
        with self._lock:
            o = self._out.get(key)
            if o is None:  # dropped meanwhile (its epoch is over): its files go
                self._remove_files(key)
                return
            if marker.get("status") == "ok":
                self.n["captured"] += 1
                self.n["captured_tokens"] += int(marker.get("n_tokens", 0))
                o["state"], o["bytes"] = "buffered", int(marker.get("bytes", o["bytes"]))
                return
            self.n["failed"] += 1
        reason = str(marker.get("reason", marker.get("status")))
        self.feeder.recover(reason)
        self._again(key, f"capture failed: {reason}")

    def _again(self, key: str, why: str) -> None:
        with self._lock:
            o = self._out.pop(key, None)
            if o is None:
                return
            self._attempts[key] += 1
            if self._attempts[key] >= self.max_attempts:
                self.fatal = (f"sample {o['index']} ({key}) failed {self._attempts[key]} times; last: {why[:300]}. "
                              f"Fix: see the capture servers' logs")
                return
            self._retry.append(o["i"])

    def _from_cache(self, key: str, index: int) -> bool:
        """A sample kept from an earlier epoch: moved into the stream under this epoch's key (no capture)."""
        cache = self.dir / CACHE
        try:
            marker = json.loads((cache / f"s{index:07d}.json").read_text())
            name = sample_name(key, 0)
            os.replace(cache / f"s{index:07d}.safetensors", self.samples_dir / f"{name}.safetensors")
        except (OSError, ValueError):
            self._cached.pop(index, None)
            return False
        (cache / f"s{index:07d}.json").unlink(missing_ok=True)
        self._cached.pop(index, None)
        marker.update(key=key, file=f"{name}.safetensors")
        atomic_write(self.samples_dir / f"{name}.json", json.dumps(marker).encode())
        self._out[key]["state"] = "buffered"
        self.n["from_cache"] += 1
        return True

    def _reap(self) -> None:
        """What the trainer took (``consumed.rank<r>.jsonl``) and rejected (``rejects/``) since the last look."""
        with self._reap_lock:
            self._reap_locked()

    def _reap_locked(self) -> None:
        path = self.dir / CONSUMED.format(rank=self.source.rank)
        try:
            with open(path, "rb") as f:
                f.seek(self._consumed_off)
                data = f.read()
        except FileNotFoundError:
            data = b""
        end = data.rfind(b"\n") + 1
        self._consumed_off += end
        with self._lock:
            for line in data[:end].splitlines():
                c = json.loads(line)
                self._consumed.setdefault(c["epoch"], collections.Counter())[c["index"]] += 1
                self.n["consumed"] += 1
                o = self._out.pop(c["key"], None)
                if self.source.cache:
                    self._keep_cached(c["index"], int(c.get("bytes") or (o or {}).get("bytes", 0)))
        for p in sorted((self.dir / REJECTS).glob("*.json")):
            try:
                r = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            p.unlink(missing_ok=True)
            self.n["rejected"] += 1
            print(f"[live] {r['key']} rejected by the trainer's check ({r['reason'][:200]}): captured again", flush=True)
            self._again(r["key"], f"rejected: {r['reason']}")

    def _keep_cached(self, index: int, nbytes: int) -> None:
        if sum(self._cached.values()) + nbytes <= self.cache_budget:
            self._cached[index] = nbytes
            return
        cache = self.dir / CACHE  # over the cache's bound: this one goes (later epochs capture it again)
        (cache / f"s{index:07d}.safetensors").unlink(missing_ok=True)
        (cache / f"s{index:07d}.json").unlink(missing_ok=True)
        self.n["evicted"] += 1

    def _drop(self, key: str) -> None:
        o = self._out.pop(key)
        if o["state"] == "buffered":
            self._remove_files(key)

    def _remove_files(self, key: str) -> None:
        name = sample_name(key, 0)
        (self.samples_dir / f"{name}.safetensors").unlink(missing_ok=True)
        (self.samples_dir / f"{name}.json").unlink(missing_ok=True)

    def _accounted(self) -> int:
        return sum(o["bytes"] for o in self._out.values())

    def _log(self, force: bool = False) -> None:
        """One line of the pace log when ``log_every`` has passed (``force``: the interval so far, at close)."""
        now = time.monotonic()
        if self._log_t0 is None:
            self._log_t0 = self._log_last = now
            self._log_n = self.n.copy()
            return
        if not force and now - self._log_last < self.log_every:
            return
        dt = now - self._log_last
        if dt <= 0:
            return
        d = self.n - self._log_n
        prog = self.progress()
        row = {"time": time.time(), "t": round(now - self._log_t0, 3), "seconds": round(dt, 3),
               "captured": d["captured"], "captured_tokens": d["captured_tokens"],
               "capture_tokens_per_s": d["captured_tokens"] / dt,
               "trained": d["consumed"], "failed": d["failed"], "rejected": d["rejected"], **prog}
        self._log_last, self._log_n = now, self.n.copy()
        self.log_rows.append(row)
        if self.log_path is not None:
            with open(self.log_path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def _write_status(self, force: bool = False) -> None:
        self._log()
        now = time.time()
        if not force and now - self._last_status < self.status_every:
            return
        self._last_status = now
        measured = _folder_bytes(self.samples_dir)
        with self._lock:
            accounted = self._accounted()
        prog = self.progress()
        self.peak_stream_bytes = max(self.peak_stream_bytes, measured)
        self.peak_accounted_bytes = max(self.peak_accounted_bytes, accounted)
        st = {"epoch": self._epoch, "position": self._pos, "of": len(self._order), **prog, **dict(self.n),
              "stream_bytes": measured, "accounted_bytes": accounted, "bound_bytes": self.budget,
              "fatal": self.fatal, "time": now}
        atomic_write(self.dir / STATUS.format(rank=self.source.rank), json.dumps(st).encode())


def _folder_bytes(d: Path) -> int:
    total = 0
    try:
        with os.scandir(d) as it:
            for e in it:
                if e.name.endswith(".safetensors"):
                    try:
                        total += e.stat(follow_symlinks=False).st_size
                    except OSError:
                        pass
    except FileNotFoundError:
        pass
    return total
