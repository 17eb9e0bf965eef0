"""Durability (#12, #13): a sample is in the manifest only once its bytes are on disk. The order of the real
syncs is recorded (os.fsync wrapped, every call's file read from /proc/self/fd) during a real extraction."""
import json
import os
from pathlib import Path

import pytest

from eagle3kit.store import MANIFEST, ManifestWriter, read_manifest


def _record_syncs(monkeypatch, manifest: Path) -> list[tuple[str, int]]:
    """(synced path, manifest lines on disk at that moment) for every os.fsync of this process."""
    events, real = [], os.fsync

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        real(fd)
        lines = len(manifest.read_text().splitlines()) if manifest.exists() else 0
        events.append((path, lines))
    monkeypatch.setattr(os, "fsync", fsync)
    return events


def test_manifest_lines_follow_the_sync_of_their_files_in_a_real_extraction(tmp_path, target_path, monkeypatch):
    from eagle3kit.pipeline import run_extraction

    out = tmp_path / "data"
    events = _record_syncs(monkeypatch, out / MANIFEST)
    run_extraction(target=str(target_path), out_dir=out, engine="transformers", max_samples=6, max_tokens=128,
                   heldout_percent=0, progress=False)
    lines = [json.loads(x) for x in (out / MANIFEST).read_text().splitlines()]
    assert len(lines) >= 2
    samples = str((out / "samples").resolve())
    for i, e in enumerate(lines):
        f = str((out / "samples" / e["file"]).resolve())
        file_syncs = [n for p, n in events if p == f]
        dir_syncs = [n for p, n in events if p == samples]
        assert file_syncs and min(file_syncs) <= i, (e["key"], events)  # its bytes synced before its line existed
        assert any(n <= i for n in dir_syncs), events  # and the rename that made it
    assert events[-1][0].endswith(MANIFEST)  # the manifest itself synced last


def test_lines_wait_for_their_group_and_close_writes_the_rest(tmp_path, monkeypatch):
    events = _record_syncs(monkeypatch, tmp_path / MANIFEST)
    w = ManifestWriter(tmp_path, group=3, seconds=3600)
    files = []
    for i in range(4):
        f = tmp_path / f"s{i}.bin"
        f.write_bytes(b"x" * 10)
        files.append(f)
        w.append({"key": f"s{i}"}, f)
        assert len(read_manifest(tmp_path)) == (3 if i >= 2 else 0)  # nothing "done" before its group is synced
    w.close()
    assert list(read_manifest(tmp_path)) == ["s0", "s1", "s2", "s3"]
    synced = [p for p, _ in events]
    assert all(str(f.resolve()) in synced for f in files) and synced.count(str(tmp_path.resolve())) == 2


def test_early_writeback_is_available_on_linux_and_leaves_the_file_intact(tmp_path):
    """Each sample file's writeback is queued as soon as it is written (sync_file_range, not awaited): the manifest's
    group fsync and a final sync then find little left to write (benchmarks/writeback_ab.py measures it)."""
    import sys

    import torch

    from eagle3kit.capture import format as fmt

    if sys.platform.startswith("linux"):
        assert fmt._SYNC_FILE_RANGE is not None and fmt.EARLY_WRITEBACK
    t = {"hidden_states": torch.randn(64, 4, 32).bfloat16(), "token_ids": torch.arange(64)}
    n, digest = fmt.write_safetensors(tmp_path / "s.safetensors", t, {"k": "v"})
    back, meta = fmt.read_sample(tmp_path / "s.safetensors")
    assert torch.equal(back["hidden_states"], t["hidden_states"]) and meta["k"] == "v"
    from eagle3kit import checksum
    raw = (tmp_path / "s.safetensors").read_bytes()
    assert checksum.matches({"checksum": digest}, raw) and n == len(raw)
    with open(tmp_path / "s.safetensors", "rb+") as f:
        fmt.start_writeback(f.fileno())  # on a file with nothing dirty: no error either


def _merge_many(path: str, who: str, n: int) -> None:
    from eagle3kit.metrics import update_json

    for i in range(n):
        update_json(path, {f"{who}_{i}": i})


def test_metrics_merged_by_two_processes_at_once_keep_every_key(tmp_path):
    """The bad-input trial and the GPU fault tests merge into one metrics.json at the same time (gpu_record.sh
    faults): update_json takes turns on a lock of the folder, so neither read-modify-write loses the other's keys."""
    import json
    import multiprocessing as mp

    path = str(tmp_path / "metrics.json")
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_merge_many, args=(path, who, 200)) for who in ("trial", "faults")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert len(m) == 400 and not list(tmp_path.glob("*.tmp"))


def _torn(path: Path, lines: list[str], keep: int) -> None:
    """``lines`` written whole, then the first ``keep`` bytes of one more: what a stop mid-append leaves."""
    path.write_text("".join(x + "\n" for x in lines) + json.dumps({"key": "torn", "file": "torn.safetensors"})[:keep])


def test_a_torn_last_manifest_line_is_cut_before_the_resume_appends(tmp_path, capsys):
    """A full disk (or a kill) mid-append leaves a torn last line. Appended to as it was, the resume's first line
    joined it into one bad line inside the manifest (the GPU disk-full run, gpu-drafter-pipeline-9/faults): that
    complete sample counted as missing and every later read reported a malformed line. The writer cuts the torn
    tail first."""
    good = [json.dumps({"key": k, "file": f"{k}.safetensors"}) for k in ("a", "b")]
    for cut_it in (False, True):
        d = tmp_path / str(cut_it)
        d.mkdir()
        _torn(d / MANIFEST, good, keep=30)
        if cut_it:
            w = ManifestWriter(d, group=1)
        else:  # the old writer: a plain append
            w = ManifestWriter.__new__(ManifestWriter)
            w.path, w._f, w.group, w.seconds, w._queued, w._since = d / MANIFEST, open(d / MANIFEST, "a"), 1, 1.0, [], 0
        w.append({"key": "c", "file": "c.safetensors"})
        w.close()
        malformed = []
        got = read_manifest(d, malformed)
        if cut_it:
            assert list(got) == ["a", "b", "c"] and malformed == []
            assert "cut a torn last line" in capsys.readouterr().out
        else:  # what the check guards against: c lost inside a malformed line
            assert list(got) == ["a", "b"] and len(malformed) == 1


def test_cut_torn_tail_cuts_only_a_torn_tail(tmp_path):
    from eagle3kit.store import cut_torn_tail

    f = tmp_path / "x.jsonl"
    assert cut_torn_tail(f) == 0  # no file
    f.write_text("")
    assert cut_torn_tail(f) == 0
    f.write_text('{"a": 1}\n{"b": 2}\n')
    assert cut_torn_tail(f) == 0 and f.read_text() == '{"a": 1}\n{"b": 2}\n'
    f.write_text('{"a": 1}\n{"b": 2}\n{"c"')
    assert cut_torn_tail(f) == 4 and f.read_text() == '{"a": 1}\n{"b": 2}\n'
    f.write_text("x" * 200_000)  # one torn line longer than the backward scan's block, nothing before it
    assert cut_torn_tail(f) == 200_000 and f.read_text() == ""
    # a whole last record that lost only its newline: what the readers count as written is kept, not cut (the
    # manifest's reader counted such a sample done and this cut it: the resume captured neither)
    f.write_text('{"a": 1}\n{"b": 2}')
    assert cut_torn_tail(f) == 0 and f.read_text() == '{"a": 1}\n{"b": 2}\n'
    f.write_text('{"a": 1}\n[2]')  # not an object: not a record of ours, cut
    assert cut_torn_tail(f) == 3 and f.read_text() == '{"a": 1}\n'


def test_a_post_norm_data_set_is_not_resumed_as_a_pre_norm_one(tmp_path):
    """settings_for leaves final_slot out when it is pre_norm: a post-norm data set (captured inside the prefill
    graph) resumed without --prefill-graph compared no key and mixed the two kinds of last slot (an audit's case)."""
    from eagle3kit.store import StoreError, check_settings

    post = {"target": "t", "layer_ids": [1, 2], "final_slot": "post_norm"}
    check_settings(tmp_path, post)
    with pytest.raises(StoreError, match="final_slot.*post_norm.*pre_norm"):
        check_settings(tmp_path, {"target": "t", "layer_ids": [1, 2]})
    check_settings(tmp_path, post)  # the same settings resume
    check_settings(tmp_path / "pre", {"target": "t", "layer_ids": [1, 2]})
    with pytest.raises(StoreError, match="final_slot"):
        check_settings(tmp_path / "pre", post)


def test_a_torn_regenerated_reply_is_cut_before_more_replies_are_appended(tmp_path, tokenizer):
    """The replies' cache had the same flaw: the torn reply is regenerated, and was appended onto, so the run after
    that refused the file (a bad line inside it). Three runs: the second repairs, the third reads every reply."""
    from eagle3kit.extract import _read_regenerated, load_samples

    cache = tmp_path / "regen.jsonl"

    def reply(messages, n):
        return "the target's reply"
    load_samples("embedded:sharegpt", tokenizer, 2, 2048, regenerate_with=reply, regenerated_cache=cache)
    whole = cache.read_text()
    cache.write_text(whole[: whole.rindex("\n", 0, len(whole) - 1) + 1] + whole.splitlines()[-1][:40])
    assert len(_read_regenerated(cache)) == 1  # the torn reply is dropped
    load_samples("embedded:sharegpt", tokenizer, 3, 2048, regenerate_with=reply, regenerated_cache=cache)
    assert len(_read_regenerated(cache)) == 3 and len(cache.read_text().splitlines()) == 3
