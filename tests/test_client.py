"""The capture client's flow control against a stand-in HTTP endpoint (pure client logic; the real SGLang server is
exercised in test_gpu.py): a slow writer must not hold the server's request slots, and failures are reported."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eagle3kit.capture.client import CaptureClient
from eagle3kit.capture.format import JournalTail, atomic_write, journal_path, sample_name, write_marker
from eagle3kit.capture.rid import parse_rid


extra_keys: list[str] = []  # every request's extra_key, as the stand-in server received it


def endpoint(respond):
    """A local HTTP endpoint (started; ``.shutdown()`` it): ``respond(port, method, path, body)`` returns
    (status, payload) for every GET and POST, the body and payload as JSON."""
    class Handler(BaseHTTPRequestHandler):
        def _reply(self, method):
            n = int(self.headers.get("Content-Length") or 0)
            status, payload = respond(self.server.server_port, method, self.path,
                                      json.loads(self.rfile.read(n)) if n else None)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps(payload).encode())

        def do_GET(self):  # noqa: N802
            self._reply("GET")

        def do_POST(self):  # noqa: N802
            self._reply("POST")

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def stand_in_server(mark, delay: float, answered=None):
    """An HTTP endpoint answering /generate like SGLang, and calling ``mark(key)`` ``delay`` seconds later (the
    writer); the key "bad" gets SGLang's 400."""
    def respond(port, method, path, body):
        key, n = parse_rid(body["rid"])
        if key == "bad":
            return 400, {"error": "Either text, input_ids or input_embeds should be provided."}
        assert body["extra_key"].startswith(body["rid"] + ".") and len(body["input_ids"]) == n
        extra_keys.append(body["extra_key"])
        if answered:
            answered()
        threading.Timer(delay, mark, args=(key,)).start()
        return 200, {"meta_info": {"cached_tokens": 0}}
    return endpoint(respond)


def test_markers_are_awaited_beside_the_requests_in_flight(tmp_path):
    state = {"answered": 0, "marked": 0, "max_unmarked": 0}
    lock = threading.Lock()

    def mark(key):
        write_marker(tmp_path, key, 0, {"status": "ok", "key": key})
        with lock:
            state["marked"] += 1

    def answered():
        with lock:
            state["answered"] += 1
            state["max_unmarked"] = max(state["max_unmarked"], state["answered"] - state["marked"])

    server = stand_in_server(mark, 0.5, answered)  # a writer far slower than the server
    try:
        client = CaptureClient(f"http://127.0.0.1:{server.server_port}", tmp_path, timeout=10)
        items = [(f"k{i}", list(range(3 + i))) for i in range(8)] + [("bad", [1, 2])]
        seen = []
        t = time.time()
        markers = client.capture_many(items, concurrency=2, on_done=lambda k, m: seen.append(k))
        took = time.time() - t
    finally:
        server.shutdown()
    by_key = {m["key"]: m for m in markers}
    assert sorted(seen) == sorted(k for k, _ in items) and len(markers) == 9
    assert by_key["bad"]["status"] == "error" and "400" in by_key["bad"]["reason"]
    assert all(by_key[f"k{i}"]["status"] == "ok" and by_key[f"k{i}"]["meta_info"] == {"cached_tokens": 0}
               for i in range(8))
    # two slots, yet more than two requests were answered before their markers: slots freed on the answer
    assert state["max_unmarked"] > 2
    assert took < 8 * 0.5 / 2  # waiting on markers in the slots would take >= 2 s


def test_markers_missing_from_the_journal_are_found_as_files(tmp_path):
    """A writer that keeps no journal (an older one) still finishes every capture, through the slow path."""
    def mark(key):
        atomic_write(tmp_path / f"{sample_name(key, 0)}.json", json.dumps({"status": "ok", "key": key}).encode())

    server = stand_in_server(mark, 0.05)
    try:
        client = CaptureClient(f"http://127.0.0.1:{server.server_port}", tmp_path, timeout=10)
        markers = client.capture_many([(f"k{i}", [1, 2, 3]) for i in range(4)], concurrency=4)
    finally:
        server.shutdown()
    assert sorted(m["key"] for m in markers) == ["k0", "k1", "k2", "k3"]
    assert all(m["status"] == "ok" for m in markers) and not journal_path(tmp_path, 0).exists()


def test_a_capture_that_never_finishes_is_an_error_after_the_timeout(tmp_path):
    server = stand_in_server(lambda key: None, 0.0)
    try:
        client = CaptureClient(f"http://127.0.0.1:{server.server_port}", tmp_path, timeout=1.5)
        (m,) = client.capture_many([("lost", [1, 2])], concurrency=1)
    finally:
        server.shutdown()
    assert m["status"] == "error" and "no capture marker" in m["reason"]


def test_captures_answered_by_a_server_that_then_died_fail_at_once_not_after_the_timeout(tmp_path):
    """kill -9 of the GPU server mid-extraction (outputs/records/gpu-drafter-pipeline-2/faults): its writer dies with
    it, so answered requests never get a marker; the client waited the full timeout (600 s) on each."""
    server = stand_in_server(lambda key: None, 0.0, answered=None)
    client = CaptureClient(f"http://127.0.0.1:{server.server_port}", tmp_path, timeout=120)
    assert client.unreachable() is None

    def kill_after_answers():
        while len(extra_keys) < 3:
            time.sleep(0.01)
        server.shutdown()
        server.server_close()  # the port refuses connections, as a killed process's does

    extra_keys.clear()
    threading.Thread(target=kill_after_answers, daemon=True).start()
    t0 = time.time()
    done = client.capture_many([(f"k{i}", [1, 2]) for i in range(3)], concurrency=3)
    assert time.time() - t0 < 20  # not the 120 s timeout
    assert len(done) == 3 and all(m["status"] == "error" and "server is gone" in m["reason"] for m in done), done
    assert "refused" in client.unreachable().lower()


def test_journal_tail_reads_new_whole_lines_only(tmp_path):
    write_marker(tmp_path, "old", 0, {"status": "ok", "key": "old"})
    tail = JournalTail(tmp_path, 0)
    assert tail.read() == []  # lines before the tail was opened are not read
    write_marker(tmp_path, "a", 0, {"status": "ok", "key": "a"})
    with open(journal_path(tmp_path, 0), "ab") as f:
        f.write(b'{"status": "ok", "ke')  # a line being written
    assert [m["key"] for m in tail.read()] == ["a"]
    with open(journal_path(tmp_path, 0), "ab") as f:
        f.write(b'y": "b"}\n')
    assert [m["key"] for m in tail.read()] == ["b"]
    journal_path(tmp_path, 0).unlink()  # removed and started again (longer than before): read from its start
    for k in ("c", "d", "e", "f"):
        write_marker(tmp_path, k, 0, {"status": "ok", "key": k})
    assert [m["key"] for m in tail.read()] == ["c", "d", "e", "f"]


def test_journal_lines_never_interleave(tmp_path, threads=8):
    def many(t):
        for i in range(50):
            write_marker(tmp_path, f"t{t}-{i}", 0, {"status": "ok", "key": f"t{t}-{i}", "pad": "x" * 3000})
    ts = [threading.Thread(target=many, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    lines = journal_path(tmp_path, 0).read_bytes().split(b"\n")[:-1]
    expected = sorted(f"t{t}-{i}" for t in range(threads) for i in range(50))
    assert sorted(json.loads(x)["key"] for x in lines) == expected


def test_a_key_captured_again_gets_a_new_cache_namespace(tmp_path):
    """The rid repeats when a key is captured again (retry, rerun); the extra_key must not, or the second capture
    hits the radix cache of the first and comes back incomplete (seen on the GPU, benchmark pass 2)."""
    server = stand_in_server(lambda key: write_marker(tmp_path, key, 0, {"status": "ok", "key": key}), 0.0)
    try:
        client = CaptureClient(f"http://127.0.0.1:{server.server_port}", tmp_path, timeout=10)
        del extra_keys[:]
        for _ in range(2):
            assert client.capture_many([("same", [1, 2, 3])], concurrency=1)[0]["status"] == "ok"
    finally:
        server.shutdown()
    assert len(extra_keys) == 2 and extra_keys[0] != extra_keys[1]


def test_a_named_cache_namespace_is_shared_by_the_requests_given_it_and_by_no_other(tmp_path):
    """02's prefix-hit pair: both requests in one namespace of their own, so the first cannot hit what came before it
    (it did on the tiny Kimi target in SGLang's shared namespace) and the second hits the first."""
    bodies = []

    def respond(port, method, path, body):
        bodies.append(body)
        write_marker(tmp_path, parse_rid(body["rid"])[0], 0, {"status": "ok"})
        return 200, {"meta_info": {"cached_tokens": 0}}
    server = endpoint(respond)
    try:
        client = CaptureClient(f"http://127.0.0.1:{server.server_port}", tmp_path, timeout=10)
        for key, ns in (("first", "pair"), ("second", "pair"), ("other", None), ("shared", False)):
            client.capture(key, [1, 2, 3], isolate_cache=ns)
        client.capture("pinned", [1, 2, 3], isolate_cache="pair", routed_dp_rank=1)  # one DP group's cache
    finally:
        server.shutdown()
    keys = [b.get("extra_key") for b in bodies]
    assert keys[:2] == ["pair", "pair"] and keys[2] not in (None, "pair") and keys[3] is None
    assert [b.get("routed_dp_rank") for b in bodies] == [None] * 4 + [1]


def info_server(info: dict):
    """An endpoint answering SGLang's GET /server_info with ``info``."""
    return endpoint(lambda port, method, path, body: (200 if path == "/server_info" else 404, info))


def test_a_given_server_that_would_write_elsewhere_is_refused_before_anything_is_sent(tmp_path):
    import pytest

    from eagle3kit.capture.hook import capture_config, forward_hooks
    from eagle3kit.capture.server import ServerError, check_capture_server

    cfg = capture_config(tmp_path / "samples", [2, 15, 27], 30)
    expect = dict(capture_dir=str(tmp_path / "samples"), aux_layer_ids=[2, 15, 27], num_layers=30,
                  final_normed=False, storage="bf16")
    cases = [({"forward_hooks": forward_hooks(cfg)}, None),
             ({"forward_hooks": json.dumps(forward_hooks(cfg))}, None),  # a JSON string is read too
             ({"model_path": "m"}, None),  # an SGLang that does not report its arguments: nothing to compare
             ({"forward_hooks": None}, "without eagle3kit's capture hooks"),
             ({"forward_hooks": forward_hooks({**cfg, "capture_dir": "/elsewhere"})}, "writes captures to /elsewhere"),
             ({"forward_hooks": forward_hooks({**cfg, "aux_layer_ids": [3, 15, 27]})}, "aux_layer_ids is [3, 15, 27]"),
             ({"forward_hooks": forward_hooks({**cfg, "storage": "fp8"})}, "storage is 'fp8'")]
    for info, error in cases:
        server = info_server(info)
        url = f"http://127.0.0.1:{server.server_port}"
        try:
            if error is None:
                check_capture_server(url, expect)
            else:
                with pytest.raises(ServerError, match=error.replace("[", r"\[").replace("]", r"\]")):
                    check_capture_server(url, expect)
        finally:
            server.shutdown()
            server.server_close()
    with pytest.raises(ServerError, match="does not answer /server_info.*Fix"):
        check_capture_server(url, expect, timeout=2)  # that server is gone now


def test_a_capture_server_whose_hooks_fire_on_no_layer_is_refused_with_the_fix(tmp_path):
    """The start-up probe (capture.server.probe_capture): the hook's end-of-forward error when no decoder-layer
    hook fired (module names other than the template, e.g. a wrapper's language_model.model.layers) ends the
    start with the fix, instead of every request waiting for captures that never come."""
    import pytest

    from eagle3kit.capture.server import PROBE_KEY, ServerError, decoder_layer_template, probe_capture

    def bad(key):
        atomic_write(tmp_path / f"{sample_name(key, 0)}.json", json.dumps(
            {"status": "error", "key": key, "reason": "no output captured from decoder layers [1, 14]: their hooks did "
             "not fire (module names differ from the layer_module template?)"}).encode())

    server = stand_in_server(bad, 0.0)
    try:
        with pytest.raises(ServerError, match="did not capture a probe.*layer_module="):
            probe_capture(f"http://127.0.0.1:{server.server_port}", tmp_path, timeout=10)
    finally:
        server.shutdown()
    assert not list(tmp_path.glob(f"{PROBE_KEY}*"))  # the probe leaves nothing behind

    def good(key):
        (tmp_path / f"{sample_name(key, 0)}.safetensors").write_bytes(b"x")
        write_marker(tmp_path, key, 0, {"status": "ok", "key": key, "n_tokens": 8})

    server = stand_in_server(good, 0.0)
    try:
        probe_capture(f"http://127.0.0.1:{server.server_port}", tmp_path, timeout=10)
    finally:
        server.shutdown()
    assert not list(tmp_path.glob(f"{PROBE_KEY}*"))
    (tmp_path / "kimi").mkdir()
    (tmp_path / "kimi" / "config.json").write_text('{"architectures": ["KimiK25ForConditionalGeneration"]}')
    assert decoder_layer_template(tmp_path / "kimi") == "language_model.model.layers.{}"
    (tmp_path / "kimi" / "config.json").write_text('{"architectures": ["DeepseekV3ForCausalLM"]}')
    assert decoder_layer_template(tmp_path / "kimi") == "model.layers.{}"


def _status_file(tmp_path, write_failed: int, last_error: str) -> None:
    atomic_write(tmp_path / "_status.rank0.json",
                 json.dumps({"rank": 0, "counts": {"write_failed": write_failed}, "last_error": last_error}).encode())


def test_a_writer_that_cannot_write_for_a_full_disk_fails_its_captures_at_once_not_after_the_timeout(tmp_path,
                                                                                                   monkeypatch):
    """A full disk under SGLang's own writer (#12): the writer fails the sample's write and, when not even its
    error marker fits, only its status says why. The client reads that (a write failure new since it started, with
    ENOSPC) and fails the captures with errno ENOSPC, which the extraction turns into its disk-full stop; an older
    failure, or another error, does not count (those captures wait for their timeout, as before)."""
    import errno

    import eagle3kit.capture.client as C

    monkeypatch.setattr(C, "FULL_AFTER", 1.5)  # 5 s in use; the test's clocks scaled down with it (timeout 9 -> 6)
    _status_file(tmp_path, 1, "io: OSError: [Errno 28] No space left on device")  # before this run: not ours
    server = stand_in_server(lambda key: None, 0.0)
    try:
        client = CaptureClient(f"http://127.0.0.1:{server.server_port}", tmp_path, timeout=6)
        assert client.disk_full(1) is None and client.disk_full(0).startswith("writer rank0: io: OSError: [Errno 28]")
        t0 = time.time()
        (m,) = client.capture_many([("old", [1, 2])], concurrency=1)
        assert time.time() - t0 >= 6 and "no capture marker 6 s" in m["reason"] and "errno" not in m
        threading.Timer(0.5, _status_file, args=(tmp_path, 2, "io: OSError: [Errno 28] No space left on device")).start()
        t0 = time.time()
        done = client.capture_many([(f"k{i}", [1, 2]) for i in range(3)], concurrency=3)
        took = time.time() - t0
        _status_file(tmp_path, 3, "io: PermissionError: [Errno 13] Permission denied")  # another error: no stop
        (other,) = client.capture_many([("perm", [1, 2])], concurrency=1)
    finally:
        server.shutdown()
    assert took < 5, took  # FULL_AFTER (and the 0.5-s timer), not the timeout
    assert all(m["status"] == "error" and m["errno"] == errno.ENOSPC and "No space left on device" in m["reason"]
               and "Fix: free space" in m["reason"] for m in done), done
    assert "errno" not in other and "no capture marker 6 s" in other["reason"]


def test_a_stopped_run_sends_no_more_requests(tmp_path):
    """on_done raising (the extraction's disk-full stop, or Ctrl-C) ends capture_many at once: the requests not yet
    sent are cancelled, not sent to a server whose writer cannot write them."""
    def mark(key):
        write_marker(tmp_path, key, 0, {"status": "ok", "key": key})

    extra_keys.clear()
    server = stand_in_server(mark, 0.05)

    class Stop(Exception):
        pass

    def on_done(key, marker):
        raise Stop

    try:
        client = CaptureClient(f"http://127.0.0.1:{server.server_port}", tmp_path, timeout=10)
        with pytest.raises(Stop):
            client.capture_many([(f"k{i}", [1, 2]) for i in range(200)], concurrency=2, on_done=on_done)
        time.sleep(0.3)
    finally:
        server.shutdown()
    assert len(extra_keys) < 100, len(extra_keys)  # those sent before the first marker came (~20), not 200


def test_servers_stop_at_once_within_one_shared_grace(tmp_path):
    """gpu-breakeven-1: ten SGLang servers stopped one after another, each outliving its 20 s of grace, took the
    benchmark past its time limit after its last round. Processes that ignore SIGTERM (as those did) are stopped
    together: one grace for all, then killed with their process groups."""
    import subprocess
    import sys

    from eagle3kit.capture.server import SGLangServer, stop_all

    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(120)"
    servers = []
    for i in range(4):
        s = SGLangServer.__new__(SGLangServer)  # its process only: a real one that ignores SIGTERM
        s._log = open(tmp_path / f"s{i}.log", "w")
        s.proc = subprocess.Popen([sys.executable, "-c", stubborn], stdout=s._log, start_new_session=True)
        servers.append(s)
    deadline = time.time() + 30
    while time.time() < deadline and not all((tmp_path / f"s{i}.log").read_text() for i in range(4)):
        time.sleep(0.05)  # each has set its handler
    t0 = time.perf_counter()
    stop_all(servers, grace=2.0)
    took = time.perf_counter() - t0
    assert all(s.proc.poll() is not None for s in servers) and all(s._log.closed for s in servers)
    assert all(s.proc.returncode == -9 for s in servers)  # killed after the grace, SIGTERM having been ignored
    assert took < 6.0, took  # one after another: 4 x 2 s at least

    class Other:  # anything else with a stop() of its own is stopped by it
        stopped = False

        def stop(self):
            Other.stopped = True

    stop_all([Other()])
    assert Other.stopped

    # a launcher that already exited (crashed; or a server that failed to start) left a child in its group that
    # ignores SIGTERM, as SGLang's schedulers holding the GPU would: stopped all the same, its log closed
    s = SGLangServer.__new__(SGLangServer)
    s._log = open(tmp_path / "orphan.log", "w")
    leader = ("import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', " + repr(stubborn) + "]); "
              "print('child', c.pid, flush=True)")
    s.proc = subprocess.Popen([sys.executable, "-c", leader], stdout=s._log, start_new_session=True)
    s.proc.wait(30)
    deadline = time.time() + 30
    while time.time() < deadline and "up" not in (tmp_path / "orphan.log").read_text():
        time.sleep(0.05)
    child = int((tmp_path / "orphan.log").read_text().split("child ")[1].split()[0])

    def running(pid):  # a killed orphan may stay a zombie until init reaps it: that is not running
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False
    assert running(child) and s.proc.poll() is not None  # the child is there, the launcher is not
    stop_all([s], grace=1.0)
    t_end = time.time() + 10
    while running(child) and time.time() < t_end:
        time.sleep(0.05)
    assert not running(child)  # the old stop looked at the launcher only and left the child running
    assert s._log.closed


def test_a_server_is_not_started_on_a_port_another_process_answers(tmp_path):
    """gpu-mla-tiny-2: a cut 05 left its SGLang servers running, and the next run's servers, started on the same
    ports, were taken healthy by the old ones' /health: the old drafter was measured and the proof found no records.
    A port that already answers is refused before anything starts; 05 reports that server failed, the others start."""
    import socket

    from eagle3kit.acceptance.online import Serving, start_servers
    from eagle3kit.capture.server import ServerError, SGLangServer

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        s = SGLangServer(tmp_path / "model", port=port, log_path=tmp_path / "s.log")
        with pytest.raises(ServerError, match=f"127.0.0.1:{port} already answers.*Fix: stop it"):
            s.start()
        assert s.proc is None and not (tmp_path / "s.log").exists()
        r = start_servers(tmp_path / "model", [Serving("plain")], tmp_path / "logs", base_port=port)
        assert r["servers"] == {} and "already answers" in r["failed"]["plain"]
