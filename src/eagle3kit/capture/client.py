"""Client of a capture server: sends ``input_ids`` (SGLang rejects ``prompt_token_ids``) with one rid per sample,
many requests in flight, and knows a capture is finished when its marker file appears."""
from __future__ import annotations

import errno
import itertools
import shutil
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eagle3kit.capture.format import JournalTail, read_marker, read_statuses, sample_name
from eagle3kit.capture.rid import RID_PREFIX, make_rid


GONE_AFTER = 3.0  # seconds an answered capture waits for its marker before the server's liveness is checked
FULL_AFTER = 5.0  # ... before the capture folder's disk is checked (a writer that cannot write leaves no marker)
FULL_BELOW = 1 << 20  # bytes free under which that disk counts as full (no marker, not even the writer's status, fits)


class CaptureError(RuntimeError):
    pass


class CaptureClient:
    def __init__(self, urls, capture_dir, rank: int = 0, rid_prefix: str = RID_PREFIX, timeout: float = 600,
                 isolate_cache: bool = True):
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        self.capture_dir = Path(capture_dir)
        self.rank, self.prefix, self.timeout = rank, rid_prefix, timeout
        self.isolate_cache = isolate_cache  # a unique extra_key per request: no prefix-cache hit can skip tokens
        self._local = threading.local()
        self._next = 0
        self._lock = threading.Lock()

    def _session(self):
        import requests

        if not hasattr(self._local, "s"):
            self._local.s = requests.Session()
        return self._local.s

    def _url(self) -> str:
        with self._lock:
            self._next += 1
            return self.urls[self._next % len(self.urls)]

    def clear(self, key: str) -> None:
        for suffix in (".json", ".safetensors"):
            (self.capture_dir / f"{sample_name(key, self.rank)}{suffix}").unlink(missing_ok=True)

    def generate(self, key: str, input_ids: list[int], max_new_tokens: int = 0, url: str | None = None,
                 isolate_cache: bool | str | None = None, routed_dp_rank: int | None = None, **sampling) -> dict:
        """``isolate_cache``: True, a fresh cache namespace (``extra_key``) for this request; a string, that namespace
        (requests sharing it can hit each other's prefixes and nothing else's); False, SGLang's shared namespace.
        ``routed_dp_rank``: the data-parallel worker / attention-DP group to serve it (SGLang's ``routed_dp_rank``);
        None: SGLang's own dispatch (round robin), so two requests meant to share a prefix cache may not."""
        rid = make_rid(key, len(input_ids), self.prefix)
        ids = input_ids.tolist() if hasattr(input_ids, "tolist") else list(input_ids)  # tensors, arrays, lists
        if ids and type(ids[0]) is not int:  # numpy scalars in a list, say: JSON takes Python ints only
            ids = [int(x) for x in ids]
        body = {"input_ids": ids, "rid": rid,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, **sampling}}
        if routed_dp_rank is not None:
            body["routed_dp_rank"] = int(routed_dp_rank)
        if isinstance(isolate_cache, str):
            body["extra_key"] = isolate_cache
        elif self.isolate_cache if isolate_cache is None else isolate_cache:
            # unique per request, not per key: the rid repeats when a key is captured again (a retry, a rerun, a
            # second benchmark pass), and a namespace shared with the first capture would let it hit the cache
            body["extra_key"] = f"{rid}.{uuid.uuid4().hex[:16]}"
        r = self._session().post((url or self._url()) + "/generate", json=body, timeout=self.timeout)
        if r.status_code != 200:
            raise CaptureError(f"{key}: SGLang answered {r.status_code}: {r.text[:300]}")
        return r.json()

    def wait(self, key: str, timeout: float | None = None) -> dict:
        deadline = time.time() + (timeout or self.timeout)
        delay = 0.002
        while time.time() < deadline:
            m = read_marker(self.capture_dir, key, self.rank)
            if m is not None:
                return m
            time.sleep(delay)
            delay = min(delay * 1.5, 0.1)
        raise CaptureError(f"{key}: no capture marker after {timeout or self.timeout:.0f} s; server status: "
                           f"{self.status()}")

    def send(self, key: str, input_ids: list[int], max_new_tokens: int = 0, **kw) -> dict:
        """Clear an earlier capture of ``key`` and send the prompt; returns SGLang's answer."""
        self.clear(key)
        return self.generate(key, input_ids, max_new_tokens, **kw)

    def collect(self, key: str, answer: dict) -> dict:
        """Wait for ``key``'s capture; the marker with the server's meta_info."""
        return _answered(self.wait(key), answer)

    def capture(self, key: str, input_ids: list[int], max_new_tokens: int = 0, **kw) -> dict:
        """Send one prompt, wait for its capture; returns the marker with the server's meta_info."""
        return self.collect(key, self.send(key, input_ids, max_new_tokens, **kw))

    def capture_many(self, items, concurrency: int = 64, max_new_tokens: int = 0, on_done=None,
                     poll: float = 0.002) -> list[dict]:
        """``items``: (key, input_ids) pairs. Markers in completion order; ``on_done(key, marker)`` per item, called
        from this thread. ``capture_stream`` over the items, taken as fast as slots free up."""
        it = iter(items)

        def take(n):
            got = list(itertools.islice(it, n))
            return got or None
        return self.capture_stream(take, concurrency, max_new_tokens, on_done, poll)

    def capture_stream(self, take, concurrency: int = 64, max_new_tokens: int = 0, on_done=None,
                       poll: float = 0.002) -> list[dict]:
        """Captures of what ``take(n)`` hands out: up to ``n`` (key, input_ids) pairs to send now, ``[]`` for none
        yet (asked again next poll: a caller that bounds its memory, the live stream), ``None`` once there are no
        more. A key may come back after its marker was handed to ``on_done`` (captured again). Markers in
        completion order; ``on_done(key, marker)`` per capture, called from this thread.

        ``concurrency`` requests stay in flight at the server: a request's slot is freed as soon as SGLang answers
        (the writer's latency never starves the server; its memory is bounded on the server side, by the capture
        ring's back-pressure). This thread clears earlier captures before sending and collects the markers from
        the rank's journal (``format.JournalTail``): one small read per ``poll`` seconds for all requests, so
        the request threads do nothing but HTTP. A marker missing from the journal (a writer that keeps none) is
        looked for as a file after a second; none after ``timeout`` seconds is an error, and one at once when no
        marker can come (``_late_markers``: the server is gone, or the disk is full). If ``on_done`` raises (the
        extraction's disk-full stop, Ctrl-C), the requests not yet sent are cancelled."""
        tail = JournalTail(self.capture_dir, self.rank)
        lock = threading.Lock()
        answered: dict[str, tuple[float, dict]] = {}  # key -> (when SGLang answered, its answer)
        failures: list[dict] = []
        journal: dict[str, dict] = {}  # markers read from the journal, not yet matched with an answer
        results: list[dict] = []

        posting = [0]  # requests not yet answered by SGLang: what ``concurrency`` bounds

        def post(key, ids):
            try:
                answer = self.generate(key, ids, max_new_tokens)
            except Exception as e:  # noqa: BLE001 - one failed request must not lose the others
                with lock:
                    posting[0] -= 1
                    failures.append({"status": "error", "key": key, "reason": f"{type(e).__name__}: {e}"})
                return
            with lock:
                posting[0] -= 1
                answered[key] = (time.time(), answer)

        def finish(key, marker):
            inflight.discard(key)
            results.append(marker)
            if on_done:
                on_done(key, marker)

        write_failed_before = _write_failures(self.status())
        inflight: set[str] = set()
        with ThreadPoolExecutor(concurrency, thread_name_prefix="e3k-post") as posts:
            more = True
            try:
                checked = time.time()
                while True:
                    with lock:
                        free = concurrency - posting[0]
                    if more and free > 0:  # a slot is free once SGLang answers, its marker awaited beside
                        got = take(free)
                        if got is None:
                            more = False
                        for key, ids in got or ():
                            self.clear(key)  # here, not in the request threads: a slot only ever waits on the server
                            journal.pop(key, None)  # a marker of an earlier capture of the key is not this one's
                            inflight.add(key)
                            with lock:
                                posting[0] += 1
                            posts.submit(post, key, ids)
                    if not more and not inflight:
                        break
                    for m in tail.read():
                        if m.get("key") in inflight:
                            journal[m["key"]] = m
                    with lock:
                        failed, failures[:] = failures[:], []
                        ready = [(k, answered.pop(k)[1]) for k in list(journal) if k in answered]
                    for m in failed:
                        finish(m["key"], m)
                    for key, answer in ready:
                        finish(key, _answered(journal.pop(key), answer))
                    now = time.time()
                    if now - checked > 1.0:  # the slow path: markers the journal did not list
                        checked = now
                        with lock:
                            late = [(k, t, a) for k, (t, a) in answered.items() if now - t > 1.0]
                        for key, m in self._late_markers(late, now, write_failed_before):
                            with lock:
                                answered.pop(key, None)
                            finish(key, m)
                    if not (failed or ready):
                        time.sleep(poll)
            except BaseException:  # on_done stopped the run (a full disk, Ctrl-C): send nothing more
                posts.shutdown(wait=False, cancel_futures=True)
                raise
        return results

    def _late_markers(self, late, now: float, write_failed_before: int) -> list[tuple[str, dict]]:
        """(key, marker) for the answered captures of ``late`` (key, when answered, answer) that the journal did not
        list: the marker file, or an error when none can come (the server is gone, the disk is full) or the
        timeout has passed; captures still within their time are left to wait."""
        gone = self.unreachable() if any(now - t > GONE_AFTER for _, t, _ in late) else None
        full = self.disk_full(write_failed_before) if any(now - t > FULL_AFTER for _, t, _ in late) else None
        out = []
        for key, t, answer in late:
            m = read_marker(self.capture_dir, key, self.rank)
            if m is None and gone and now - t > GONE_AFTER:  # its writer died with it: no marker comes
                m = {"status": "error", "key": key, "reason": f"no capture marker, and the server is gone ({gone}): it "
                     f"stopped after answering. Fix: restart it and capture again (a resume of the extraction does)"}
            if m is None and full and now - t > FULL_AFTER:  # nothing can be written: no marker comes
                m = {"status": "error", "key": key, "errno": errno.ENOSPC,
                     "reason": f"no capture marker: No space left on device ({full}). Fix: free space in "
                               f"{self.capture_dir}, then capture again (a resume of the extraction does)"}
            if m is None and now - t > self.timeout:
                m = {"status": "error", "key": key, "reason": f"no capture marker {self.timeout:.0f} s after SGLang "
                     f"answered; server status: {self.status()}"}
            if m is not None:
                out.append((key, _answered(m, answer)))
        return out

    def disk_full(self, write_failed_before: int = 0) -> str | None:
        """Why the capture folder's disk counts as full, or None: a writer failed a write with ENOSPC since
        ``write_failed_before`` (its status says so), or too little is free for even a marker to be written."""
        statuses = self.status()
        if _write_failures(statuses) > write_failed_before:
            for name, st in statuses.items():
                err = str(st.get("last_error") or "")
                if "No space left on device" in err or f"[Errno {errno.ENOSPC}]" in err:
                    return f"writer {name}: {err.splitlines()[0][:300]}"
        try:
            free = shutil.disk_usage(self.capture_dir).free
        except OSError:
            return None
        return f"{free:,} bytes free" if free < FULL_BELOW else None

    def unreachable(self) -> str | None:
        """Why none of this client's servers accepts a connection any more (None: one does). A TCP connect, not an
        HTTP request: a busy server still accepts, a killed one refuses at once."""
        import socket
        from urllib.parse import urlsplit

        why = []
        for url in self.urls:
            u = urlsplit(url)
            try:
                socket.create_connection((u.hostname, u.port or 80), timeout=2).close()
                return None
            except OSError as e:
                why.append(f"{url}: {e.strerror or e}")
        return "; ".join(why)

    def status(self) -> dict:
        """Each writer's status: ``rank<r>``, or ``dp<d>.rank<r>`` per worker of a ``--dp N`` server."""
        return read_statuses(self.capture_dir)


def _write_failures(statuses: dict) -> int:
    """Writes the writers of a capture folder failed so far (their status files)."""
    return sum(int(st.get("counts", {}).get("write_failed", 0)) for st in statuses.values())


def _answered(marker: dict, answer: dict) -> dict:
    """The marker with SGLang's ``meta_info`` for the request (cached tokens and the like)."""
    return {**marker, "meta_info": answer.get("meta_info", {})}
