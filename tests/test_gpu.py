"""GPU tests: a real SGLang capture server on the embedded default (skipped without CUDA and SGLang).
Run on the GPU machine with ``scripts/gpu_record.sh tests``; the records are under outputs/records/."""
import os

import pytest
import requests

pytestmark = pytest.mark.gpu
SERVER_ARGS = os.environ.get("E3K_SERVER_ARGS", "--attention-backend triton --sampling-backend pytorch "
                             "--mem-fraction-static 0.3").split()


@pytest.fixture(scope="module")
def server(tmp_path_factory, target_path):
    from eagle3kit.capture.server import capture_server

    d = tmp_path_factory.mktemp("gpu")
    s = capture_server(target_path, d / "captures", [2, 15, 27], port=30900, final_normed=True,
                       extra_args=SERVER_ARGS + ["--chunked-prefill-size", "128"], log_path=d / "sglang.log")
    with s:
        yield s


def test_concurrent_chunked_captures_match_reference(server, tokenizer, target_path):
    from eagle3kit.capture.client import CaptureClient
    from eagle3kit.capture.reference import ReferenceEngine
    from eagle3kit.spec import calibrate_bounds, calibration_set, compare_to_reference, probe_prompts

    prompts = probe_prompts(tokenizer, 16, 32, 400, seed=3)
    client = CaptureClient(server.url, server.capture["capture_dir"])
    markers = client.capture_many(prompts.items(), concurrency=16)
    assert all(m["status"] == "ok" for m in markers), [m for m in markers if m["status"] != "ok"]
    assert any(m["chunks"] > 1 for m in markers)  # chunked prefill really reassembled
    ref = ReferenceEngine(target_path, [2, 15, 27], final_normed=True, device="cuda")
    bounds = calibrate_bounds(ref, calibration_set(prompts, 8))  # bf16 vs fp32 of the same model, x3
    rows = compare_to_reference(server.capture["capture_dir"], prompts, ref, bounds)
    worst_tok = max(r["token_worst_err"] for r in rows)
    print(f"bounds {bounds}; worst token {worst_tok:.4f}; rows over: {[r for r in rows if not r['ok']]}")
    assert all(r["ok"] for r in rows)  # every token of every slot within its bf16-calibrated bound


def test_health_warmup_and_bad_rid_do_not_disturb(server, tokenizer):
    from eagle3kit.capture.client import CaptureClient

    client = CaptureClient(server.url, server.capture["capture_dir"])
    assert requests.get(server.url + "/health_generate", timeout=60).status_code == 200
    ids = tokenizer("a short prompt for a malformed rid").input_ids
    requests.post(server.url + "/generate", json={"input_ids": ids, "rid": "e3k-nolength",
                                                  "sampling_params": {"max_new_tokens": 0}}, timeout=60)
    m = client.capture("after_bad", ids, max_new_tokens=4)
    assert m["status"] == "ok" and m["n_tokens"] == len(ids)
    st = client.status()["rank0"]
    assert st["counts"]["bad_rids"] >= 1
    assert st["ignored_rows_by_kind"].get("health_check", 0) >= 1
    assert st["counts"].get("errors", 0) == 0, st["last_error"]


def test_prefix_cache_hit_is_reported_incomplete(server, tokenizer):
    from eagle3kit.capture.client import CaptureClient

    client = CaptureClient(server.url, server.capture["capture_dir"])
    text = "<|im_start|>user\nThe same long prompt twice, so the radix cache serves the second one. " * 8
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert client.capture("first", ids, isolate_cache=False)["status"] == "ok"
    second = client.capture("second", ids, isolate_cache=False)
    assert second["status"] == "incomplete" and "prefix-cache hit" in second["reason"]
    assert second["meta_info"]["cached_tokens"] > 0


def test_prefill_graph_capture_matches_reference(tmp_path_factory, tokenizer, target_path):
    """Capture with SGLang's prefill CUDA graph on (``prefill_graph``: the plugin switches SGLang's EAGLE-3 aux states
    on before the graphs are captured; the end hook reads them after each replay): 16 prompts in flight, chunked,
    every token of every slot within its bf16-calibrated bound of the reference, the last slot against the
    reference's post-norm state. The graph really ran (SGLang's own log: "cuda graph: True" on prefill batches), and
    the check rejects each of the capture's mistakes on these files (the pre-norm state in the last slot among them)."""
    from eagle3kit.capture.client import CaptureClient
    from eagle3kit.capture.format import read_sample
    from eagle3kit.capture.reference import ReferenceEngine
    from eagle3kit.capture.server import capture_server
    from eagle3kit.spec import (calibrate_bounds, calibration_set, check_capture,
                                compare_to_reference, graph_prefills, negative_controls,
                                probe_prompts)

    d = tmp_path_factory.mktemp("graph")
    # beside the module's server (alive until the module ends): a --mem-fraction-static counts what it holds
    args = SERVER_ARGS + ["--chunked-prefill-size", "128", "--mem-fraction-static", "0.6"]
    with capture_server(target_path, d / "captures", [2, 15, 27], port=30910, prefill_graph=True, extra_args=args,
                        log_path=d / "sglang.log") as s:
        prompts = probe_prompts(tokenizer, 16, 32, 400, seed=5)
        client = CaptureClient(s.url, s.capture["capture_dir"])
        markers = client.capture_many(prompts.items(), concurrency=16)
        status = client.status()["rank0"]
    prefills = graph_prefills(d / "sglang.log")
    graphed, eager = prefills["graphed"], prefills["eager"]
    out = os.environ.get("E3K_TEST_OUT")
    if out:  # the server's log beside the test's record
        import shutil

        shutil.copy(d / "sglang.log", os.path.join(out, "sglang-prefill-graph.log"))
    assert all(m["status"] == "ok" for m in markers), [m for m in markers if m["status"] != "ok"][:3]
    assert any(m["chunks"] > 1 for m in markers)
    assert graphed > 0 and status["counts"].get("errors", 0) == 0, status.get("last_error")
    ref = ReferenceEngine(target_path, [2, 15, 27], final_normed=True, device="cuda")
    bounds = calibrate_bounds(ref, calibration_set(prompts, 8))
    rows = compare_to_reference(s.capture["capture_dir"], prompts, ref, bounds)
    worst = {layer: max(r["token_worst_err"] for r in rows if r["layer_id"] == layer) for layer in (2, 15, 27, 30)}
    figures = {"prefill_graph_requests": len(markers), "prefill_graph_chunked": sum(m["chunks"] > 1 for m in markers),
               "prefill_graph_batches_graphed": graphed, "prefill_graph_batches_eager": eager,
               "prefill_graph_rows_over_bound": sum(not r["ok"] for r in rows),
               **{f"prefill_graph_worst_token_err_{k}": v for k, v in worst.items()},
               **{f"prefill_graph_bound_{k}": float(v) for k, v in bounds.items()}}
    print(figures)
    if out:  # the record's figures (pytest -v shows no prints of a passing test)
        from eagle3kit.metrics import update_json

        update_json(os.path.join(out, "metrics.json"), figures)
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]][:3]
    # what the check rejects on these files: each of the capture's mistakes, the final-slot one being the pre-norm
    # state where the post-norm one is recorded (spec.negative_controls, as notebook 02 shows them)
    (key, ids), (key1, _) = list(prompts.items())[:2]
    cap, meta = read_sample(d / "captures" / f"{key}.rank0.safetensors")
    cap1, _ = read_sample(d / "captures" / f"{key1}.rank0.safetensors")
    assert meta["final_slot"] == "post_norm"
    r0 = ref.hidden(ids)
    assert all(r["ok"] for r in check_capture(cap, ids, r0, meta["layer_ids"], bounds, post_norm=True))
    # checked as if the last slot held the pre-norm state: that slot fails
    assert not [r for r in check_capture(cap, ids, r0, meta["layer_ids"], bounds) if r["layer_id"] == 30][0]["ok"]
    failing = negative_controls(cap, cap1, ids, ref, r0, bounds, post_norm=True)
    assert "final slot pre-norm" in failing and all(failing.values()), {k: bool(v) for k, v in failing.items()}
