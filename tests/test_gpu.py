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
