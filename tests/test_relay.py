"""Captures from other hosts (live/relay.py): two capture "hosts" (folders, each with a stand-in capture server that
writes sample files and journal lines as the hook's writer does, and a relay sender) feed one trainer folder through
torch.distributed's gloo transport; the real capture client reads them there."""
import hashlib
import json
import os
import threading

import pytest

from eagle3kit.capture.client import CaptureClient
from eagle3kit.capture.format import journal_path, sample_name, write_marker
from eagle3kit.live.relay import RelayError, RelayReceiver, RelaySender
from tests.test_client import stand_in_server
from tests.training_runs import free_port


def writer_into(folder):
    """The capture writer of a stand-in server: the sample's bytes (seeded by its key), a status file, the marker."""
    def mark(key):
        name = f"{sample_name(key, 0)}.safetensors"
        data = hashlib.sha256(key.encode()).digest() * 4096  # 128 KiB a sample
        (folder / name).write_bytes(data)
        (folder / "_status.rank0.json").write_text(json.dumps({"written": 1, "write_failures": 0}))
        write_marker(folder, key, 0, {"status": "ok", "key": key, "rank": 0, "file": name, "bytes": len(data),
                                      "sha256": hashlib.sha256(data).hexdigest()})
    return mark


def test_two_capture_hosts_feed_one_trainer_folder_through_the_relay(tmp_path):
    trainer = tmp_path / "trainer" / "samples"
    hosts = [tmp_path / "host1", tmp_path / "host2"]
    for h in hosts:
        h.mkdir()
    port = free_port()
    receiver = RelayReceiver(trainer, port, senders=2, host="127.0.0.1", timeout_s=60).start()
    stop = threading.Event()
    sent = [None, None]

    def send(i):
        sent[i] = RelaySender(hosts[i], f"127.0.0.1:{port}", i + 1, 2, timeout_s=60).run(stop, status_every=0.05)

    senders = [threading.Thread(target=send, args=(i,)) for i in range(2)]
    for t in senders:
        t.start()
    servers = [stand_in_server(writer_into(h), 0.02) for h in hosts]
    try:
        client = CaptureClient([f"http://127.0.0.1:{s.server_port}" for s in servers], trainer, timeout=30)
        items = [(f"k{i}", list(range(3 + i))) for i in range(12)]
        markers = client.capture_many(items, concurrency=4)
    finally:
        for s in servers:
            s.shutdown()
        stop.set()
        for t in senders:
            t.join(30)
    counts = receiver.close(wait_s=30)
    assert sorted(m["key"] for m in markers) == sorted(k for k, _ in items)
    assert all(m["status"] == "ok" for m in markers)
    for m in markers:  # every byte arrived: the file the client reads is the one the capture host wrote
        data = (trainer / m["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == m["sha256"] == hashlib.sha256(
            hashlib.sha256(m["key"].encode()).digest() * 4096).hexdigest()
    # the bytes moved: nothing left on the capture hosts but their journals and status files
    assert not [p for h in hosts for p in h.iterdir() if p.suffix == ".safetensors" or p.name.startswith("s")]
    assert counts["relay_samples"] == 12 and counts["relay_bytes"] == 12 * 128 * 1024
    assert sum(s["samples"] for s in sent) == 12 and counts["relay_statuses"] >= 2
    assert (trainer / "_status.rank0.json").exists()
    assert len(journal_path(trainer, 0).read_text().splitlines()) == 12


def test_a_relay_given_a_bad_address_or_index_says_what_to_give(tmp_path):
    with pytest.raises(RelayError, match="host:port"):
        RelaySender(tmp_path, "trainer-only", 1, 1)
    with pytest.raises(RelayError, match="numbered 1 to --of"):
        RelaySender(tmp_path, "127.0.0.1:1234", 0, 2)
    assert not os.listdir(tmp_path)


def test_relay_settings_are_checked(tmp_path, capsys):
    from eagle3kit.cli import main
    from eagle3kit.live.config import LiveConfig, LiveError

    with pytest.raises(LiveError, match="relay_port without urls and stream_dir"):
        LiveConfig.from_dict({"engine": "sglang", "relay_port": 29500})
    with pytest.raises(LiveError, match="at least one sender"):
        LiveConfig.from_dict({"engine": "sglang", "urls": ["http://h:1"], "stream_dir": "/dev/shm/x",
                              "relay_port": 29500, "relay_senders": 0})
    ok = LiveConfig.from_dict({"engine": "sglang", "urls": ["http://h:1"], "stream_dir": "/dev/shm/x",
                               "relay_port": 29500, "relay_senders": 2})
    assert ok.relay_senders == 2
    assert main(["relay", "--capture-dir", str(tmp_path), "--to", "nowhere", "--index", "1", "--of", "1"]) == 1
    assert "--to 'nowhere': give the trainer's host:port" in capsys.readouterr().err


def test_a_capture_whose_file_is_gone_arrives_as_a_failed_capture(tmp_path):
    """The sender cannot send a file that is no longer on the capture host: the training gets the capture as failed
    (its stream asks for it again), never a marker without its file; the one beside it arrives whole."""
    host, trainer = tmp_path / "host", tmp_path / "trainer"
    host.mkdir()
    port = free_port()
    receiver = RelayReceiver(trainer, port, senders=1, host="127.0.0.1", timeout_s=60).start()
    writer_into(host)("kept")
    write_marker(host, "gone", 0, {"status": "ok", "key": "gone", "rank": 0, "file": "gone.rank0.safetensors"})
    stop = threading.Event()
    stop.set()  # what the journal holds now, then goodbye
    RelaySender(host, f"127.0.0.1:{port}", 1, 1, timeout_s=60).run(stop)
    assert receiver.close(wait_s=30)["relay_samples"] == 2
    by_key = {m["key"]: m for m in map(json.loads, journal_path(trainer, 0).read_text().splitlines())}
    assert by_key["gone"]["status"] == "error" and "missing on the capture host" in by_key["gone"]["reason"]
    assert by_key["kept"]["status"] == "ok" and (trainer / by_key["kept"]["file"]).exists()
    assert not (trainer / "gone.rank0.safetensors").exists()
