"""benchmarks/live_train.py's summaries of GPU phases, on files laid out as those phases leave them."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import live_train  # noqa: E402


def _run(tmp_path, train: dict, accept: dict | None, rows: list[dict]):
    run, data = tmp_path / "run", tmp_path / "data"
    (run / "04_train").mkdir(parents=True)
    (run / "04_train" / "metrics.json").write_text(json.dumps(train))
    if accept is not None:
        (run / "05_acceptance").mkdir()
        (run / "05_acceptance" / "metrics.json").write_text(json.dumps(accept))
    data.mkdir()
    (data / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run, data


def test_scale_sets_the_live_run_beside_the_disk(tmp_path):
    run, data = _run(tmp_path, {"live_distinct_samples": 300, "heldout_tau_3": 2.5, "train_steps": 10,
                                "live_hidden_state_bytes_on_disk": 0},
                     {"steps3_accept_length": 2.4, "steps7_accept_length": 2.9, "steps5_accept_length": 9.0},
                     # a resumed extraction wrote sample b twice: its last line counts, once
                     [{"key": "a", "bytes": 1_000_000}, {"key": "b", "bytes": 3_000_000},
                      {"key": "b", "bytes": 3_000_000}])
    import shutil
    room = shutil.disk_usage(str(tmp_path)).free + 4_000_000
    res = live_train.scale(run, data, disk=str(tmp_path))
    assert res["file_bytes_per_sample"] == 2_000_000 and res["file_bytes_per_sample_from"] == 2
    assert abs(res["disk_capacity_samples"] - room // 2_000_000) <= 1  # free space moves a little meanwhile
    assert res["live_distinct_samples_as_files_gb"] == pytest.approx(0.6)
    assert res["live_distinct_over_disk_capacity"] == pytest.approx(300 / (room // 2_000_000), rel=1e-3)
    assert (res["accept_length_3_1_4"], res["accept_length_7_1_8"]) == (2.4, 2.9)
    assert "accept_length_5_1_6" not in res  # only the two settings the issue names
    assert json.loads((run / "metrics.json").read_text())["live_distinct_samples"] == 300


def test_scale_refuses_a_run_that_did_not_train_live_or_an_empty_extraction(tmp_path):
    run, data = _run(tmp_path, {"heldout_tau_3": 2.5}, None, [{"key": "a", "bytes": 1}])
    with pytest.raises(SystemExit, match="live_distinct_samples"):
        live_train.scale(run, data)
    (run / "04_train" / "metrics.json").write_text(json.dumps({"live_distinct_samples": 3}))
    (data / "manifest.jsonl").write_text("")
    with pytest.raises(SystemExit, match="no samples"):
        live_train.scale(run, data)
