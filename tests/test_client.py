"""The capture client's flow control against a stand-in HTTP endpoint (pure client logic; the real SGLang server is
exercised in test_gpu.py): a slow writer must not hold the server's request slots, and failures are reported."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from eagle3kit.capture.client import CaptureClient
from eagle3kit.capture.format import write_marker
from eagle3kit.capture.rid import parse_rid


def test_markers_are_awaited_beside_the_requests_in_flight(tmp_path):
    state = {"answered": 0, "marked": 0, "max_unmarked": 0}
    lock = threading.Lock()

    def mark(key):
        write_marker(tmp_path, key, 0, {"status": "ok", "key": key})
        with lock:
            state["marked"] += 1

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            key, n = parse_rid(body["rid"])
            if key == "bad":
                self.send_response(400)
                self.end_headers()
                self.wfile.write(b'{"error": "Either text, input_ids or input_embeds should be provided."}')
                return
            assert body["extra_key"] == body["rid"] and len(body["input_ids"]) == n
            with lock:
                state["answered"] += 1
                state["max_unmarked"] = max(state["max_unmarked"], state["answered"] - state["marked"])
            threading.Timer(0.5, mark, args=(key,)).start()  # a writer far slower than the server
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps({"meta_info": {"cached_tokens": 0}}).encode())

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
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
