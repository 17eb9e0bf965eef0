"""Pure capture logic on real captures: rid handling, splitting packed prefills, chunk reassembly, the hook's
session (driven with the ForwardBatch fields SGLang hands it), the file format."""
import json
import math
import time
from enum import Enum
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load, load_file

from eagle3kit.capture.assemble import Piece, Reassembler, gather_index, select_rows
from eagle3kit.capture.format import FORMAT, decode, encode, read_marker, read_sample, write_sample
from eagle3kit.capture.hook import CaptureSession, capture_config, forward_hooks, slot_layers
from eagle3kit.capture.rid import RidError, make_rid, parse_rid


class Mode(Enum):  # stands in for sglang's ForwardMode inside these unit tests
    EXTEND = 1
    DECODE = 2
    MIXED = 3


def test_rid_round_trip_and_foreign_rids():
    rid = make_rid("s0000042", 317)
    assert rid == "e3k-s0000042.317" and parse_rid(rid) == ("s0000042", 317)
    assert parse_rid("HEALTH_CHECK_abc") is None and parse_rid("c6852e0be16a47e0800732af3852e062") is None
    for bad in ("e3k-nolength", "e3k-.5", "e3k-k.0"):
        with pytest.raises(RidError):
            parse_rid(bad)
    with pytest.raises(RidError, match="letters, digits"):
        make_rid("bad/key", 3)


def real_spike_rows(spike_dumps):
    """Real SGLang captures (tiny Llama, hidden 256): per request the layer-2 residual stream."""
    out = {}
    for name in ("s0", "s1", "s2"):
        d = load_file(str(spike_dumps / f"{name}.rank0.pf0.safetensors"))
        out[name] = d["layer_2"]
    return out


def test_select_rows_splits_a_packed_prefill_with_warmup_and_health_check(spike_dumps):
    rows = real_spike_rows(spike_dumps)
    warm = load_file(str(spike_dumps / "c6852e0be16a47e0800732af3852e062.rank0.pf0.safetensors"))["layer_2"]
    health = load_file(str(spike_dumps / "HEALTH_CHECK_a657848efef24761a6ae3c26a915eefd.rank0.pf0.safetensors"))["layer_2"]
    order = [("warm", warm), ("s0", rows["s0"]), ("health", health), ("s1", rows["s1"]), ("s2", rows["s2"])]
    packed = torch.cat([t for _, t in order])
    rids = ["c6852e0be16a47e0800732af3852e062", make_rid("s0", len(rows["s0"])), "HEALTH_CHECK_a6578",
            make_rid("s1", len(rows["s1"])), make_rid("s2", len(rows["s2"]))]
    sel = select_rows(rids, [len(t) for _, t in order], [0] * 5)
    assert [s.key for s in sel.spans] == ["s0", "s1", "s2"]
    assert sel.ignored == {"other": 1, "health_check": 1}
    idx = gather_index(sel, len(packed))
    picked = packed.index_select(0, idx)
    start = 0
    for s in sel.spans:
        n = s.stop - s.start
        assert torch.equal(picked[start:start + n], rows[s.key])
        start += n
    only_ours = select_rows(rids[1:2], [len(rows["s0"])], [0])
    assert gather_index(only_ours, len(rows["s0"])) is None  # whole batch is ours: no gather on the hot path


def piece(key, n, offset, rows, start=None):
    from eagle3kit.capture.assemble import RowSpan

    span = RowSpan(make_rid(key, n), key, n, offset, 0, len(rows))
    return Piece(span, {"hidden_states": rows, "token_ids": torch.arange(offset, offset + len(rows))})


def test_reassembler_joins_chunks_and_rejects_prefix_hits_gaps_and_overruns(spike_dumps):
    x = real_spike_rows(spike_dumps)["s0"]
    n = len(x)
    r = Reassembler()
    assert n > 16
    assert r.add(piece("a", n, 0, x[:8])) == []
    assert r.add(piece("a", n, 8, x[8:16])) == []
    (done,) = r.add(piece("a", n, 16, x[16:]))
    assert done.status == "ok" and done.chunks == 3 and torch.equal(done.tensors["hidden_states"], x)
    assert done.tensors["token_ids"].tolist() == list(range(n))
    (hit,) = r.add(piece("b", n, 7, x[7:]))
    assert hit.status == "incomplete" and "prefix-cache hit" in hit.reason
    r.add(piece("c", n, 0, x[:10]))
    (gap,) = r.add(piece("c", n, 12, x[12:]))
    assert gap.status == "incomplete" and "does not continue" in gap.reason
    (over,) = r.add(piece("d", 5, 0, x[:9]))
    assert over.status == "incomplete" and "announced 5" in over.reason
    small = Reassembler(max_pending=1)
    small.add(piece("e", n, 0, x[:3]))
    (evicted,) = small.add(piece("f", n, 0, x[:3]))
    assert evicted.key == "e" and "evicted" in evicted.reason


def fake_batch(mode, rids, lens, prefix, input_ids):
    return SimpleNamespace(forward_mode=mode, rids=rids, extend_seq_lens_cpu=lens, extend_prefix_lens_cpu=prefix,
                           input_ids=input_ids)


def run_forward(session, fb, states, token_ids, normed):
    """Feed a session the way SGLang's hooks do: layer j returns (hidden, residual) whose sum is states[j + 1]."""
    for j in sorted(session.layer_slots):
        total = states[j + 1]
        residual = torch.full_like(total, 0.25)
        session.on_layer(j, (None, total - residual, fb, residual), (total - residual, residual))
    session.on_end((token_ids, normed, None, fb))


@pytest.mark.parametrize("storage,wrapped", [("bf16", False), ("fp8", False), ("bf16", True)])
def test_session_captures_batched_and_chunked_requests_like_the_reference(tmp_path, reference, tokenizer, storage,
                                                                          wrapped):
    """Real reference states packed as SGLang packs them; the written files must equal the reference. With fp8
    storage the hook encodes each forward's block where it lives (the GPU on a server): the file holds exactly the
    encoding of the reference's rows, chunks included (one scale per token and slot). ``wrapped``: the logits
    processor is handed no input_ids (Kimi-K2.5's multimodal wrapper embeds the tokens itself: seen on the GPU);
    the token ids come from the batch."""
    from eagle3kit.capture import format as fmt

    L = reference.info.num_layers
    prompts = {"a": tokenizer("The target verifies drafted tokens in one pass.").input_ids,
               "b": tokenizer("Chunked prefill splits a long prompt into several forwards, each with a prefix.").input_ids}
    per = {}
    for k, ids in prompts.items():
        with torch.no_grad():
            out = reference.model(torch.tensor([ids]), output_hidden_states=True)
        per[k] = [h[0] for h in out.hidden_states[:L]] + [reference._pre_norm[0]]
    cfg = capture_config(tmp_path, [2, 15, 27], L, final_normed=True, storage=storage)
    session = CaptureSession(cfg, extend_mode=Mode.EXTEND)
    warm = torch.randn(4, reference.info.hidden_size)
    cut = 5  # request b arrives in two chunks: 5 tokens now, the rest in the next forward
    rids = ["warmup-uuid", make_rid("a", len(prompts["a"])), make_rid("b", len(prompts["b"]))]
    states = [torch.cat([warm, per["a"][k], per["b"][k][:cut]]) for k in range(L + 1)]
    ids = torch.tensor([0] * 4 + prompts["a"] + prompts["b"][:cut])
    fb = fake_batch(Mode.EXTEND, rids, [4, len(prompts["a"]), cut], [0, 0, 0], ids)
    run_forward(session, fb, states, None if wrapped else ids, states[L])
    decode = fake_batch(Mode.DECODE, rids[1:], None, None, torch.tensor([1, 2]))
    run_forward(session, decode, [torch.randn(2, 576)] * (L + 1), torch.tensor([1, 2]), torch.randn(2, 576))
    rest = len(prompts["b"]) - cut
    states2 = [per["b"][k][cut:] for k in range(L + 1)]
    ids2 = torch.tensor(prompts["b"][cut:])
    run_forward(session, fake_batch(Mode.EXTEND, rids[2:], [rest], [cut], ids2), states2, None if wrapped else ids2,
                states2[L])
    status = session.writer.flush()
    assert status["counts"]["written"] == 2 and status["counts"]["chunked"] == 1
    assert status["counts"]["forwards_decode"] == 1 and status["ignored_rows_by_kind"] == {"other": 1}
    if storage == "fp8":  # on the CPU the packed buffer is composed by torch (on a GPU: fp8_packed's kernel)
        assert status["counts"]["fp8_torch_forwards"] == 2 and "fp8_fused_forwards" not in status["counts"]
    deadline = time.time() + 10  # every region given back, the packed buffer's too (its views released as one)
    while session.writer.ring.used and time.time() < deadline:
        time.sleep(0.05)
    assert session.writer.ring.used == 0
    for k, ids in prompts.items():
        t, meta = read_sample(tmp_path / f"{k}.rank0.safetensors")
        assert t["token_ids"].tolist() == ids and meta["layer_ids"] == slot_layers(cfg) == [2, 15, 27, L]
        if storage == "fp8":
            want = fmt.decode(fmt.encode({"hidden_states": torch.stack([per[k][x] for x in meta["layer_ids"]], 1),
                                          "token_ids": torch.tensor(ids)}, "fp8"))["hidden_states"]
            assert torch.equal(t["hidden_states"], want), k
        for j, layer in enumerate(meta["layer_ids"]):
            ref = per[k][layer].to(torch.bfloat16)
            tol = 1e-2 if storage == "bf16" else 0.07  # e4m3: 3 mantissa bits
            assert torch.allclose(t["hidden_states"][:, j].float(), ref.float(), rtol=tol, atol=tol * ref.float(
            ).abs().max().item()), (k, layer)
        # what the logits processor was handed for these rows (run_forward passes the final state as "normed")
        assert torch.equal(t["final_normed"], per[k][L].to(torch.bfloat16))
    assert read_marker(tmp_path, "b")["chunks"] == 2
    assert json.loads((tmp_path / "_status.rank0.json").read_text())["counts"]["written"] == 2


def test_hook_errors_are_counted_not_raised(tmp_path):
    from eagle3kit.capture import hook

    cfg = capture_config(tmp_path, [2], 4)
    session = CaptureSession(cfg, extend_mode=Mode.EXTEND)
    fb = fake_batch(Mode.EXTEND, [make_rid("x", 3)], [3], [0], torch.arange(3))
    hook._guarded(session, "layer 1", session.on_layer, 1, (None, "not a tensor", fb, None), ("oops", None))
    hook._guarded(session, "end", session.on_end, (torch.arange(3), torch.zeros(3, 8), None, fb))  # layers missing
    st = session.writer.flush()
    assert st["counts"]["errors"] == 2 and "did not fire" in st["last_error"]
    bad = fake_batch(Mode.EXTEND, ["e3k-malformed"], [3], [0], torch.arange(3))
    hook._guarded(session, "layer 1", session.on_layer, 1, (None, torch.zeros(3, 8), bad, None),
                  (torch.zeros(3, 8), None))
    assert session.writer.counts["bad_rids"] == 1
    # a forward that fails after a layer was copied gives its host buffer back (no leak in the ring)
    hook._guarded(session, "layer 1", session.on_layer, 1, (None, torch.zeros(3, 8), fb, None),
                  (torch.zeros(3, 8), None))
    assert session.writer.ring.used > 0 and session.writer.counts["hook_us"] > 0  # time in the hooks, reported
    hook._guarded(session, "end", session.on_end, (torch.arange(3), torch.zeros(3, 8), None, fb))  # layer 3 missing
    assert session.writer.ring.used == 0 and session.writer.counts["errors"] == 3
    # the failed forward's request gets an error marker at once: its client fails it now instead of waiting out its
    # timeout, and a rerun (or extract's retry pass) captures it again
    m = read_marker(tmp_path, "x")
    assert m["status"] == "error" and "capture hook error in end" in m["reason"] and "did not fire" in m["reason"]


def test_an_injected_fault_fails_its_forward_once_and_names_its_requests(tmp_path):
    """fail_keys_once (the GPU fault test's injection): the first forward holding the key raises inside the hook as a
    bug would; every request of that forward gets an error marker naming the fault, the next capture of the key is
    written, and a config without it carries no such key."""
    from eagle3kit.capture import hook

    assert "fail_keys_once" not in capture_config(tmp_path, [2], 4)
    cfg = capture_config(tmp_path, [2], 4, fail_keys_once=["x"])
    session = CaptureSession(cfg, extend_mode=Mode.EXTEND)

    def forward(keys):
        fb = fake_batch(Mode.EXTEND, [make_rid(k, 3) for k in keys], [3] * len(keys), [0] * len(keys),
                        torch.arange(3 * len(keys)))
        h = torch.randn(3 * len(keys), 8)
        for layer in (1, 3):
            hook._guarded(session, f"layer {layer}", session.on_layer, layer, (None, h, fb, None), (h, None))
        hook._guarded(session, "end", session.on_end, (torch.arange(3 * len(keys)), h, None, fb))
    forward(["x", "y"])
    st = session.writer.flush()
    assert st["counts"]["errors"] == 1 and "injected fault" in st["last_error"]
    for k in ("x", "y"):  # both requests of the failed forward are failed at once, with the reason
        m = read_marker(tmp_path, k)
        assert m["status"] == "error" and "injected fault for ['x']" in m["reason"]
    forward(["x"])  # once per key: the retry is captured
    session.writer.flush()
    assert read_marker(tmp_path, "x")["status"] == "ok" and session.writer.ring.used == 0


def test_forward_hooks_json_targets_exact_decoder_layers(tmp_path):
    cfg = capture_config(tmp_path, [2, 15, 27], 30, final_normed=True)
    specs = forward_hooks(cfg)
    assert [s["target_modules"] for s in specs] == [["model.layers.1"], ["model.layers.14"], ["model.layers.26"],
                                                    ["model.layers.29"], ["logits_processor"]]
    assert all(s["hook_factory"].startswith("eagle3kit.capture.hook:") for s in specs)
    # a wrapper (Kimi-K2.5) keeps layers and logits processor under its language model; SGLang matches names exactly
    wrapped = forward_hooks(cfg, "language_model.model.layers.{}")
    assert [s["target_modules"] for s in wrapped][-2:] == [["language_model.model.layers.29"],
                                                          ["language_model.logits_processor"]]
    with pytest.raises(ValueError, match="out of range"):
        capture_config(tmp_path, [0, 30], 30)


@pytest.mark.parametrize("storage", ["bf16", "fp8", "fp32"])
def test_format_round_trip_each_storage(tmp_path, spike_dumps, storage):
    d = load_file(str(spike_dumps / "s0.rank0.pf0.safetensors"))
    hs = torch.stack([d["layer_0"], d["layer_2"], d["layer_4"], d["final"]], dim=1)
    tensors = {"hidden_states": hs, "token_ids": torch.arange(hs.shape[0])}
    marker = write_sample(tmp_path, "k", 0, tensors, {"engine": "test", "layer_ids": [1, 3, 5, 6]}, storage)
    back, meta = read_sample(tmp_path / marker["file"])
    assert back["hidden_states"].dtype == (torch.float32 if storage == "fp32" else torch.bfloat16)
    err = ((back["hidden_states"].float() - hs.float()).norm() / hs.float().norm()).item()
    assert err < {"bf16": 1e-6, "fp32": 1e-6, "fp8": 0.05}[storage]
    assert meta["layer_ids"] == [1, 3, 5, 6] and meta["storage"] == storage
    assert not list(tmp_path.glob(".*tmp"))  # atomic writes leave no temporary files
    assert marker["n_states"] == 4
    if storage == "fp8":  # the aux slots in e4m3, the final slot (the teacher's input) in bf16, bit for bit
        assert set(encode(tensors, "fp8")) == {"hidden_states_fp8", "hidden_states_scale", "hidden_states_final",
                                               "token_ids"}
        assert torch.equal(back["hidden_states"][:, -1], hs[:, -1].to(torch.bfloat16))
        assert 0 < ((back["hidden_states"][:, :-1].float() - hs[:, :-1].float()).norm() / hs[:, :-1].norm()) < 0.05
        # a file of the first fp8 layout (every slot in e4m3) still reads
        from eagle3kit.capture.format import fp8_encode

        q, scale = fp8_encode(hs)
        old = decode({"hidden_states_fp8": q, "hidden_states_scale": scale, "token_ids": tensors["token_ids"]})
        assert old["hidden_states"].shape == hs.shape
    with pytest.raises(ValueError, match="not an eagle3kit capture"):
        decode({"x": torch.zeros(1)})


def test_streamed_safetensors_is_what_safetensors_reads_and_hashes(tmp_path):
    """The writer's own safetensors writer (buffers straight to the file): safetensors' readers load every dtype
    exactly, each tensor is aligned, and the returned size and checksum (either algorithm) are the file's on disk."""
    import hashlib
    import json
    import struct

    from safetensors import safe_open
    from safetensors.torch import save

    from eagle3kit.capture.format import write_safetensors

    g = torch.Generator().manual_seed(0)
    tensors = {"token_ids": torch.arange(7), "hidden_states": torch.randn(7, 3, 5, generator=g).bfloat16(),
               "scale": torch.rand(7, 3, generator=g), "q": torch.randn(7, 3, 5, generator=g).to(torch.float8_e4m3fn),
               "empty": torch.zeros(0, 5)}
    path = tmp_path / "x.safetensors"
    n, digest = write_safetensors(path, tensors, {"layer_ids": [1, 2], "engine": "t"})
    raw = path.read_bytes()
    import xxhash
    assert n == len(raw) and digest == "xxh3_128:" + xxhash.xxh3_128(raw).hexdigest()
    n2, digest2 = write_safetensors(tmp_path / "y.safetensors", tensors, {"layer_ids": [1, 2], "engine": "t"},
                                    checksum="sha256")
    assert n2 == n and digest2 == "sha256:" + hashlib.sha256(raw).hexdigest()  # same bytes, the other algorithm
    with safe_open(str(path), "pt") as f:
        assert f.metadata()["layer_ids"] == "[1, 2]" and f.metadata()["format"] == FORMAT
        for k, t in tensors.items():
            got = f.get_tensor(k)
            assert got.dtype == t.dtype and got.shape == t.shape
            assert torch.equal(got.view(torch.uint8), t.view(torch.uint8))
    header_len = struct.unpack("<Q", raw[:8])[0]
    assert (8 + header_len) % 8 == 0
    header = json.loads(raw[8:8 + header_len])
    for k, t in tensors.items():
        assert header[k]["data_offsets"][0] % t.element_size() == 0
    # the same tensors through safetensors' own writer read back identically
    ref = load(save(tensors))
    with safe_open(str(path), "pt") as f:
        assert all(torch.equal(ref[k].view(torch.uint8), f.get_tensor(k).view(torch.uint8)) for k in tensors)
    with pytest.raises(ValueError, match="complex64"):
        write_safetensors(tmp_path / "bad.safetensors", {"z": torch.zeros(2, dtype=torch.complex64)}, {})
    assert not (tmp_path / "bad.safetensors").exists()


def test_writer_releases_a_job_only_once_its_files_are_written(tmp_path):
    """The job's memory (its region of the capture ring) is given back after the last file exists, not before;
    a middle chunk waiting for the rest of its request keeps no view of the job's memory."""
    import threading

    from eagle3kit.capture.assemble import select_rows
    from eagle3kit.capture.writer import CaptureWriter, Job

    released = []
    w = CaptureWriter(tmp_path, 0, {"layer_ids": [1, 2]}, io_threads=1,
                      on_release=lambda job: released.append((job.tag, sorted(p.name for p in tmp_path.glob("k*")))))
    slow = threading.Event()
    original = w._write
    w._write = lambda *a: (slow.wait(5), original(*a))
    # job 0: request k0 whole plus the first 2 of 4 tokens of request k1; job 1: the rest of k1
    sel0 = select_rows([make_rid("k0", 4), make_rid("k1", 4)], [4, 2], [0, 0])
    memory = torch.randn(6, 2, 8)
    w.submit(Job(sel0, {"hidden_states": memory, "token_ids": torch.arange(6)}, tag=0))
    time.sleep(0.3)
    assert released == []  # k0 is not written yet
    slow.set()
    w.flush()
    assert released[0][0] == 0 and "k0.rank0.safetensors" in released[0][1]
    expected_k1 = memory[4:6].clone()
    memory.zero_()  # the ring region is reused once released: the pending chunk must not see this
    sel1 = select_rows([make_rid("k1", 4)], [2], [2])
    rest = torch.randn(2, 2, 8)
    w.submit(Job(sel1, {"hidden_states": rest, "token_ids": torch.arange(2)}, tag=1))
    st = w.flush()
    assert [tag for tag, _ in released] == [0, 1] and st["counts"]["written"] == 2
    t, _ = read_sample(tmp_path / "k1.rank0.safetensors")
    assert torch.equal(t["hidden_states"].float(), torch.cat([expected_k1, rest]).bfloat16().float())


def test_the_writer_says_where_its_file_threads_time_went(tmp_path, monkeypatch):
    """The status counts each file thread's busy time and its stages (hashing, writing, starting the writeback,
    encoding, the marker; the reassembly loop apart): the stages add up to no more than the busy time, and a slow
    checksum shows up as hashing, not as writing (what tells the capture benchmark which stage binds a pass)."""
    import time as _time

    from eagle3kit import checksum
    from eagle3kit.capture.assemble import select_rows
    from eagle3kit.capture.writer import CaptureWriter, Job

    stages = ("io_hash_us", "io_write_us", "io_writeback_us", "io_encode_us", "io_marker_us")

    def run(folder):
        w = CaptureWriter(folder, 0, {"layer_ids": [1, 2]}, io_threads=1)
        for i in range(4):
            sel = select_rows([make_rid(f"k{i}", 256)], [256], [0])
            w.submit(Job(sel, {"hidden_states": torch.randn(256, 3, 576).bfloat16(), "token_ids": torch.arange(256)}))
        st = w.flush()
        w.close()
        return st["counts"]

    c = run(tmp_path / "a")
    assert c["written"] == 4 and c["io_busy_us"] > 0 and c["io_write_us"] > 0 and "reassembly_us" in c
    assert sum(c.get(k, 0) for k in stages) <= c["io_busy_us"]

    real = checksum.new

    class Slow:  # a checksum that takes 20 ms a buffer
        def __init__(self, algorithm=checksum.DEFAULT):
            self.h = real(algorithm)

        def update(self, b):
            _time.sleep(0.02)
            self.h.update(b)

        def hexdigest(self):
            return self.h.hexdigest()

    monkeypatch.setattr(checksum, "new", Slow)
    s = run(tmp_path / "b")
    assert s["io_hash_us"] >= 4 * 2 * 20_000  # 4 files, 2 tensor buffers each (the header is hashed before the clock)
    assert s["io_hash_us"] > s["io_write_us"] and s["io_hash_us"] > 0.5 * s["io_busy_us"]
    assert s["io_write_us"] < 4 * 2 * 20_000  # the sleep was not counted as writing


def test_stage_shares_are_taken_between_two_snapshots_of_the_counts():
    """capture.writer.stage_shares: the file threads' busy share is over all of them, each stage's share is of that
    busy time, the loop's and the waits' are of the wall time; only what happened between the snapshots counts."""
    from eagle3kit.capture.writer import stage_shares

    before = {"io_busy_us": 5_000_000, "io_hash_us": 1_000_000, "backpressure_us": 7_000_000}
    after = {"io_busy_us": 13_000_000, "io_hash_us": 3_000_000, "io_write_us": 6_000_000, "reassembly_us": 500_000,
             "backpressure_us": 8_000_000}
    s = stage_shares(before, after, seconds=2.0, io_threads=4)
    assert s["io_busy"] == pytest.approx(1.0)  # 8 s busy over 4 threads x 2 s: they bind
    assert s["io_hash"] == pytest.approx(0.25) and s["io_write"] == pytest.approx(0.75) and s["io_writeback"] == 0
    assert s["reassembly"] == pytest.approx(0.25) and s["backpressure"] == pytest.approx(0.5)
    assert s["d2h_wait"] == 0
    assert stage_shares({}, {}, 1.0, 4)["io_busy"] == 0 and math.isnan(stage_shares({}, {}, 1.0, 4)["io_hash"])


def test_capture_layout_under_dp_attention():
    """Plain TP: TP ranks (rank 0 writes). DP attention with one GPU per group (tp8 dp8): every GPU is attention-TP
    rank 0 of its own group and writes its group's requests, status per group. More GPUs per group, or two-batch
    overlap: refused with the fix (their layer outputs or hooks do not hold every row)."""
    from eagle3kit.capture.hook import capture_layout

    assert capture_layout(3, 8, None, None) == (3, 8, None, None)
    assert capture_layout(5, 8, None, {"tp_rank": 0, "tp_size": 1, "dp_rank": 5, "cp_rank": 0}) == (0, 1, 5, None)
    rank, size, dp, refused = capture_layout(5, 8, None, {"tp_rank": 1, "tp_size": 4, "dp_rank": 1, "cp_rank": 0})
    assert (rank, size, dp) == (1, 4, 1) and "Fix: --dp equal to --tp" in refused
    refused = capture_layout(2, 8, None, {"tp_rank": 0, "tp_size": 1, "dp_rank": 2}, {"two_batch_overlap": True})[3]
    assert "two-batch-overlap" in refused
    assert capture_layout(2, 8, None, {"tp_rank": 0, "tp_size": 1, "dp_rank": 2, "cp_rank": 1})[0] != 0


def test_capture_layout_refuses_split_layer_outputs_and_allows_expert_parallelism():
    """An all-to-all MoE backend splits MoE layers' outputs across a group's GPUs (plain TP, or DP attention with
    more than one GPU per group): refused, naming the flag and the fix. One GPU per group (dp = tp) keeps whole rows;
    --ep-size alone (backend none) too. Two-batch overlap is refused under plain TP as well."""
    from eagle3kit.capture.hook import capture_layout

    rank, size, dp, refused = capture_layout(1, 2, None, None, {"a2a": "deepep"})
    assert (rank, size) == (1, 2) and "--moe-a2a-backend deepep" in refused and "Fix:" in refused
    assert capture_layout(0, 2, None, None, {"a2a": "none", "two_batch_overlap": False}) == (0, 2, None, None)
    assert capture_layout(0, 1, None, None, {"a2a": "deepep"})[3] is None  # one GPU: nothing split
    one_per_group = {"tp_rank": 0, "tp_size": 1, "dp_rank": 1, "cp_rank": 0}
    assert capture_layout(1, 2, None, one_per_group, {"a2a": "deepep"}) == (0, 1, 1, None)
    refused = capture_layout(1, 4, None, {"tp_rank": 1, "tp_size": 2, "dp_rank": 0, "cp_rank": 0}, {"a2a": "deepep"})[3]
    assert "2 GPUs per group" in refused
    assert "two-batch-overlap" in capture_layout(0, 2, None, None, {"two_batch_overlap": True})[3]
    assert "two-batch-overlap" in capture_layout(0, 2, None, one_per_group, {"two_batch_overlap": True})[3]


def test_a_refused_session_says_why_and_a_dressed_up_batch_is_not_captured(tmp_path):
    """A session refused at setup (DP attention with several GPUs per group, say) is inactive and its reason is in
    the status the client and the probe read. A DECODE/IDLE batch SGLang dressed as EXTEND
    (``_original_forward_mode`` set) is skipped; the same batch without it is captured."""
    from eagle3kit.capture import hook

    cfg = capture_config(tmp_path, [2], 4)
    session = CaptureSession(cfg, extend_mode=Mode.EXTEND)
    states = [torch.randn(3, 8) for _ in range(5)]

    def forward(fb):
        for j in sorted(session.layer_slots):
            hook._guarded(session, f"layer {j}", session.on_layer, j, (None, states[j + 1], fb, None),
                          (states[j + 1], None))
        hook._guarded(session, "end", session.on_end, (torch.arange(3), states[4], None, fb))
    dressed = fake_batch(Mode.EXTEND, [make_rid("d", 3)], [3], [0], torch.arange(3))
    dressed._original_forward_mode = Mode.DECODE
    forward(dressed)
    forward(fake_batch(Mode.EXTEND, [make_rid("x", 3)], [3], [0], torch.arange(3)))
    session.writer.flush()
    assert read_marker(tmp_path, "d") is None and read_marker(tmp_path, "x")["status"] == "ok"
    session.refuse("capture under --enable-dp-attention needs dp = tp")
    assert not session.active and "needs dp = tp" in session.writer.flush()["last_error"]  # the status file
