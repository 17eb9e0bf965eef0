"""The capture benchmark's figures (benchmarks/extract_throughput.py, #13) from its passes' rounds: ratios within
a round, their median and spread; the physical limit is whichever of SGLang's own prefill and the disk's durable
bandwidth binds; a failed pass never counts. (The passes themselves need the GPU: scripts/gpu_record.sh bench.)"""
import json
import math
import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from extract_throughput import summarize_rounds  # noqa: E402


def _runs(nan_round=None):
    runs = {"plain_default_conc64": [400.0, 380.0, 420.0], "plain_default_conc256": [410.0, 390.0, 400.0],
            "plain_conc64": [380.0, 370.0, 400.0], "plain_conc256": [360.0, 350.0, 390.0],
            "capture_bf16_conc64": [300.0, 290.0, 336.0], "capture_bf16_conc256": [310.0, 285.0, 330.0],
            "durable_bf16_conc64": [200.0, 190.0, 210.0], "durable_bf16_conc256": [180.0, 170.0, 220.0],
            "serial": [20.0, 25.0, 21.0]}
    if nan_round is not None:
        runs["capture_bf16_conc64"][nan_round] = runs["capture_bf16_conc256"][nan_round] = float("nan")
    return runs


def test_ratios_are_taken_per_round_and_reported_with_their_spread():
    r = summarize_rounds(_runs(), 3, [64, 256], ["bf16"], disk_bytes_per_s=1e12, bytes_per_token={"bf16": 5000})
    per_round = [310 / 410, 290 / 390, 336 / 420]  # each round's best concurrency, capture over plain (defaults)
    assert r["ratio_vs_plain_default"] == pytest.approx(sorted(per_round)[1])
    assert r["ratio_spread"] == pytest.approx((max(per_round) - min(per_round)) / sorted(per_round)[1])
    assert r["ratio_vs_plain_default_rounds"] == " ".join(f"{v:.3f}" for v in per_round)
    assert r["ratio_vs_serial_fair"] == pytest.approx(sorted([310 / 20, 290 / 25, 336 / 21])[1])
    assert r["capture_limit_bf16_binds"] == "prefill" and r["rounds"] == 3  # a fast disk: the server binds
    assert r["durable_ratio_vs_limit_bf16"] == pytest.approx(sorted([200 / 410, 190 / 390, 220 / 420])[1])


def test_a_slow_disk_is_the_limit_and_a_failed_round_does_not_count():
    r = summarize_rounds(_runs(nan_round=1), 3, [64, 256], ["bf16"], disk_bytes_per_s=1e6,
                         bytes_per_token={"bf16": 5000})
    assert r["capture_limit_bf16_binds"] == "disk" and r["capture_limit_bf16_tokens_per_s"] == pytest.approx(200)
    assert r["durable_ratio_vs_limit_bf16"] == pytest.approx(sorted([1.0, 0.95, 1.1])[1])
    assert len(r["ratio_vs_plain_default_rounds"].split()) == 2  # round 1's capture failed: two ratios, not three
    assert not math.isnan(r["ratio_vs_plain_default"])


def test_the_writer_benchmark_merges_under_names_of_its_own():
    """bench merges the writer's figures at hidden 7168 into the capture benchmark's metrics.json: on the GPU
    (2026-12-01) the writer's bytes_per_token (57,352 at 4 slots x 7168) overwrote the capture's (4,616)."""
    from writer_throughput import merged_names

    res = {"bytes_per_token": 57352.0, "samples": 40, "storage": "bf16", "hidden": 7168,
           "writer_gb_per_s": 2.0, "writer_gb_per_s_h7168": 1.1, "kimi_10k_samples_gb_bf16": 924.0}
    m = merged_names(res, "bf16")
    assert m == {"writer_bytes_per_token_bf16": 57352.0, "writer_samples_bf16": 40, "writer_storage": "bf16",
                 "writer_hidden": 7168, "writer_gb_per_s_bf16": 2.0, "writer_gb_per_s_h7168": 1.1,
                 "kimi_10k_samples_gb_bf16": 924.0}
    capture_keys = {"bytes_per_token_bf16", "bytes_per_token_fp8", "storage", "hidden", "extract_storage"}
    assert not capture_keys & set(m)


def test_a_run_cut_by_its_limit_is_summarized_from_its_complete_rounds():
    """gpu-benchmark-cut-21 (2026-12-03): the phase's limit cut the run in round 1 of 3, before its disk was measured.
    The printed rounds give its figures: round 1's passes are dropped (the missing ones would have run in another spell
    of the machine), and with no disk figure there are no limits, only durable over SGLang's defaults (a lower bound of
    durable over the limit, which is at most the prefill)."""
    from extract_throughput import runs_from_log

    log = ["target /root/x", "  round 0 plain_default conc64: 400,000", "  round 0 plain conc64: 300,000",
           "  round 0 serial (200 random prompts): 80,000", "  round 0 hooked_no_capture conc64: 299,000",
           "  round 0 capture bf16 conc64: 280,000", "  round 0 capture bf16 conc64 durable: 279,000",
           "  round 0 capture fp8 conc64: 290,000", "  round 0 capture fp8 conc64 durable: 288,000",
           "  round 1 plain_default conc64: 500,000", "  round 1 plain conc64: 310,000", "Traceback (most recent ...",
           "KeyboardInterrupt"]
    runs, complete = runs_from_log(log)
    assert complete == 1 and runs["plain_default_conc64"] == [400_000.0] and runs["durable_fp8_conc64"] == [288_000.0]
    assert runs["serial"] == [80_000.0] and runs["hooked_no_capture_conc64"] == [299_000.0]
    r = summarize_rounds(runs, complete, [64], ["bf16", "fp8"], None, {})
    assert r["ratio_vs_plain_default"] == pytest.approx(0.7) and r["rounds"] == 1
    assert r["durable_ratio_vs_plain_default_bf16"] == pytest.approx(279 / 400)
    assert r["durable_ratio_vs_plain_default_fp8"] == pytest.approx(288 / 400)
    assert not any(k.startswith(("capture_limit", "durable_ratio_vs_limit")) for k in r)  # no disk figure: no limit
    with_disk = summarize_rounds(runs, complete, [64], ["bf16"], 1e6, {"bf16": 5000})  # a disk figure: the limit too
    assert with_disk["durable_ratio_vs_limit_bf16"] == pytest.approx(279_000 / 200) and with_disk[
        "durable_ratio_vs_plain_default_bf16"] == r["durable_ratio_vs_plain_default_bf16"]
    for cut in (2, 5):  # round 0 itself cut, before the serial pass or before any capture: nothing to summarize
        assert runs_from_log(log[:cut])[1] == 0
    with pytest.raises(ValueError, match="no round lines"):
        runs_from_log(["Traceback", "KeyboardInterrupt"])


def test_the_rounds_cut_by_sigint_keep_the_complete_ones():
    """The benchmark's own loop (complete_rounds): SIGINT in round 1 of 3 keeps round 0 whole and drops round 1's
    passes already run; SIGINT in round 0 measured nothing and goes on; an uncut run keeps every round."""
    from extract_throughput import complete_rounds

    def rounds_cut_at(cut_round, cut_after_passes):
        runs: dict = {}

        def run_round(r):
            for i, name in enumerate(("plain_default_conc64", "capture_bf16_conc64", "serial")):
                if r == cut_round and i == cut_after_passes:
                    raise KeyboardInterrupt
                runs.setdefault(name, []).append(100.0 * (r + 1) + i)
        return run_round, runs

    run_round, runs = rounds_cut_at(1, 2)
    kept, n, cut = complete_rounds(run_round, 3, runs)
    assert (n, cut) == (1, True) and kept == {"plain_default_conc64": [100.0], "capture_bf16_conc64": [101.0],
                                              "serial": [102.0]}
    run_round, runs = rounds_cut_at(0, 1)
    with pytest.raises(KeyboardInterrupt):
        complete_rounds(run_round, 3, runs)
    run_round, runs = rounds_cut_at(None, None)
    kept, n, cut = complete_rounds(run_round, 3, runs)
    assert (n, cut) == (3, False) and kept["serial"] == [102.0, 202.0, 302.0]


def test_each_pass_is_reported_by_its_best_median_and_rounds_a_failed_one_counting_in_neither():
    from extract_throughput import pass_figures

    f = pass_figures({"capture_bf16_conc64": [300.0, float("nan"), 200.0], "serial": [float("nan")]})
    assert f["capture_bf16_conc64_tokens_per_s"] == 300.0 and f["capture_bf16_conc64_median_tokens_per_s"] == 250.0
    assert f["capture_bf16_conc64_rounds"] == "300 nan 200"
    assert f["serial_tokens_per_s"] == 0.0 == f["serial_median_tokens_per_s"]


def test_the_goals_per_stored_format_come_from_the_pass_that_stored_it():
    """#13's goals name the stored format (durable_ratio_vs_limit_bf16, _fp8). A run of the graph passes alone
    (graph: bf16, graphfp8: fp8, both with SGLang's prefill graph on) reports them from those passes, each with its
    own limit (fp8's files are smaller, so a slow disk binds bf16 and not fp8), and names the pass; where the
    layer-hook pass of a format ran too, that format's keys stay the layer-hook pass's."""
    base = _runs()
    runs = {k: v for k, v in base.items() if not k.startswith(("capture_bf16", "durable_bf16"))}
    for st, scale in (("graph", 1.2), ("graphfp8", 1.1)):
        for kind in ("capture", "durable"):
            for c in (64, 256):
                runs[f"{kind}_{st}_conc{c}"] = [scale * v for v in base[f"{kind}_bf16_conc{c}"]]
    bpt = {"graph": 5000, "graphfp8": 3000}
    r = summarize_rounds(runs, 3, [64, 256], ["graph", "graphfp8"], disk_bytes_per_s=1.5e6, bytes_per_token=bpt)
    assert r["capture_limit_graph_binds"] == "disk" and r["capture_limit_graphfp8_binds"] == "prefill"
    assert r["durable_ratio_vs_limit_bf16_pass"] == "graph" and r["durable_ratio_vs_limit_fp8_pass"] == "graphfp8"
    assert r["durable_ratio_vs_limit_bf16"] == r["durable_ratio_vs_limit_graph"] == pytest.approx(1.2 * 200 / 300)
    assert r["durable_ratio_vs_limit_fp8"] == pytest.approx(sorted(1.1 * d / p for d, p in
                                                                   ((200, 410), (190, 390), (220, 420)))[1])
    assert r["durable_ratio_vs_limit_fp8_spread"] == r["durable_ratio_vs_limit_graphfp8_spread"]
    assert "durable_ratio_vs_limit_bf16_pass" not in summarize_rounds(runs, 3, [64, 256], ["graph"], None, {})
    assert r["ratio_vs_plain_default"] == r["ratio_vs_plain_default_graph"]  # the first pass named: the graph's
    both = summarize_rounds({**runs, **base}, 3, [64, 256], ["bf16", "graph"], 1.5e6, {"bf16": 5000, "graph": 5000})
    assert both["durable_ratio_vs_limit_bf16_pass"] == "bf16" and "durable_ratio_vs_limit_fp8" not in both
    assert both["durable_ratio_vs_limit_bf16"] == pytest.approx(200 / 300)


def test_the_disk_limit_is_its_writeback_rate_when_write_then_sync_understates_it(tmp_path):
    """gpu-benchmark-graph-fp8 (H100, 2026-12-05): 8.6 GB written in 1.2 s then synced in 4.3 s gave 1.54 GB/s
    write-then-sync, and durable graph capture ran at 1.17-1.25x that: the buffered phase had the disk idle. The limit
    is the larger of that and the sync phase alone; a run's log re-read with its metrics.json's disk figures gets it."""
    from disk_write import limit_bytes_per_s
    from extract_throughput import main

    disk = {"disk_files": 1374, "disk_file_bytes": 6248400, "disk_durable_bytes_per_s": 1.542e9,
            "disk_sync_seconds": 4.321}
    assert limit_bytes_per_s(disk) == pytest.approx(1374 * 6248400 / 4.321)
    assert limit_bytes_per_s({**disk, "disk_sync_seconds": 60.0}) == 1.542e9  # a slow sync: write-then-sync stands
    log = tmp_path / "bench.log"
    log.write_text("\n".join(["  round 0 plain_default conc64: 500,000", "  round 0 plain conc64: 300,000",
                              "  round 0 serial (200 random prompts): 50,000",
                              "  round 0 capture graph conc64: 420,000", "  round 0 capture graph conc64 durable: 418,000",
                              "  round 0 capture graphfp8 conc64: 400,000",
                              "  round 0 capture graphfp8 conc64 durable: 395,000"]))
    (tmp_path / "metrics.json").write_text(json.dumps({**disk, "bytes_per_token_bf16": 4616.0,
                                                       "bytes_per_token_fp8": 2900.0, "writer_gb_per_s_h7168": 1.2}))
    assert main(["--summarize-log", str(log), "--out", str(tmp_path)]) == 0
    m = json.loads((tmp_path / "metrics.json").read_text())
    limit = limit_bytes_per_s(disk) / 4616
    assert m["capture_limit_graph_binds"] == "disk" and m["durable_ratio_vs_limit_bf16"] == pytest.approx(418e3 / limit)
    assert m["durable_ratio_vs_limit_fp8"] == pytest.approx(395 / 500) and m["writer_gb_per_s_h7168"] == 1.2
    assert "durable_ratio_vs_limit_bf16fp8" not in m  # graph's keys are not graphfp8's


def test_the_writer_ab_takes_variants_apart_and_ratios_each_round_against_the_first():
    """benchmarks/writer_ab.py: capitals NAME=VALUE go to the environment, the rest to writer_throughput; each
    variant's durable ratio is taken within its round against the first variant; a malformed variant is refused."""
    from writer_ab import parse_variant, summarize

    assert parse_variant('xxh3-8=--checksum xxh3_128 --io-threads 8 E3K_EARLY_WRITEBACK=0') == \
        ("xxh3-8", ["--checksum", "xxh3_128", "--io-threads", "8"], {"E3K_EARLY_WRITEBACK": "0"})
    for bad in ("no equals sign", "bad name=--io-threads 8"):
        with pytest.raises(ValueError, match="NAME="):
            parse_variant(bad)
    f = lambda page, durable: {"writer_gb_per_s": page, "writer_durable_gb_per_s": durable}  # noqa: E731
    runs = {"sha": [f(1.0, 0.8), f(2.0, 1.0), f(1.0, 0.5)], "xxh": [f(1.5, 1.2), f(2.0, 1.1), f(1.0, 0.9)]}
    r = summarize(runs)
    assert r["ab_baseline"] == "sha" and r["ab_rounds"] == 3
    assert r["ab_durable_ratio_xxh_vs_sha_rounds"] == "1.500 1.100 1.800"
    assert r["ab_durable_ratio_xxh_vs_sha"] == pytest.approx(1.5)
    assert r["ab_durable_ratio_xxh_vs_sha_spread"] == pytest.approx(0.7)
    assert r["ab_xxh_writer_gb_per_s_median"] == pytest.approx(1.5) and "ab_durable_ratio_sha_vs_sha" not in r
    assert "ab_sha_writer_backpressure_seconds_median" not in r  # a figure no run reported is not made up
    runs["sha"][0]["writer_backpressure_seconds"] = 0.25  # reported by one round: summarized over that one
    assert summarize(runs)["ab_sha_writer_backpressure_seconds_rounds"] == "0.250"


def test_the_writer_benchmark_tells_a_writer_that_held_the_forwards_back(tmp_path):
    """writer_throughput's backpressure_seconds is the time forwards waited on a full ring: a ring of two and a half
    forwards' blocks makes them wait on the writer; a ring that holds the whole run never does (what tells a
    writer-bound run from a producer-bound one on the GPU, where the file threads' count and the checksum moved the
    writer by 1-3 %)."""
    from writer_throughput import main

    common = ["--forwards", "12", "--rows", "2048", "--per-request", "512", "--device", "cpu", "--io-threads", "1"]
    small = main([*common, "--ring-mb", "24", "--dir", str(tmp_path / "small")])
    large = main([*common, "--ring-mb", "512", "--dir", str(tmp_path / "large")])
    for r in (small, large):
        assert r["samples"] == 48 and r["bytes_per_token"] > 4 * 576 * 2  # every sample written, 4 bf16 slots
        assert r["writer_start_seconds"] > 0  # timed apart: the writer process's start is not the writer's pace
        assert 0 < r["share_io_busy"] <= 1.05 and r["share_io_write"] > 0
    assert small["backpressure_waits"] > 0 and small["backpressure_seconds"] > 0
    assert large["backpressure_waits"] == 0 and large["backpressure_seconds"] == 0
