"""Extraction on the reference engine: files, manifest, resume after a real kill, verify, preflight, exporters."""
import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from eagle3kit.extract import PreflightError, ReferenceBackend, extract, load_samples, preflight, settings_for
from eagle3kit.store import HiddenStatesDataset, StoreError, read_manifest, verify
from eagle3kit.target import TargetInfo


@pytest.fixture(scope="module")
def samples(tokenizer):
    s, _ = load_samples("embedded:sharegpt", tokenizer, max_samples=6, max_tokens=96)
    return s


def settings(target_path, storage="bf16", final_normed=True):
    info = TargetInfo.read(target_path)
    return settings_for(target_path, info, [2, 15, 27, 30], storage, "embedded:sharegpt", 96, final_normed)


@pytest.fixture(scope="module")
def extracted(tmp_path_factory, samples, reference, target_path):
    out = tmp_path_factory.mktemp("ex") / "data"
    summary = extract(samples, out, ReferenceBackend(reference), settings(target_path), progress=False)
    return out, summary


def test_extract_writes_verified_training_samples(extracted, samples, reference):
    out, summary = extracted
    assert summary["written"] == len(samples) and summary["failed"] == 0
    rep = verify(out)
    assert rep.passed and rep.ok == len(samples)
    ds = HiddenStatesDataset(out, split=None)
    item = ds[0]
    s = samples[0]
    assert item["token_ids"].tolist() == s.input_ids and item["loss_mask"].tolist() == s.loss_mask
    assert item["hidden_states"].shape == (len(s.input_ids), 4, 576)
    ref = reference.hidden(s.input_ids)["hidden_states"]
    assert torch.allclose(item["hidden_states"].float(), ref.to(torch.bfloat16).float())


def test_rerun_skips_done_and_other_settings_are_refused(extracted, samples, reference, target_path):
    out, _ = extracted
    again = extract(samples, out, ReferenceBackend(reference), settings(target_path), progress=False)
    assert again["written"] == 0 and again["already_done"] == len(samples)
    before = sorted(p.name for p in (out / "samples").iterdir())
    with pytest.raises(StoreError, match="other settings"):
        extract(samples, out, ReferenceBackend(reference), settings(target_path, storage="fp8"), progress=False)
    assert sorted(p.name for p in (out / "samples").iterdir()) == before


def _copy_with_a_flipped_byte(src, dest, index, offset, mask):
    """A copy of data set ``src`` whose sample ``index`` has byte ``offset`` xor ``mask`` (a new file: ``src``
    keeps its own). Returns (dest, manifest entries in index order)."""
    import shutil

    shutil.copytree(src, dest)
    entries = sorted(read_manifest(dest).values(), key=lambda e: e["index"])
    f = dest / "samples" / entries[index]["file"]
    blob = bytearray(f.read_bytes())
    blob[offset] ^= mask
    f.unlink()
    f.write_bytes(bytes(blob))
    return dest, entries


def test_verify_catches_corruption_and_missing_files(tmp_path, extracted):
    src, _ = extracted
    out, entries = _copy_with_a_flipped_byte(src, tmp_path / "copy", 0, -10, 0xFF)
    (out / "samples" / entries[1]["file"]).unlink()
    rep = verify(out)
    problems = {p["key"]: p["problem"] for p in rep.problems}
    assert not rep.passed and "checksum" in problems[entries[0]["key"]] and "missing" in problems[entries[1]["key"]]
    assert rep.ok == len(entries) - 2
    # threads check samples at once; the report is the same, problems in the samples' order, whatever their number
    # (a fourth sample's file cut short)
    cut = out / "samples" / entries[3]["file"]
    cut.write_bytes(cut.read_bytes()[:-4])
    # and a fifth sample rewritten with one NaN under a matching checksum: only the finite-value scan can see it
    from eagle3kit.capture.format import read_sample, write_sample

    t, meta = read_sample(out / "samples" / entries[4]["file"])
    t["hidden_states"] = t["hidden_states"].clone()
    t["hidden_states"][2, 1, 5] = float("nan")
    w = write_sample(out / "samples", entries[4]["key"], 0, t, meta, "bf16")
    m = out / "manifest.jsonl"
    m.write_text("".join(json.dumps({**e, "checksum": w["checksum"], "bytes": w["bytes"]}) + "\n"
                         if e["key"] == entries[4]["key"] else json.dumps(e) + "\n" for e in entries))
    reports = [verify(out, workers=w) for w in (1, 3, 16)]
    assert [r.problems for r in reports[1:]] == [reports[0].problems] * 2, reports
    assert [p["key"] for p in reports[0].problems] == [entries[i]["key"] for i in (0, 1, 3, 4)]
    assert reports[0].problems[-1]["problem"] == "non-finite values", reports[0].problems
    assert {(r.checked, r.ok) for r in reports} == {(len(entries), len(entries) - 4)}


def test_a_resume_repairs_what_fails_verification(tmp_path, extracted, samples, reference, target_path):
    """A sample whose bytes changed (a flipped bit), one whose file has another size, and a garbled manifest line:
    verify names each; a resume with the same settings captures those two samples again, drops the garbled line,
    leaves every other sample's file as it was, and the data set verifies."""
    src, _ = extracted
    out, entries = _copy_with_a_flipped_byte(src, tmp_path / "copy", 0, -10, 0xFF)
    cut = out / "samples" / entries[1]["file"]
    cut.write_bytes(cut.read_bytes()[:-4])
    m = out / "manifest.jsonl"
    lines = m.read_text().splitlines(keepends=True)
    m.write_text("".join(lines[:3]) + '{"key": "garbled", \n' + "".join(lines[3:]))
    rep = verify(out)
    problems = {p["key"]: p["problem"] for p in rep.problems}
    assert set(problems) == {entries[0]["key"], entries[1]["key"], "manifest.jsonl:4"}, problems
    kept = {e["file"]: (out / "samples" / e["file"]).read_bytes() for e in entries[2:]}
    again = extract(samples, out, ReferenceBackend(reference), settings(target_path), progress=False)
    assert again["repaired"] == 2 and again["written"] == 2 and again["manifest_lines_dropped"] == 1
    assert verify(out).passed and verify(out).ok == len(samples)
    assert all((out / "samples" / f).read_bytes() == b for f, b in kept.items())
    assert len(m.read_text().splitlines()) == len(samples)  # one line per sample: the manifest was compacted
    assert extract(samples, out, ReferenceBackend(reference), settings(target_path), progress=False)["repaired"] == 0


def test_a_failed_sample_is_named_and_tried_again_in_the_same_run(tmp_path, samples, reference, target_path, capsys):
    """A capture that fails (a hook error's marker, say) is named and captured again once before the run ends; one
    that fails twice is reported as failed, the others are kept."""
    class Flaky(ReferenceBackend):
        def __init__(self, ref, fail_times):
            super().__init__(ref)
            self.left = dict(fail_times)

        def run(self, samples_dir, todo, on_done):
            ok = []
            for s in todo:
                if self.left.get(s.key, 0) > 0:
                    self.left[s.key] -= 1
                    on_done(s.key, {"status": "error", "key": s.key, "reason": "capture hook error in layer 3: boom"})
                else:
                    ok.append(s)
            super().run(samples_dir, ok, on_done)

    keys = [s.key for s in samples]
    out = tmp_path / "data"
    summary = extract(samples, out, Flaky(reference, {keys[0]: 1, keys[1]: 2}), settings(target_path), progress=False)
    assert summary["retried"] == 2 and summary["written"] == len(samples) - 1 and summary["failed"] == 1
    assert [f["key"] for f in summary["failures"]] == [keys[1]]
    assert f"capturing {keys[0]} again: error: capture hook error" in capsys.readouterr().out
    assert set(read_manifest(out)) == set(keys) - {keys[1]}


def test_preflight_refuses_what_does_not_fit(tmp_path, samples, monkeypatch):
    import shutil
    from collections import namedtuple

    est = preflight(samples, 4, 576, "bf16", tmp_path)
    assert est["estimated_bytes"] == sum(len(s.input_ids) for s in samples) * (4 * 576 * 2 + 8)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(PreflightError, match="--storage fp8"):
        preflight(samples, 4, 576, "bf16", tmp_path / "new" / "dir")
    assert not (tmp_path / "new").exists()


def test_a_first_run_the_preflight_refuses_locks_no_settings(tmp_path, samples, reference, target_path, monkeypatch):
    """The preflight's advice (--storage fp8, fewer tokens) must work: a first run it refuses writes no settings (it
    wrote extraction.json first, and the advised rerun was refused as 'other settings'; an audit's case)."""
    import shutil
    from collections import namedtuple

    out = tmp_path / "run"
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: namedtuple("u", "total used free")(10**9, 10**9 - 1000, 1000))
    with pytest.raises(PreflightError, match="--storage fp8"):
        extract(samples[:2], out, ReferenceBackend(reference), settings(target_path), progress=False)
    assert not out.exists() or not any(out.iterdir())
    monkeypatch.setattr(shutil, "disk_usage", real)
    s = extract(samples[:2], out, ReferenceBackend(reference, storage="fp8"), settings(target_path, "fp8"),
                progress=False)
    assert s["written"] == 2


def test_batched_reference_forwards_write_the_samples_one_prompt_per_forward_writes(tmp_path, samples, reference,
                                                                                   target_path, extracted):
    from eagle3kit.extract import batches_by_length

    groups = batches_by_length(samples, 256)
    assert max(len(g) for g in groups) > 1  # the test batches for real
    assert all(len(g) * max(len(s.input_ids) for s in g) <= 256 for g in groups if len(g) > 1)
    out = tmp_path / "batched"
    summary = extract(samples, out, ReferenceBackend(reference, batch_tokens=256), settings(target_path),
                      progress=False)
    assert summary["written"] == len(samples) and summary["failed"] == 0 and verify(out).passed
    one = {e["key"]: e for e in read_manifest(extracted[0]).values()}
    from eagle3kit.store import load_entry

    def rel(x, y):
        return ((x - y).norm() / y.norm()).item()

    got, ref = {}, {}
    for e in read_manifest(out).values():
        got[e["key"]] = load_entry(out, e)["hidden_states"].float()
        ref[e["key"]] = load_entry(extracted[0], one[e["key"]])["hidden_states"].float()
        assert rel(got[e["key"]], ref[e["key"]]) < 1e-2, e["key"]  # bf16 files of float32 forwards
    # the comparison would catch two prompts' states swapped within a batch (same length: same shape)
    same = [(k, j) for k in got for j in got if k < j and got[k].shape == got[j].shape]
    assert same and all(rel(got[k], ref[j]) > 0.1 for k, j in same)


def test_a_failed_batch_runs_one_prompt_at_a_time(tmp_path, samples, reference, target_path, capsys):
    class NoBatch:
        def __getattr__(self, name):
            return getattr(reference, name)

        def hidden_batched(self, prompts):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")

    out = tmp_path / "fallback"
    summary = extract(samples[:3], out, ReferenceBackend(NoBatch(), batch_tokens=10_000), settings(target_path),
                      progress=False)
    assert summary["written"] == 3 and verify(out).passed
    assert "running them one at a time" in capsys.readouterr().out


def test_fp8_storage_is_read_back_by_training(tmp_path, samples, reference, target_path, extracted):
    out = tmp_path / "fp8"
    s = extract(samples[:2], out, ReferenceBackend(reference, storage="fp8"), settings(target_path, "fp8"),
                progress=False)
    full = reference.hidden(samples[0].input_ids)["hidden_states"].float()
    back = HiddenStatesDataset(out, split=None)[0]["hidden_states"].float()
    assert ((back - full).norm() / full.norm()).item() < 0.05
    bf16 = {e["key"]: e["bytes"] for e in read_manifest(extracted[0]).values()}
    ratio = s["bytes"] / sum(bf16[x.key] for x in samples[:2])
    assert 0.55 < ratio < 0.75, ratio  # fp8 hidden states + scales; the normed final state stays bf16
    # the preflight's estimate (bytes_per_token) is the layout written: aux slots e4m3 + scales, the last slot bf16
    assert abs(s["estimated_bytes"] - s["bytes"]) / s["bytes"] < 0.03, (s["estimated_bytes"], s["bytes"])
    assert verify(out).passed


def test_exporters_speculators_and_specforge(tmp_path, extracted, samples):
    from datasets import load_from_disk

    from eagle3kit.export import to_specforge, to_speculators

    out, _ = extracted
    r = to_speculators(out, tmp_path / "spec", split="all")
    assert r["rows"] == len(samples) and r["hard_linked"] == len(samples)
    ds = load_from_disk(str(tmp_path / "spec"))
    assert set(ds.column_names) == {"input_ids", "loss_mask", "seq_len"} and ds.format["type"] == "torch"
    from safetensors.torch import load_file

    hs0 = load_file(str(tmp_path / "spec" / "hidden_states" / "hs_0.safetensors"))
    assert torch.equal(hs0["token_ids"], ds[0]["input_ids"]) and hs0["hidden_states"].shape[1] == 4
    assert (tmp_path / "spec" / "token_freq.pt").exists()
    f = to_specforge(out, tmp_path / "sf", split="all")
    d = torch.load(tmp_path / "sf" / "rows_0-2000" / "data_0.ckpt", weights_only=True)
    T = len(samples[0].input_ids)
    assert d["aux_hidden_state"].shape == (1, T, 3 * 576) and d["hidden_state"].shape == (1, T, 576)
    assert f["rows"] == len(samples)
    assert to_specforge(out, tmp_path / "sf", split="all")["rows"] == f["rows"]  # its own earlier export: replaced
    (tmp_path / "sf" / "notes.txt").write_text("the user's")  # a user's file there: refused, kept
    with pytest.raises(StoreError, match="not empty.*notes.txt"):
        to_specforge(out, tmp_path / "sf", split="all")
    assert (tmp_path / "sf" / "notes.txt").read_text() == "the user's"


def test_a_post_norm_final_slot_goes_to_specforge_only(tmp_path, extracted):
    """A data set whose last slot is the final norm's output (``final_slot: post_norm``, captured inside SGLang's
    prefill graph): SpecForge's ``hidden_state`` is that slot; speculators (which norms the slot itself) refuses it."""
    from eagle3kit.export import to_specforge, to_speculators
    from eagle3kit.store import derive

    out, _ = extracted
    post = tmp_path / "post"
    derive(out, post, final_slot="post_norm")
    with pytest.raises(StoreError, match="speculators applies the target's norm to it again"):
        to_speculators(post, tmp_path / "spec", split="all")
    assert not (tmp_path / "spec").exists() or not any((tmp_path / "spec").iterdir())
    to_specforge(post, tmp_path / "sf", split="all")
    to_specforge(out, tmp_path / "sf0", split="all")  # from the final_normed tensor of the pre-norm data set
    a = torch.load(tmp_path / "sf" / "rows_0-2000" / "data_0.ckpt", weights_only=True)
    b = torch.load(tmp_path / "sf0" / "rows_0-2000" / "data_0.ckpt", weights_only=True)
    assert torch.equal(a["hidden_state"], b["hidden_state"]) and torch.equal(a["aux_hidden_state"], b["aux_hidden_state"])
    # derived again: still post-norm (fp8 here); the pre-norm state cannot be had back from it
    again = derive(post, tmp_path / "post-fp8", storage="fp8", final_slot="post_norm")
    assert again["final_slot"] == "post_norm" and again["samples"] == len(read_manifest(post))
    with pytest.raises(StoreError, match="cannot be recovered"):
        derive(post, tmp_path / "pre", final_slot="pre_norm")


def test_exporters_check_values_and_leave_out_a_corrupt_sample(tmp_path, extracted, samples):
    """By value: SpecForge's aux slots in layer order and its post-norm state, speculators' states aligned with
    their row's ids. A sample whose file was bit-flipped after the extraction is left out and reported, never
    hard-linked into the export."""
    from datasets import load_from_disk
    from safetensors.torch import load_file

    from eagle3kit.export import to_specforge, to_speculators
    from eagle3kit.store import load_entry

    out, _ = extracted
    bad, entries = _copy_with_a_flipped_byte(out, tmp_path / "copy", 1, -3, 0x01)  # one bit of the last element
    r = to_speculators(bad, tmp_path / "spec", split="all")
    assert r["rows"] == len(entries) - 1 and r["skipped"] == 1 and "checksum" in r["skipped_reasons"][0]
    ds = load_from_disk(str(tmp_path / "spec"))
    for row, e in enumerate(x for i, x in enumerate(entries) if i != 1):
        hs = load_file(str(tmp_path / "spec" / "hidden_states" / f"hs_{row}.safetensors"))
        want = load_entry(out, e)
        assert torch.equal(hs["token_ids"], ds[row]["input_ids"]) and torch.equal(hs["token_ids"], want["token_ids"])
        assert torch.equal(hs["hidden_states"], want["hidden_states"])
    sf = to_specforge(bad, tmp_path / "sf", split="all")
    assert sf["rows"] == len(entries) - 1 and sf["skipped"] == 1
    want = load_entry(out, entries[0])
    d = torch.load(tmp_path / "sf" / "rows_0-2000" / "data_0.ckpt", weights_only=True)
    hs = want["hidden_states"]
    assert torch.equal(d["aux_hidden_state"][0], torch.cat([hs[:, j] for j in range(hs.shape[1] - 1)], dim=-1))
    assert torch.equal(d["hidden_state"][0], want["final_normed"])  # post-norm, as SpecForge trains on it
    assert not torch.equal(d["hidden_state"][0], hs[:, -1])


def test_an_export_of_nothing_fails_and_leaves_its_destination_empty(tmp_path, extracted):
    from eagle3kit.export import to_specforge, to_speculators

    bad, entries = _copy_with_a_flipped_byte(extracted[0], tmp_path / "copy", 0, -3, 0x01)
    for e in entries[1:]:
        f = bad / "samples" / e["file"]
        blob = bytearray(f.read_bytes())
        blob[-3] ^= 0x01
        f.unlink()
        f.write_bytes(bytes(blob))
    for fn, dest in ((to_speculators, tmp_path / "spec"), (to_specforge, tmp_path / "sf")):
        with pytest.raises(StoreError, match="every sample failed its check"):
            fn(bad, dest, split="all")
        assert not dest.exists()  # nothing left: a rerun after the fix is not refused as "not empty"
    (tmp_path / "made").mkdir()  # a folder the user made stays, empty
    with pytest.raises(StoreError, match="every sample failed its check"):
        to_speculators(bad, tmp_path / "made", split="all")
    assert (tmp_path / "made").is_dir() and not any((tmp_path / "made").iterdir())
    assert not list(tmp_path.glob(".*partial*"))  # nor a hidden part of it beside


def test_an_export_killed_midway_leaves_nothing_that_loads_at_its_destination(tmp_path, extracted, monkeypatch):
    """An export writes a hidden sibling that becomes its destination by one rename at the end: while it writes (when
    a kill would stop it) the destination holds nothing. A killed SpecForge export left 25 of 91 samples at its
    destination, each loading (an audit's case)."""
    from eagle3kit import export as X

    dest, seen = tmp_path / "sf", []
    real = torch.save

    def save_and_look(obj, path, *a, **k):  # the moment of each sample's write, as a kill would find it
        real(obj, path, *a, **k)
        seen.append(dest.exists() and any(dest.iterdir()))
    monkeypatch.setattr(X.torch, "save", save_and_look)
    out = X.to_specforge(extracted[0], dest, split="all")
    assert seen and not any(seen) and out["dest"] == str(dest) and out["rows"] == len(list(dest.rglob("*.ckpt")))
    assert not list(tmp_path.glob(".*partial*")) and oct(dest.stat().st_mode & 0o777) == "0o755"


@pytest.mark.slow
def test_resume_after_a_real_kill(tmp_path, target_path, capsys):
    """SIGKILL an extraction mid-run (its own process); the rerun (the same command, run here) completes it with
    every sample exactly once and verified."""
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "eagle3kit.cli", "extract", "--target", str(target_path), "--out", str(out),
           "--max-samples", "32", "--max-tokens", "128"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and len(read_manifest(out)) < 3:
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    first = len(read_manifest(out))
    assert first >= 3, f"kill came too early ({first} samples done)"  # too late: n > first below (samples come in
    # bursts: one poll saw fewer than 3 and the kill found 12 of 16 done, 2026-12-03; 32 leave room)
    from eagle3kit.cli import main

    capsys.readouterr()
    rc = main(cmd[3:])
    out_text, err = capsys.readouterr()
    assert rc == 0, err[-2000:]
    summary = json.loads(out_text)
    n = summary["samples"]  # 32 conversations, less those with no assistant token in 128 tokens
    assert n > first, f"the kill came after the extraction ended ({first} of {n} samples done): nothing to resume"
    assert summary["already_done"] >= first and summary["already_done"] + summary["written"] == n
    lines = (out / "manifest.jsonl").read_text().splitlines()
    keys = [json.loads(x)["key"] for x in lines if x.strip()]
    assert len(keys) == len(set(keys)) == n  # nothing lost, nothing duplicated
    assert verify(out).passed
    m = json.loads((out / "metrics.json").read_text())  # this run's totals and the whole data set's
    assert m["written"] == summary["written"] and m["dataset_samples"] == n and not (out / "failures.json").exists()
    entries = read_manifest(out).values()
    assert m["dataset_tokens"] == sum(e["n_tokens"] for e in entries) and m["dataset_bytes"] == sum(e["bytes"] for e in entries)


def test_regeneration_replaces_assistant_turns_with_the_targets_replies(tmp_path, reference, tokenizer):
    from eagle3kit.data.regenerate import TransformersGenerator

    gen = TransformersGenerator(reference.tokenizer, reference.model)
    cache = tmp_path / "regen.jsonl"
    samples, _ = load_samples("embedded:sharegpt", tokenizer, 2, 2048, regenerate_with=gen,
                              regenerate_max_new_tokens=6, regenerated_cache=cache)
    cached = [json.loads(x) for x in cache.read_text().splitlines()]
    assert len(cached) == 2 and all(c["regenerated"] for c in cached)
    replies = [m["content"] for m in cached[0]["messages"] if m["role"] == "assistant"]
    assert replies and all(len(tokenizer(r).input_ids) <= 7 for r in replies)
    masked = tokenizer.decode([t for t, m in zip(samples[0].input_ids, samples[0].loss_mask) if m])
    assert replies[0] in masked
    again, _ = load_samples("embedded:sharegpt", tokenizer, 2, 2048, regenerate_with=lambda *a: 1 / 0,
                            regenerated_cache=cache)  # a resume reuses the cached replies, generating nothing
    assert [s.input_ids for s in again] == [s.input_ids for s in samples]


def test_a_regeneration_time_budget_captures_a_prefix_and_counts_the_rest(tmp_path, tokenizer):
    """regenerate_minutes: no conversation starts after the budget; the ones not regenerated keep the data set's
    replies, so they are left out (counted), and the others keep the keys a full run gives them."""
    import threading
    import time

    calls, lock = [], threading.Lock()

    def slow(messages, n):  # a server answering in 50 ms
        time.sleep(0.05)
        with lock:
            calls.append(len(messages))
        return "target's reply"
    cache = tmp_path / "regen.jsonl"
    samples, report = load_samples("embedded:sharegpt", tokenizer, 40, 2048, regenerate_with=slow,
                                   regenerate_concurrency=2, regenerated_cache=cache, regenerate_seconds=0.3)
    cached = [json.loads(x)["id"] for x in cache.read_text().splitlines()]
    left = report.skipped["not regenerated within the time budget (regenerate_minutes)"]
    assert 0 < len(cached) < 40 and len(cached) + left == 40, (len(cached), left)
    from eagle3kit.data.conversations import load_conversations

    order = [c["id"] for c in load_conversations("embedded:sharegpt", limit=40)[0]]
    assert sorted(cached, key=order.index) == order[:len(cached)]  # they start in order: a prefix, written as finished
    full, _ = load_samples("embedded:sharegpt", tokenizer, 40, 2048)
    assert {s.conv_id for s in samples} <= set(cached)  # nothing with the data set's own replies is data
    by_key = {s.key: s.conv_id for s in full}
    assert all(by_key[s.key] == s.conv_id for s in samples)  # keys (indices) as in a run without a budget
    assert all("target's reply" in tokenizer.decode(s.input_ids) for s in samples)
    n = len(calls)
    again, report = load_samples("embedded:sharegpt", tokenizer, 40, 2048, regenerate_with=slow,
                                 regenerated_cache=cache, regenerate_seconds=0)  # 0: the cached replies only
    assert len(calls) == n and [s.key for s in again] == [s.key for s in samples]
    assert report.skipped["not regenerated within the time budget (regenerate_minutes)"] == left


def test_a_regeneration_that_fails_keeps_every_conversation_finished_before(tmp_path, tokenizer):
    """Replies are kept as each conversation finishes, not in the data set's order: a long first conversation that
    ends in an error does not take the others' finished replies with it."""
    import threading
    import time

    first = threading.Event()

    def gen(messages, n):
        if "first" in messages[0]["content"]:
            first.wait(5)  # until the others are done
            raise ConnectionError("the server went away")
        return "reply"
    convs = [{"id": str(i), "messages": [{"role": "user", "content": "first" if i == 0 else f"q{i}"},
                                         {"role": "assistant", "content": "a"}]} for i in range(6)]
    data = tmp_path / "convs.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in convs))
    cache = tmp_path / "regen.jsonl"

    def release():
        while not cache.exists() or len(cache.read_text().splitlines()) < 5:
            time.sleep(0.01)
        first.set()
    threading.Thread(target=release, daemon=True).start()
    with pytest.raises(ConnectionError):
        load_samples(str(data), tokenizer, 6, 2048, regenerate_with=gen, regenerate_concurrency=3,
                     regenerated_cache=cache)
    kept = sorted(json.loads(x)["id"] for x in cache.read_text().splitlines())
    assert kept == ["1", "2", "3", "4", "5"]


def test_sglang_regeneration_spreads_over_data_parallel_servers(tokenizer):
    """Several servers (--urls): /generate requests go to each in turn (stand-in endpoints answering like SGLang)."""
    from test_client import endpoint

    from eagle3kit.data.regenerate import SGLangGenerator, regenerate

    seen = []

    def respond(port, method, path, body):
        assert path == "/generate" and body["input_ids"] and body["sampling_params"]["temperature"] == 0.0
        seen.append(port)
        return 200, {"text": f" from {port} "}

    servers = [endpoint(respond) for _ in range(2)]
    try:
        gen = SGLangGenerator([f"http://127.0.0.1:{srv.server_port}" for srv in servers], tokenizer)
        convs = [{"id": str(i), "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
                 for i in range(6)]
        out = list(regenerate(convs, gen, 4, concurrency=3))
    finally:
        for srv in servers:
            srv.shutdown()
    assert sorted(seen) == sorted([srv.server_port for srv in servers] * 3)
    assert [o["messages"][1]["content"].startswith("from ") for o in out] == [True] * 6
    with pytest.raises(ValueError, match="at least one"):
        SGLangGenerator([], tokenizer)


def test_regeneration_budget_counts_from_when_the_servers_answer(tokenizer, tmp_path):
    """regenerate_seconds counts replies: a generator's prepare() (servers starting) runs before its clock. Without
    it, a start longer than the budget left one conversation (the one that waited for the start)."""
    from eagle3kit.extract import load_samples

    class Lazy:  # starts its "server" on the first reply (SGLangGenerator with a callable urls)
        def __init__(self):
            self.up = False

        def start(self):
            time.sleep(0.6)
            self.up = True

        def __call__(self, messages, n):
            if not self.up:
                self.start()
            return "reply"

    class Prepared(Lazy):
        def prepare(self):
            self.start()

    convs = [{"id": str(i), "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
             for i in range(6)]
    data = tmp_path / "convs.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in convs))
    for gen, want in ((Prepared(), 6), (Lazy(), 1)):
        cache = tmp_path / f"{type(gen).__name__}.jsonl"
        load_samples(str(data), tokenizer, 6, 2048, regenerate_with=gen, regenerated_cache=cache, regenerate_seconds=0.4)
        assert len(cache.read_text().splitlines()) == want, type(gen).__name__


def test_regeneration_helpers_join_as_they_become_healthy_and_a_failed_one_is_left_out(tokenizer):
    """HelperServers: helpers start staggered (never at the same moment: servers size their pools from the free
    memory), each joins the generator's servers when healthy (requests then reach it: stand-in endpoints answering
    like SGLang), one that fails to start is reported and left out, and stop() stops every started one."""
    from test_client import endpoint

    from eagle3kit.data.regenerate import HelperServers, SGLangGenerator, regenerate

    seen, events = [], []

    def respond(port, method, path, body):
        seen.append(port)
        return 200, {"text": "ok"}

    endpoints = [endpoint(respond) for _ in range(3)]  # the capture server, helper 0, helper 2
    url = [f"http://127.0.0.1:{e.server_port}" for e in endpoints]

    class Stand:  # a helper server's life cycle
        def __init__(self, i):
            self.i, self.url = i, url[min(i + 1, 2)]

        def start(self):
            events.append(("start", self.i, time.monotonic()))
            return self

        def wait_healthy(self):
            if self.i == 1:
                events.append(("failed", self.i))
                raise RuntimeError("SGLang exited with code 1 while starting")
            events.append(("healthy", self.i))
            return 0.0

        def stop(self):
            events.append(("stop", self.i))

    try:
        gen = SGLangGenerator([url[0]], tokenizer)
        t0 = time.monotonic()
        helpers = HelperServers(3, Stand, gen.add_url, log=lambda s: None, stagger=0.2).start()
        helpers._thread.join(5)
        starts = [e for e in events if e[0] == "start"]
        assert [e[1] for e in starts] == [0, 1, 2]
        assert all(b[2] - a[2] >= 0.19 for a, b in zip([("", -1, t0)] + starts, starts))  # (i + 1) * stagger
        assert [e[:2] for e in events[3:]] == [("healthy", 0), ("failed", 1), ("healthy", 2)]  # after all started
        assert helpers.healthy == [url[1], url[2]] and gen.urls == url
        assert len(helpers.failed) == 1 and "helper 1" in helpers.failed[0] and "exited" in helpers.failed[0]
        convs = [{"id": str(i), "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
                 for i in range(6)]
        assert len(list(regenerate(convs, gen, 4, concurrency=3))) == 6
        assert sorted(seen) == sorted([e.server_port for e in endpoints] * 2)  # the helpers answered their share
        helpers.stop()
        assert {e[:2] for e in events if e[0] == "stop"} == {("stop", 0), ("stop", 1), ("stop", 2)}
    finally:
        for srv in endpoints:
            srv.shutdown()
    idle = HelperServers(2, Stand, lambda u: None, log=lambda s: None, stagger=0.01)  # stopped first: none starts
    idle.stop()
    idle.start()
    idle._thread.join(5)
    assert idle.servers == [] and idle.healthy == []


def test_shards_partition_the_data(tokenizer):
    from eagle3kit.data.conversations import load_conversations
    from eagle3kit.extract import prepare_samples

    convs, _ = load_conversations("embedded:sharegpt", limit=9)
    shards = [prepare_samples(convs, tokenizer, 64, world_size=3, rank=r) for r in range(3)]
    keys = [s.key for shard in shards for s in shard]
    assert len(keys) == len(set(keys)) == len(prepare_samples(convs, tokenizer, 64))
    with pytest.raises(ValueError, match="rank 3"):
        prepare_samples(convs, tokenizer, 64, world_size=3, rank=3)


def test_rendering_in_a_process_pool_gives_the_same_samples_and_skips(tokenizer, monkeypatch):
    """Many conversations render in worker processes (a large data set took minutes in one): the same samples, keys,
    splits, masks and skip counts as one process, in the same order (here a shard's); the pool is chosen only on a
    host with the cores for it."""
    from eagle3kit import extract
    from eagle3kit.data import render_pool
    from eagle3kit.data.conversations import load_conversations

    convs, _ = load_conversations("embedded:sharegpt", limit=31)
    convs += [{"id": "q", "messages": [{"role": "user", "content": "Hi"}]}]  # a skip among them, in rank 1's shard
    one, many = {}, {}
    serial = extract.prepare_samples(convs, tokenizer, 96, skipped=one, workers=1, world_size=2, rank=1)
    pooled = extract.prepare_samples(convs, tokenizer, 96, skipped=many, workers=2, world_size=2, rank=1)
    assert [(s.key, s.split, s.input_ids, s.loss_mask) for s in pooled] == \
        [(s.key, s.split, s.input_ids, s.loss_mask) for s in serial] and len(serial) > 5
    assert many == one and one["no assistant reply (rank 1's shard of 2)"] == 1
    assert render_pool.workers_for(render_pool.PARALLEL_FROM - 1) == 1
    monkeypatch.setattr(render_pool.os, "sched_getaffinity", lambda _: set(range(2)))
    assert render_pool.workers_for(10 ** 6) == 1  # a 2-core host: the pool's start costs more than it saves
    monkeypatch.setattr(render_pool.os, "sched_getaffinity", lambda _: set(range(64)))
    assert render_pool.workers_for(10 ** 6) == 16


def test_conversations_that_become_no_sample_are_counted_by_reason(tokenizer, tmp_path):
    """gpu-03-extract-prefill-graph-fp8: 400 conversations kept, 387 samples, and the 13 between counted nowhere.
    A conversation without a reply, or whose prompt fills max_tokens before its reply starts, is no sample: counted."""
    from eagle3kit.extract import prepare_samples

    ok = {"id": "ok", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]}
    no_reply = {"id": "q", "messages": [{"role": "user", "content": "Hi"}]}
    long = {"id": "long", "messages": [{"role": "user", "content": "word " * 400},
                                       {"role": "assistant", "content": "Fine."}]}
    skipped = {}
    got = prepare_samples([ok, no_reply, long], tokenizer, 64, skipped=skipped)
    assert [s.conv_id for s in got] == ["ok"]
    assert skipped == {"no assistant reply": 1, "fewer than 1 reply token(s) within max_tokens=64": 1}
    assert [s.conv_id for s in prepare_samples([ok, no_reply, long], tokenizer, 64)] == ["ok"]  # counting is optional
    # a template that checks the roles' order (Mistral's, Llama-2's raise_exception) refuses one conversation: a skip
    # with its reason, not a traceback that ends the extraction (an audit's case: 4 of the first 2,000 ShareGPT ones)
    strict = copy.copy(tokenizer)
    strict.chat_template = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                            "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
                            "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}")
    twice = {"id": "twice", "messages": [ok["messages"][0], ok["messages"][0], ok["messages"][1]]}
    skipped = {}
    assert [s.conv_id for s in prepare_samples([ok, twice], strict, 64, skipped=skipped)] == ["ok"]
    assert list(skipped) == ["the chat template refused it (Conversation roles must alternate user/assistant)"]
    # end to end: what an extraction's report (its data_skipped) holds, from a data file
    data = tmp_path / "convs.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in (ok, long, {**ok, "id": "ok2"})))
    samples, report = load_samples(str(data), tokenizer, None, 64)
    assert [s.conv_id for s in samples] == ["ok", "ok2"]
    assert report.skipped.get("fewer than 1 reply token(s) within max_tokens=64") == 1, report.skipped
    # a shard counts its own conversations only, and says so beside the loader's counts of all of them
    _, r0 = load_samples(str(data), tokenizer, None, 64, world_size=2, rank=0)
    _, r1 = load_samples(str(data), tokenizer, None, 64, world_size=2, rank=1)
    assert "fewer than 1 reply token(s) within max_tokens=64 (rank 1's shard of 2)" in r1.skipped
    assert not any("max_tokens" in k for k in r0.skipped)


def test_a_mismatched_capture_server_is_refused_and_nothing_written_is_lost(tmp_path, target_path):
    from test_client import info_server

    from eagle3kit.capture.hook import capture_config, forward_hooks
    from eagle3kit.capture.server import ServerError
    from eagle3kit.pipeline import run_extraction

    out = tmp_path / "ds"
    first = run_extraction(target=target_path, out_dir=out, max_samples=2, max_tokens=96, progress=False)
    before = (out / "manifest.jsonl").read_bytes()
    wrong = forward_hooks(capture_config(tmp_path / "elsewhere", [2, 15, 27], 30))  # right layers, wrong folder
    server = info_server({"forward_hooks": wrong})
    try:
        with pytest.raises(ServerError, match="writes captures to .*elsewhere.*Fix"):
            run_extraction(target=target_path, out_dir=out, engine="sglang", max_samples=4, max_tokens=96,
                           urls=[f"http://127.0.0.1:{server.server_port}"], progress=False)
    finally:
        server.shutdown()
    assert (out / "manifest.jsonl").read_bytes() == before and first["written"] == 2 and verify(out).passed


def test_fp8_storage_keeps_the_teachers_input_exact(samples, reference):
    """The trainer computes the target's logits from the last slot. In e4m3 (the first fp8 layout) that slot moved the
    target's argmax on some tokens (2.5 % of 1,658 ShareGPT tokens): training targets that are not the target's. The
    fp8 layout keeps the last slot in bf16, so the argmax is the bf16 capture's on every token."""
    from eagle3kit.capture.format import decode, encode, fp8_encode

    m = reference.model
    new_flips = old_flips = n = 0
    with torch.no_grad():
        for s in samples:
            hs = reference.hidden(s.input_ids)["hidden_states"].to(torch.bfloat16)
            ids = torch.tensor(s.input_ids)
            new = decode(encode({"hidden_states": hs, "token_ids": ids}, "fp8"))["hidden_states"]
            q, scale = fp8_encode(hs)
            old = decode({"hidden_states_fp8": q, "hidden_states_scale": scale, "token_ids": ids})["hidden_states"]

            def argmax(x):
                return m.lm_head(m.model.norm(x[:, -1].float())).argmax(-1)
            want = argmax(hs)
            new_flips += int((argmax(new) != want).sum())
            old_flips += int((argmax(old) != want).sum())
            n += len(s.input_ids)
    print(f"argmax moved: {new_flips} (bf16 last slot), {old_flips} (e4m3 last slot) of {n} tokens")
    assert new_flips == 0 and old_flips > 0, (new_flips, old_flips, n)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_half_written_files_of_writers_that_are_gone_are_removed_and_no_other(tmp_path):
    """A capture server stopped mid-write (the disk full, gpu-drafter-pipeline-10/faults) leaves
    ``.<file>.<pid>.<thread>.tmp``: removed once its process is gone; a living writer's file, a young one under
    ``min_age_s`` and files that are not a writer's are kept."""
    from eagle3kit.capture.format import remove_dead_writers_tmp

    dead, me = _dead_pid(), os.getpid()
    gone = tmp_path / f".s0000311.rank0.safetensors.{dead}.140133038814912.tmp"
    live = tmp_path / f".s0000312.rank0.safetensors.{me}.1.tmp"
    other = tmp_path / ".notes.tmp"
    for f in (gone, live, other):
        f.write_bytes(b"x" * 10)
    assert remove_dead_writers_tmp(tmp_path, min_age_s=60) == 0 and gone.exists()  # too young for a sweep at start
    os.utime(gone, (time.time() - 120, time.time() - 120))
    assert remove_dead_writers_tmp(tmp_path, min_age_s=60) == 1
    assert not gone.exists() and live.exists() and other.exists()
    from eagle3kit.capture.format import _tmp_name, _tmp_writer_pid  # the sweep reads the name the writer makes
    assert _tmp_writer_pid(_tmp_name(tmp_path / "s0000001.rank0.safetensors")) == me
    assert _tmp_writer_pid(other) is None and _tmp_writer_pid(tmp_path / ".manifest.jsonl.tmp") is None


def test_a_resume_removes_a_stopped_writers_half_written_file(tmp_path, extracted, samples, reference, target_path,
                                                             capsys):
    src, _ = extracted
    out = tmp_path / "copy"
    shutil.copytree(src, out)
    left = out / "samples" / f".s0000999.rank0.safetensors.{_dead_pid()}.7.tmp"
    left.write_bytes(b"\0" * 4096)
    os.utime(left, (time.time() - 600, time.time() - 600))
    again = extract(samples, out, ReferenceBackend(reference), settings(target_path), progress=False)
    assert again["already_done"] == len(samples) and not left.exists()
    assert "removed 1 half-written temporary files" in capsys.readouterr().out


def test_stopping_the_capture_server_removes_what_it_was_writing(tmp_path):
    """The extraction stops its own server (disk full, interrupted): the sample that server was writing stays
    half-written under its temporary name unless the backend sweeps once the server is gone."""
    from eagle3kit.extract import SGLangBackend

    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    left = tmp_path / f".s0000311.rank0.safetensors.{writer.pid}.3.tmp"
    left.write_bytes(b"\0" * 4096)

    class Server:  # stands in for capture.server.Server: stop() ends the process that was writing
        url = "http://127.0.0.1:1"

        def stop(self):
            writer.kill()
            writer.wait()

    b = SGLangBackend([], start_server=Server)
    b.prepare()
    b.close(tmp_path)
    assert not left.exists()


def test_all_finite_agrees_with_torch_on_every_bf16_bit_pattern():
    """verify's finite-value check reads bf16 bits (exponent all ones: inf or NaN); on all 65,536 bf16 values, one
    at a time among finite ones, it says what torch.isfinite says, and it is torch.isfinite for other dtypes."""
    from eagle3kit.store import all_finite

    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    want = torch.isfinite(every)
    base = torch.ones(3, 5, dtype=torch.bfloat16)
    got = []
    for v in every:
        x = base.clone()
        x[1, 2] = v
        got.append(all_finite(x))
    assert torch.tensor(got).equal(want) and int((~want).sum()) == 2 * 128  # exponent all ones: +-inf, 254 NaNs
    assert all_finite(every[want]) and not all_finite(every)
    assert all_finite(torch.zeros(0, dtype=torch.bfloat16))
    assert not all_finite(torch.tensor([1.0, float("nan")])) and all_finite(torch.tensor([1.0, 3e38]))
    assert not all_finite(torch.ones(4, 4, dtype=torch.bfloat16).t()[1:, :].clone().t().contiguous().fill_(float("inf")))
