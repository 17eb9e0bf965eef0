"""GPU fault records (#12): a real SGLang capture server under load, and killed with SIGKILL mid-extraction.

Run on the GPU machine with ``scripts/gpu_record.sh faults`` (skipped without CUDA and SGLang). Each test adds its
figures to ``$E3K_TEST_OUT/metrics.json`` (load_requests, load_mismatches, load_missing; kill_lost,
kill_duplicated, kill_verified), so the record holds what ran, and asserts them.
  * load: 256 requests in flight at once, lengths drawn at random up to the target's context limit (real ShareGPT
    text, conversations joined until the drawn length), every captured token of every slot compared with the
    transformers reference on the GPU against bf16-calibrated bounds, raised at each request's own bf16-fragile
    tokens (spec.token_bounds): 0 missing, 0 mismatched.
  * kill -9: ``eagle3kit extract --engine sglang`` (its own server), the server's process group killed with SIGKILL
    once some samples are done, then the same command again: every sample exactly once, the ones done before the
    kill unchanged, the data set verified.
  * disk full: the same extraction into a tmpfs that another writer fills once some samples are done: SGLang's own
    writer fails its writes, the extraction stops within seconds with its disk-full report (exit 1, no temporary
    file left), and once the space is freed the same command completes: nothing lost, nothing twice, verified.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
SERVER_ARGS = os.environ.get("E3K_SERVER_ARGS", "--attention-backend triton --sampling-backend pytorch "
                             "--mem-fraction-static 0.25").split()
LOAD_REQUESTS = int(os.environ.get("E3K_LOAD_REQUESTS", "256"))
LOAD_SEED = 11  # benchmarks/bf16_fragility.py --seed 11 rebuilds the same prompts on a CPU


def _record(**figures) -> None:
    from eagle3kit.metrics import update_json

    update_json(Path(os.environ.get("E3K_TEST_OUT", ".")) / "metrics.json", figures)
    print(figures, flush=True)


def test_load_256_in_flight_random_lengths_to_the_context_limit(tmp_path, tokenizer, target_path):
    from eagle3kit.capture.client import CaptureClient
    from eagle3kit.capture.reference import ReferenceEngine
    from eagle3kit.capture.server import capture_server
    from eagle3kit.capture.format import read_sample
    from eagle3kit.spec import (bf16_engine, calibrate_bounds, calibration_set, compare_to_reference, load_prompts,
                                negative_controls, prompt_bounds)

    context = json.loads((Path(target_path) / "config.json").read_text())["max_position_embeddings"]
    prompts = load_prompts(tokenizer, LOAD_REQUESTS, context - 8, seed=LOAD_SEED)
    lengths = [len(v) for v in prompts.values()]
    s = capture_server(target_path, tmp_path / "captures", [2, 15, 27], port=30950, final_normed=True,
                       extra_args=SERVER_ARGS + ["--max-running-requests", str(LOAD_REQUESTS)],
                       log_path=tmp_path / "sglang.log")
    with s:
        client = CaptureClient(s.url, s.capture["capture_dir"])
        t0 = time.time()
        markers = client.capture_many(prompts.items(), concurrency=LOAD_REQUESTS)
        seconds = time.time() - t0
        status = client.status()["rank0"]
    missing = [m["key"] for m in markers if m["status"] != "ok"]
    ok = {k: v for k, v in prompts.items() if k not in missing}
    ref = ReferenceEngine(target_path, [2, 15, 27], final_normed=True, device="cuda")
    b16 = bf16_engine(ref)  # each request's bounds are raised at its own bf16-fragile tokens (spec.token_bounds)
    bounds = calibrate_bounds(ref, calibration_set(ok, 8), b16=b16)
    rows, mismatched, worst, raised, checked = [], set(), 0.0, 0, 0
    keys = list(ok)
    caught = {}  # the check's negative controls on the load's own captures: each mistake made from 8 of them
    for k0, k1 in zip(keys[:8], keys[1:9]):
        cap0, _ = read_sample(Path(s.capture["capture_dir"]) / f"{k0}.rank0.safetensors")
        cap1, _ = read_sample(Path(s.capture["capture_dir"]) / f"{k1}.rank0.safetensors")
        r0 = ref.hidden(ok[k0])
        for name, failed in negative_controls(cap0, cap1, ok[k0], ref, r0, prompt_bounds(bounds, ok[k0], r0, b16)).items():
            caught[f"{k0}: {name}"] = bool(failed)
    for a in range(0, len(keys), 16):  # a slice at a time: the captures of 256 long prompts are GBs
        part = {k: ok[k] for k in keys[a:a + 16]}
        for r in compare_to_reference(s.capture["capture_dir"], part, ref, bounds, b16=b16):
            worst = max(worst, r["token_worst_err"])
            raised, checked = raised + r.get("tokens_raised", 0), checked + r["n_tokens"]
            if not r["ok"]:
                mismatched.add(r["key"])
                rows.append(r)
        for k in part:
            (Path(s.capture["capture_dir"]) / f"{k}.rank0.safetensors").unlink(missing_ok=True)
    _record(load_requests=len(prompts), load_in_flight=LOAD_REQUESTS, load_tokens=sum(lengths),
            load_max_prompt_tokens=max(lengths), load_min_prompt_tokens=min(lengths), load_context_limit=context,
            load_seconds=round(seconds, 1), load_missing=len(missing), load_mismatches=len(mismatched),
            negative_controls_total=len(caught), negative_controls_caught=sum(caught.values()),
            load_worst_token_rel_err=worst, load_bound_raised_fraction=raised / max(1, checked), load_bounds={str(k): v for k, v in bounds.items()}, load_hook_errors=status["counts"].get("errors", 0))
    assert not missing, [m for m in markers if m["status"] != "ok"][:5]
    assert not mismatched, rows[:5]
    assert all(caught.values()), [k for k, v in caught.items() if not v]
    assert max(lengths) > context // 2 and status["counts"].get("errors", 0) == 0


def _server_group(pid: int) -> int | None:
    """The process group of the SGLang server an ``eagle3kit extract`` process started (its own session)."""
    import psutil

    for c in psutil.Process(pid).children(recursive=True):
        try:
            if "sglang.launch_server" in " ".join(c.cmdline()):
                return os.getpgid(c.pid)
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
    return None


def test_kill9_server_mid_extraction_then_resume(tmp_path):
    from eagle3kit.store import read_manifest, verify

    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "eagle3kit.cli", "extract", "--engine", "sglang", "--out", str(out),
           "--max-samples", "600", "--max-tokens", "1024", "--concurrency", "8", "--port", "30960",
           "--server-args", *SERVER_ARGS]
    log = open(tmp_path / "first.log", "w")
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline, group = time.time() + 600, None
    while time.time() < deadline and p.poll() is None and len(read_manifest(out)) < 40:
        time.sleep(0.05)
    group = _server_group(p.pid)
    assert p.poll() is None and group is not None, "extraction ended before the kill (log: first.log)"
    os.killpg(group, signal.SIGKILL)
    killed_at = len(read_manifest(out))
    before = {k: e["checksum"] for k, e in read_manifest(out).items()}
    try:
        first_rc = p.wait(300)  # the client sees the server gone and stops (CaptureClient.unreachable)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        first_rc = "hung: killed after 300 s"
    log.close()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    (tmp_path / "second.log").write_text(r.stdout[-20000:] + r.stderr[-20000:])
    m = json.loads((out / "metrics.json").read_text()) if (out / "metrics.json").exists() else {}
    lines = [json.loads(x) for x in (out / "manifest.jsonl").read_text().splitlines() if x.strip()]
    keys = [e["key"] for e in lines]
    after = read_manifest(out)
    expected = m.get("dataset_samples", 0)
    report = verify(out)
    _record(kill_done_before=killed_at, kill_client_exit=first_rc, kill_resume_exit=r.returncode,
            kill_samples=expected, kill_lost=max(0, expected - len(set(keys))) + sum(k not in after for k in before),
            kill_duplicated=len(keys) - len(set(keys)), kill_changed=sum(after[k]["checksum"] != h for k, h in before.items()
                                                                         if k in after),
            kill_verified=bool(report.passed), kill_already_done=m.get("already_done"), kill_written=m.get("written"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert 0 < killed_at < expected and len(keys) == len(set(keys)) == expected
    assert all(k in after and after[k]["checksum"] == h for k, h in before.items())
    assert report.passed


def test_disk_full_under_the_servers_writer_then_resume(tmp_path):
    from eagle3kit.store import read_manifest, verify
    from tests.conftest import fill_disk, tmpfs

    with tmpfs(tmp_path / "fs", "4g") as fs:
        out, filler = fs / "data", fs / "filler"
        cmd = [sys.executable, "-m", "eagle3kit.cli", "extract", "--engine", "sglang", "--out", str(out),
               "--max-samples", "600", "--max-tokens", "1024", "--concurrency", "8", "--port", "30961",
               "--server-args", *SERVER_ARGS]
        log = open(tmp_path / "first.log", "w")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 600
        while time.time() < deadline and p.poll() is None and len(read_manifest(out)) < 40:
            time.sleep(0.05)
        assert p.poll() is None, "extraction ended before the disk filled (log: first.log)"
        full_at, t_full = len(read_manifest(out)), time.time()
        fill_disk(filler)
        try:
            first_rc = p.wait(600)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            first_rc = "hung: killed after 600 s"
        stop_s = time.time() - t_full
        log.close()
        first = (tmp_path / "first.log").read_text()
        kept = read_manifest(out)
        tmp_left = [str(x) for x in fs.rglob("*.tmp")]
        filler.unlink()  # space freed: the same command resumes
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        (tmp_path / "second.log").write_text(r.stdout[-20000:] + r.stderr[-20000:])
        m = json.loads((out / "metrics.json").read_text()) if (out / "metrics.json").exists() else {}
        keys = [json.loads(x)["key"] for x in (out / "manifest.jsonl").read_text().splitlines() if x.strip()]
        after, expected, report = read_manifest(out), m.get("dataset_samples", 0), verify(out)
        lost = max(0, expected - len(set(keys))) + sum(k not in after for k in kept)
        _record(diskfull_done_before=full_at, diskfull_client_exit=first_rc, diskfull_seconds_to_stop=round(stop_s, 1),
                diskfull_kept=len(kept), diskfull_tmp_left=len(tmp_left), diskfull_resume_exit=r.returncode,
                diskfull_samples=expected, diskfull_lost=lost, diskfull_duplicated=len(keys) - len(set(keys)),
                diskfull_verified=bool(report.passed))
        rec = Path(os.environ.get("E3K_TEST_OUT", tmp_path))
        for name in ("first.log", "second.log"):  # the record keeps what the user saw
            (rec / f"diskfull-{name}").write_text((tmp_path / name).read_text()[-20000:])
        assert first_rc == 1 and "the disk is full" in first and "Traceback" not in first, first[-3000:]
        assert stop_s < 120, stop_s  # not 600 s per request in flight
        assert not tmp_left, tmp_left
        assert r.returncode == 0, r.stderr[-3000:]
        assert len(keys) == len(set(keys)) == expected
        assert all(after[k]["checksum"] == e["checksum"] for k, e in kept.items())
        assert report.passed


def test_an_exception_in_the_hook_fails_its_requests_and_the_retry_captures_them(tmp_path, tokenizer, target_path):
    """An exception raised inside the capture hook in SGLang's scheduler (``fail_keys_once``: the first forward
    holding one of 3 keys raises, as a bug would): the server keeps serving, the requests of that forward are failed at
    once with the hook's error, the extraction's retry pass captures them, and the data set verifies."""
    import requests

    from eagle3kit.capture.client import CaptureClient
    from eagle3kit.capture.server import capture_server
    from eagle3kit.extract import SGLangBackend, extract, load_samples, settings_for
    from eagle3kit.store import verify
    from eagle3kit.target import TargetInfo

    samples, _ = load_samples("embedded:sharegpt", tokenizer, 48, 512)
    fail = [samples[i].key for i in (3, 17, 30)]
    out = tmp_path / "d"
    info = TargetInfo.read(target_path)
    s = capture_server(target_path, out / "samples", [2, 15, 27], port=30970, extra_args=SERVER_ARGS,
                       log_path=tmp_path / "sglang.log", fail_keys_once=fail)
    with s:
        summary = extract(samples, out, SGLangBackend([s.url], 16),
                          settings_for(target_path, info, [2, 15, 27, 30], "bf16", "embedded:sharegpt", 512),
                          progress=False)
        health = requests.get(s.url + "/health", timeout=60).status_code
        status = CaptureClient(s.url, out / "samples").status()["rank0"]
    rep = verify(out)
    _record(hook_fault_keys=len(fail), hook_fault_errors=status["counts"].get("errors", 0),
            hook_fault_retried=summary["retried"], hook_fault_failed=summary["failed"],
            hook_fault_health_after=health, hook_fault_verified=rep.ok, hook_fault_samples=len(samples))
    assert health == 200 and status["counts"].get("errors", 0) >= 1 and "injected fault" in status["last_error"]
    assert summary["retried"] >= len(fail) and summary["failed"] == 0
    assert rep.passed and rep.ok == len(samples)
