"""The capture's shared-memory ring and the writer process that SGLang's scheduler hands its copies to."""
import os
import signal
import threading
import time

import pytest
import torch

from eagle3kit.capture.assemble import select_rows
from eagle3kit.capture.format import read_marker, read_sample
from eagle3kit.capture.hook import CaptureSession, capture_config
from eagle3kit.capture.ring import ALIGN, HostRing, RingTooSmall
from eagle3kit.capture.rid import make_rid
from eagle3kit.capture.writer import Job
from eagle3kit.capture.writer_process import WriterProcess

from test_capture_logic import Mode, fake_batch


def test_ring_allocates_in_order_wraps_and_blocks_when_full():
    ring = HostRing(8 * ALIGN)
    a, b, c = (ring.alloc(2 * ALIGN) for _ in range(3))
    assert (a, b, c) == (0, 2 * ALIGN, 4 * ALIGN) and ring.used == 6 * ALIGN
    ring.release([b])  # out of order: b's space comes back only after a's
    assert ring.used == 4 * ALIGN
    with pytest.raises(RingTooSmall, match="max_inflight_mb"):
        ring.alloc(9 * ALIGN)
    got = []
    t = threading.Thread(target=lambda: got.append(ring.alloc(3 * ALIGN, poll=0.05)))
    t.start()  # 2 free at the end, none at the front: it has to wait
    t.join(0.3)
    assert t.is_alive() and not got
    ring.release([a])  # a and b free: the region wraps to the front
    t.join(2)
    assert got == [0]
    ring.release([c, 0])
    assert ring.used == 0 and ring.alloc(8 * ALIGN) == 0
    v = ring.view(0, (4, 3), torch.bfloat16)
    assert ring.offset_of(v[1]) == 6 and v.shape == (4, 3)
    with pytest.raises(RuntimeError, match="gone"):
        ring.alloc(ALIGN, alive=lambda: False, poll=0.01)
    ring.close()


def test_writer_process_writes_through_a_small_ring_with_back_pressure(tmp_path):
    """40 requests of 2 KB each through a 16 KB ring: the scheduler side waits, every file lands intact."""
    w = WriterProcess(tmp_path, 0, {"layer_ids": [1, 2]}, io_threads=2, max_inflight_bytes=16 * ALIGN * 2)
    g = torch.Generator().manual_seed(0)
    sent = {}
    for i in range(40):
        n = 5 + i % 7
        ids = torch.randint(0, 1000, (n,), generator=g)
        hs = torch.randn(n, 2, 64, generator=g).bfloat16()
        host = w.host_empty(hs.shape, hs.dtype, cuda=False).copy_(hs)
        tok = w.host_empty(ids.shape, ids.dtype, cuda=False).copy_(ids)
        sel = select_rows([make_rid(f"k{i}", n)], [n], [0])
        w.submit(Job(sel, {"hidden_states": host, "token_ids": tok}))
        sent[f"k{i}"] = (ids, hs)
    st = w.flush()
    assert st["counts"]["written"] == 40 and st["counts"]["backpressure_waits"] >= 1
    assert st["counts"]["backpressure_us"] > 0
    assert st["counts"]["io_busy_us"] > 0 and st["counts"]["io_write_us"] > 0  # the writer process's stage times
    for k, (ids, hs) in sent.items():
        t, _ = read_sample(tmp_path / f"{k}.rank0.safetensors")
        assert torch.equal(t["token_ids"], ids) and torch.equal(t["hidden_states"], hs)
    time.sleep(0.2)
    assert w.ring.used == 0
    w.close()
    assert w.proc.returncode == 0


def test_a_dead_writer_process_stops_captures_not_the_server(tmp_path):
    cfg = capture_config(tmp_path, [2], 4)
    session = CaptureSession(cfg, extend_mode=Mode.EXTEND)
    os.kill(session.writer.proc.pid, signal.SIGKILL)
    session.writer.proc.wait(10)
    deadline = time.time() + 10
    while not session.writer._dead and time.time() < deadline:
        time.sleep(0.05)
    fb = fake_batch(Mode.EXTEND, [make_rid("x", 3)], [3], [0], torch.arange(3))
    states = [torch.randn(3, 8) for _ in range(5)]
    from eagle3kit.capture import hook

    for j in sorted(session.layer_slots):  # what SGLang calls: the guarded hooks
        hook._guarded(session, f"layer {j}", session.on_layer, j, (None, states[j + 1], fb, None), (states[j + 1], None))
    hook._guarded(session, "end", session.on_end, (torch.arange(3), states[4], None, fb))
    st = session.writer.status()
    assert st["counts"]["writer_process_exits"] == 1 and "exit code -9" in st["last_error"]
    # the request is not captured: its marker says so at once (the client fails it now, not after its timeout)
    m = read_marker(tmp_path, "x")
    assert session.writer.counts["errors"] >= 1 and m["status"] == "error" and "capture hook error" in m["reason"]
    assert not (tmp_path / "x.rank0.safetensors").exists()


def test_two_data_parallel_writers_share_a_folder_and_its_journal(tmp_path):
    """SGLang --dp 2: two schedulers, both TP rank 0, write into one folder. Files are keyed by request, the journal
    gets whole lines from both, and each worker keeps its own status file."""
    from eagle3kit.capture.format import JournalTail, read_statuses
    from eagle3kit.capture.hook import dp_rank

    assert dp_rank("sglang::scheduler_DP1_TP0") == 1 and dp_rank("sglang::scheduler_DP0") == 0
    assert dp_rank("sglang::scheduler_TP1") is None and dp_rank("sglang::scheduler_MOE_DP1_TP0") is None
    tail = JournalTail(tmp_path)
    writers = [WriterProcess(tmp_path, 0, {"layer_ids": [1]}, io_threads=3, dp_rank=d) for d in (0, 1)]
    for i in range(60):
        w, n = writers[i % 2], 3 + i % 5
        hs = w.host_empty((n, 1, 16), torch.bfloat16, cuda=False).fill_(i)
        ids = w.host_empty((n,), torch.int64, cuda=False).fill_(i)
        w.submit(Job(select_rows([make_rid(f"k{i}", n)], [n], [0]), {"hidden_states": hs, "token_ids": ids}))
    for w in writers:
        w.flush()
    lines = tail.read()
    assert sorted(m["key"] for m in lines) == sorted(f"k{i}" for i in range(60))
    assert all(m["status"] == "ok" for m in lines)
    st = read_statuses(tmp_path)
    assert set(st) == {"dp0.rank0", "dp1.rank0"}
    assert [st[f"dp{d}.rank0"]["counts"]["written"] for d in (0, 1)] == [30, 30]
    for w in writers:
        w.close()
