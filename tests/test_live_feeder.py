"""SGLangFeeder.recover: when a live training restarts the capture server it started. Real processes stand in for the
server (its process, and an HTTP /health on its URL or nothing there); SGLang itself is the GPU fault run's."""
import http.server
import subprocess
import sys
import threading

import pytest

from eagle3kit.live.stream import SGLangFeeder
from tests.training_runs import free_port


class Server:
    """What recover() uses of capture.server.SGLangServer: its process, its URL and stop()."""

    def __init__(self, seconds: float, url: str):
        self.proc = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])
        self.url = url

    def stop(self):
        self.proc.kill()
        self.proc.wait()


def feeder(first: Server, dying_s: float = 30.0) -> SGLangFeeder:
    started = []

    def start_server():
        started.append(Server(60, first.url))
        return started[-1]
    f = SGLangFeeder(start_server=start_server)
    f.server, f.dying_s = first, dying_s
    return f


@pytest.fixture
def health_url():
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_a_server_still_exiting_when_its_requests_fail_is_started_again():
    """The GPU fault run (outputs/records/gpu-live-vs-file-3): the SIGKILLed server refused connections while its
    process had not exited yet; the old check (exited?) said no, the stream asked again at once, and one sample's five
    attempts were spent in milliseconds: the run stopped without a restart. Now the feeder waits for the process to
    exit (here 1 s)."""
    dying = Server(1.0, f"http://127.0.0.1:{free_port()}")  # nothing answers there
    f = feeder(dying)
    assert f.recover("ConnectionError: refused") is True
    assert f.restarts == 1 and f.server is not dying and dying.proc.returncode == 0
    f.server.stop()


def test_a_running_server_that_answers_is_left_alone(health_url):
    alive = Server(60, health_url)
    f = feeder(alive)
    assert f.recover("capture failed: a writer error") is False
    assert f.restarts == 0 and f.server is alive and alive.proc.poll() is None
    alive.stop()


def test_a_running_server_that_no_longer_answers_is_started_again():
    hung = Server(60, f"http://127.0.0.1:{free_port()}")
    f = feeder(hung, dying_s=0.5)
    assert f.recover("ReadTimeout") is True
    assert f.restarts == 1 and hung.proc.poll() is not None
    f.server.stop()


def test_servers_started_elsewhere_are_never_restarted():
    f = SGLangFeeder(urls=["http://127.0.0.1:1"])
    assert f.recover("ConnectionError") is False and f.restarts == 0
