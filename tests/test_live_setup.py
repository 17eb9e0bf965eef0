"""open_live with a capture server started here: the server starts while the conversations render, and it stops when
the setup fails after its start. A stand-in replaces SGLang's process (``capture.server.capture_server``): these tests
check the order and the cleanup of the setup; the captures themselves are the GPU runs' and test_live.py's."""
import threading
import time
import uuid
from pathlib import Path

import pytest

import eagle3kit.extract as E
import eagle3kit.live.session as S
from eagle3kit.drafter.train_config import TrainConfig
from eagle3kit.drafter.training_setup import Dist
from eagle3kit.live.config import LiveError


@pytest.fixture
def setup_run(tmp_path, monkeypatch, target_path):
    """(events, config for data): what the stand-in server and the rendering did, in order."""
    import eagle3kit.capture.server as C

    events, started = [], threading.Event()

    class Server:
        url = "http://127.0.0.1:9"

        def start(self):
            events.append("server start")
            started.set()
            time.sleep(0.2)  # SGLang's start takes tens of seconds; the rendering goes on meanwhile
            return self

        def wait_healthy(self):
            events.append("server healthy")
            return self

        def stop(self):
            events.append("server stop")

    real_load = E.load_samples

    def load_samples(*a, **kw):
        events.append("render start")
        started.wait(5)  # the server's start is under way before the rendering ends (without it: 5 s, then on)
        try:
            return real_load(*a, **kw)
        finally:
            events.append("render end")

    monkeypatch.setattr(C, "capture_server", lambda *a, **kw: Server())
    monkeypatch.setattr(E, "load_samples", load_samples)
    stream = Path("/dev/shm") / f"e3k-test-setup-{uuid.uuid4().hex[:8]}"

    def cfg(data="embedded:sharegpt", samples=12):
        return TrainConfig(data=data, target=str(target_path), out_dir=str(tmp_path / "run"), epochs=1,
                           live={"engine": "sglang", "max_samples": samples, "max_tokens": 256,
                                 "stream_dir": str(stream)})
    yield events, cfg
    import shutil

    shutil.rmtree(stream, ignore_errors=True)


def test_the_capture_server_starts_while_the_conversations_render(setup_run, monkeypatch, capsys):
    """The server's start (weights, kernels: tens of seconds on a GPU) overlaps the rendering (minutes for tens of
    thousands of conversations), and the setup's parts are timed in the summary and said on one line."""
    events, cfg = setup_run
    monkeypatch.setattr(S, "_capture_once", lambda live, samples, info, key: [])  # no SGLang to capture here
    src, held, val, extras = S.open_live(cfg(), Dist(0, 1, 0), Path(cfg().out_dir))
    assert events.index("server start") < events.index("render end"), events
    for k in ("live_setup_render_seconds", "live_setup_server_wait_seconds", "live_setup_capture_seconds"):
        assert extras[k] >= 0, extras
    assert "conversations rendered in" in capsys.readouterr().out
    src.close()
    assert events[-1] == "server stop"


@pytest.mark.parametrize("where", ["rendering", "held-out check"])
def test_a_setup_that_fails_after_the_servers_start_stops_it(setup_run, monkeypatch, tmp_path, where):
    """A failure after the server was started here (a data file with no conversation; a held-out capture that fails
    its check) stops that server: it would otherwise outlive the call, holding its GPU memory and port."""
    events, cfg = setup_run
    if where == "rendering":
        empty = tmp_path / "empty.jsonl"
        empty.write_text("")
        config = cfg(str(empty))
    else:
        config = cfg()

        def refuse(live, samples, info, key):
            raise LiveError("sample 3 (h0000003): its capture fails the check (token ids differ)")
        monkeypatch.setattr(S, "_capture_once", refuse)
    with pytest.raises(Exception) as e:
        S.open_live(config, Dist(0, 1, 0), Path(config.out_dir))
    assert ("empty" in str(e.value)) if where == "rendering" else ("fails the check" in str(e.value)), e.value
    assert "server start" in events and events[-1] == "server stop", events


def test_the_conversations_are_kept_compactly_as_they_render(setup_run, monkeypatch):
    """A rendered sample holds its tokens as Python lists (~44 bytes a token: tens of GB a rank at 600 K
    conversations); open_live keeps each as a LiveSample (5 bytes a token) as soon as it is rendered, so at most one
    training sample is held as lists at a time (the held-out ones are kept as they are). Taking the whole list first,
    as before, held all 27."""
    import weakref

    events, cfg = setup_run
    monkeypatch.setattr(S, "_capture_once", lambda live, samples, info, key: [])
    alive, most, seen = [0], [0], [0]
    real_load = E.load_samples  # the fixture's stand-in, which calls the real one

    def gone():
        alive[0] -= 1

    def load_samples(*a, **kw):
        samples, report = real_load(*a, **kw)

        def tracked():
            for s in samples:
                alive[0] += 1
                seen[0] += 1
                most[0] = max(most[0], alive[0])
                weakref.finalize(s, gone)
                yield s
        return (tracked() if kw.get("lazy") else list(tracked())), report
    monkeypatch.setattr(E, "load_samples", load_samples)
    src, held, val, extras = S.open_live(cfg(samples=40), Dist(0, 1, 0), Path(cfg().out_dir))
    src.close()
    assert seen[0] >= 20, seen  # 27 of the first 40 conversations are samples (the rest skipped)
    assert most[0] <= extras["live_heldout_samples"] + 2, (most, extras["live_heldout_samples"])
