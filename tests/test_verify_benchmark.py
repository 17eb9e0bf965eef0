"""benchmarks/verify_throughput.py, small: the data set it writes is one `verify` passes (every sample ok), its
table covers every worker count with every round, and a data set that fails verification stops it with the
problems instead of a figure."""
import json
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_the_verify_benchmark_prints_every_round_and_refuses_a_broken_data_set(tmp_path, capsys, monkeypatch):
    import verify_throughput as vt

    m = vt.main(["--samples", "6", "--tokens", "64", "--rounds", "2", "--workers", "1", "3", "--dir",
                 str(tmp_path / "d"), "--out", str(tmp_path / "o")])
    assert len(m["verify_w1_seconds_rounds"]) == 2 and len(m["verify_w3_seconds_rounds"]) == 2
    # each figure is the one its rounds give: bytes over the median round, the spread, and the speedup of 3 workers
    # over the first setting's median (the first setting's own speedup is 1 by definition: not a check)
    med = {w: statistics.median(m[f"verify_w{w}_seconds_rounds"]) for w in (1, 3)}
    for w in (1, 3):
        rounds = m[f"verify_w{w}_seconds_rounds"]
        assert m[f"verify_w{w}_gb_per_s"] == pytest.approx(m["verify_bytes"] / med[w] / 1e9)
        assert m[f"verify_w{w}_spread"] == pytest.approx((max(rounds) - min(rounds)) / med[w])
    assert med[1] != med[3] and m["verify_w3_speedup"] == pytest.approx(med[1] / med[3])
    assert m["verify_bytes"] > 6 * 64 * 576 * 2  # six samples of 64 tokens, more than one bf16 slot of hidden 576
    assert json.loads((tmp_path / "o" / "metrics.json").read_text())["verify_samples"] == 6
    assert "workers" in capsys.readouterr().out and not (tmp_path / "d").exists()  # its data set is removed

    real = vt.make_dataset

    def broken(d, *a, **k):  # one sample's bytes changed after its checksum was taken
        n = real(d, *a, **k)
        f = sorted((d / "samples").glob("*.safetensors"))[2]
        b = f.read_bytes()
        f.write_bytes(b[:-1] + bytes([b[-1] ^ 0xFF]))
        return n
    monkeypatch.setattr(vt, "make_dataset", broken)
    with pytest.raises(SystemExit, match="checksum"):
        vt.main(["--samples", "4", "--tokens", "32", "--rounds", "1", "--workers", "1", "--dir", str(tmp_path / "e")])
