"""benchmarks/train_throughput.py on the CPU with the small captured data set: both passes run in their own
processes, the table and metrics.json come out; speculators' trainer either gives a figure or a reported error. The
step alone (compute) runs in the second test's benchmark only: a pass left out of one run and run in the other."""
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_train_benchmark_runs_on_cpu(small_dataset, tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "train_throughput.py"), "--data", str(small_dataset), "--out",
           str(out), "--device", "cpu", "--steps", "3", "--rounds", "1", "--tokens-per-batch", "256", "--workers", "0",
           "--timeout-s", "600", "--set", "draft_vocab_size=512", "--set", "ttt_steps=2", "--set", "serving_steps=2",
           "--passes", "eagle3kit,speculators"]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    m = json.loads((out / "metrics.json").read_text())
    assert m["train_tokens_per_s_alone"] > 0 and len(m["train_tokens_per_s_rounds"]) == m["rounds"] == 1
    detail = m["eagle3kit_rounds_detail"][0]
    assert detail["steps"] == 3 and detail["warmup_steps_left_out"] == 2 and 0 < detail["tokens"] <= 256
    assert 0 <= detail["data_wait_fraction"] < 1 and m["loader_tokens_per_s"] > 0
    assert m["train_step_alone_tokens_per_s"] is None  # the step alone left out: never started
    assert not [p.name for p in (out / "logs").iterdir() if p.name.startswith("compute")]
    if m["speculators_tokens_per_s"] is None:  # e.g. its trainer's imports (httpx) missing in this environment
        assert m["speculators_error"] and m["train_vs_speculators_ratio"] is None
    else:
        assert m["train_vs_speculators_ratio"] == pytest.approx(
            m["train_tokens_per_s_alone"] / m["speculators_tokens_per_s"])
        assert m["speculators_rounds_detail"][0]["steps"] == 3
    assert "ratio eagle3kit / speculators" in (out / "bench.log").read_text()


@pytest.mark.slow
def test_train_benchmark_ab_runs_both_configurations_in_each_round(small_dataset, tmp_path):
    """--ab: a pass again with other settings, interleaved in the same rounds; --passes: a pass left out is never
    started (here only the step alone runs, with and without the second configuration)."""
    out = tmp_path / "bench"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "train_throughput.py"), "--data", str(small_dataset), "--out",
           str(out), "--device", "cpu", "--steps", "3", "--rounds", "1", "--tokens-per-batch", "256", "--workers", "0",
           "--set", "draft_vocab_size=512", "--set", "ttt_steps=2", "--set", "serving_steps=2",
           "--ab", "rows_per_batch=2", "--passes", "compute"]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    m = json.loads((out / "metrics.json").read_text())
    assert m["ab_settings"] == ["rows_per_batch=2"] and m["train_step_alone_tokens_per_s_ab"] > 0
    assert m["train_step_alone_tokens_per_s"] > 0 and m["speculators_tokens_per_s"] is None
    step_alone = m["compute_rounds_detail"][0]  # the step on batches already loaded, with its profile table
    assert step_alone["steps"] == 3 and "by host time" in (out / "logs" / step_alone["profile"]).read_text(), step_alone
    assert m["train_tokens_per_s_alone"] is None and m["train_tokens_per_s_ab"] is None  # eagle3kit's pass left out
    assert "speculators_error" not in m and not (out / "speculators_data").exists()
    # the second configuration really ran with its settings: two packed rows per step, against one
    assert m["compute_ab_rounds_detail"][0]["tokens"] > m["compute_rounds_detail"][0]["tokens"]
    log = (out / "bench.log").read_text()
    assert "compute-ab" in log and "compute / compute-ab (with rows_per_batch=2 over the same settings)" in log
    left_out = [p.name for p in (out / "logs").iterdir() if p.name.startswith(("speculators", "eagle3kit"))]
    assert not left_out, left_out  # never started
    bad = subprocess.run(cmd[:-1] + ["eagle3kit,speculator"], env=env, capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "--passes eagle3kit,speculator: choose among" in bad.stderr
