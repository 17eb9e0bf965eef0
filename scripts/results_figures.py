"""Print every figure docs/results.md states, read from the records' metrics.json files.

Each claim lists the comparable runs that measured it: the headline is their median, every run is printed.
Run from the repository root: `python scripts/results_figures.py` (no eagle3kit import, standard library only).
"""
import json
import statistics
from pathlib import Path

RECORDS = Path("outputs/records")
ACCEPT = "serve/run/05_acceptance/metrics.json"
TRAIN = "train/run/04_train/metrics.json"
MAIN_RUNS = ["gpu-drafter-pipeline-11", "gpu-drafter-pipeline-12", "gpu-drafter-pipeline-13",
             "gpu-drafter-pipeline-15"]
BREAKEVEN_RUNS = ["gpu-breakeven-1", "gpu-breakeven-sync", "gpu-breakeven-bcg-1", "gpu-breakeven-bcg-2"]
CAPTURE_RUNS = ["gpu-benchmark-prefill-graph", "gpu-benchmark-graph-fp8", "gpu-benchmark-fp8-fused",
                "gpu-benchmark-xxh3-shares"]

LIVE_RUNS = ["gpu-live-vs-file", "gpu-live-vs-file-2", "gpu-live-vs-file-3"]
LIVESERVE = "run/05_acceptance/metrics.json"

# claim -> (metrics.json path inside each run, metric key, runs)
CLAIMS = {
    "held-out tau(3)": (TRAIN, "heldout_tau_3", MAIN_RUNS),
    "training tokens/s": (TRAIN, "train_tokens_per_s", MAIN_RUNS),
    "plain tokens/s at batch 1": (ACCEPT, "plain_tokens_per_s", MAIN_RUNS),
    "accept length (2,1,3)": (ACCEPT, "steps2_accept_length", MAIN_RUNS),
    "accept length (3,1,4)": (ACCEPT, "online_accept_length", MAIN_RUNS),
    "accept length (5,1,6)": (ACCEPT, "steps5_accept_length", MAIN_RUNS),
    "accept length (7,1,8)": (ACCEPT, "steps7_accept_length", MAIN_RUNS),
    "accept length tree (5,4,8)": (ACCEPT, "tree5x4x8_accept_length", MAIN_RUNS),
    "speedup (2,1,3)": (ACCEPT, "steps2_speedup", MAIN_RUNS),
    "speedup (3,1,4)": (ACCEPT, "online_speedup", MAIN_RUNS),
    "speedup (5,1,6)": (ACCEPT, "steps5_speedup", MAIN_RUNS),
    "speedup (7,1,8)": (ACCEPT, "steps7_speedup", MAIN_RUNS),
    "speedup tree (5,4,8)": (ACCEPT, "tree5x4x8_speedup", MAIN_RUNS),
    "speedup (3,1,4) at 8 requests": (ACCEPT, "online_speedup_c8", MAIN_RUNS),
    "speedup (3,1,4) at 32 requests": (ACCEPT, "online_speedup_c32", MAIN_RUNS),
    "offline walk accept length (3,1,4)": (ACCEPT, "offline_walk_accept_length", MAIN_RUNS),
    "break-even (3,1,4), untrained drafter": ("metrics.json", "breakeven_base_3_1_4", BREAKEVEN_RUNS),
    "break-even (7,1,8), untrained drafter": ("metrics.json", "breakeven_base_7_1_8", BREAKEVEN_RUNS),
    "graph capture bf16 / plain (defaults)": ("metrics.json", "ratio_vs_plain_default_graph", CAPTURE_RUNS),
    "graph capture bf16 durable / limit": ("metrics.json", "durable_ratio_vs_limit_graph", CAPTURE_RUNS),
    "graph capture fp8 / plain (defaults)": ("metrics.json", "ratio_vs_plain_default_graphfp8", CAPTURE_RUNS[1:]),
    "graph capture fp8 durable / limit": ("metrics.json", "durable_ratio_vs_limit_graphfp8", CAPTURE_RUNS[1:]),
    "default capture bf16 / plain (defaults)": ("metrics.json", "ratio_vs_plain_default_bf16",
                                                ["gpu-benchmark-prefill-graph"]),
    "capture / serial (fair)": ("metrics.json", "ratio_vs_serial_fair", CAPTURE_RUNS),
    "live / file training tokens/s": ("metrics.json", "live_train_tokens_per_s_ratio", LIVE_RUNS),
    "live training: share of steps that waited": ("metrics.json", "live_wait_share", LIVE_RUNS),
}

# single runs: (record, path inside it, key)
SINGLE = {
    "mistakes (3,1,4) accept length": [("gpu-drafter-pipeline-9", "serve/metrics.json", k) for k in (
        "online_accept_length", "postnorm_accept_length", "original_accept_length", "fp8_accept_length",
        "negative_control_accept_length", "engine_accept_length")],
    "fp8 vs bf16 vs second seed": [
        ("gpu-drafter-pipeline-10", TRAIN, "heldout_tau_3"),
        ("gpu-drafter-pipeline-10", "train/train-fp8/metrics.json", "heldout_tau_3"),
        ("gpu-drafter-pipeline-10", "train/train-seed1/metrics.json", "heldout_tau_3"),
        ("gpu-drafter-pipeline-10", ACCEPT, "online_accept_length"),
        ("gpu-drafter-pipeline-10", ACCEPT, "fp8_accept_length"),
        ("gpu-drafter-pipeline-10", ACCEPT, "seed1_accept_length")],
    "bcg variant": [("gpu-drafter-pipeline-15", ACCEPT, "online_speedup"),
                    ("gpu-drafter-pipeline-15", ACCEPT, "bcg_speedup_vs_plain")],
    "sglang adaptive steps": [("gpu-drafter-pipeline-13", ACCEPT, k) for k in (
        "adaptive_accept_length", "adaptive_speedup", "adaptive_speedup_c8", "adaptive_speedup_c32")],
    "writer at Kimi-K2.5's geometry": [("gpu-benchmark-xxh3-shares", "metrics.json", k) for k in (
        "writer_durable_gb_per_s_h7168_bf16", "writer_durable_gb_per_s_h7168_fp8",
        "kimi_keepup_prefill_tokens_per_s_bf16", "kimi_keepup_prefill_tokens_per_s_fp8",
        "kimi_10k_samples_gb_bf16", "kimi_10k_samples_gb_fp8")],
    "checksum in the capture pass": [("gpu-benchmark-xxh3-shares", "metrics.json", k) for k in (
        "ratio_vs_plain_default_graph", "ratio_vs_plain_default_graphsha",
        "durable_ratio_vs_limit_graph", "durable_ratio_vs_limit_graphsha")],
    "live vs file (second run, held-out tau(3) and SGLang accept length at (3,1,4))": [
        ("gpu-live-vs-file-2", "metrics.json", k) for k in (
            "file_tau_3", "seed1_tau_3", "live_tau_3", "live_vs_file_tau_rel_diff", "file_seed_tau_rel_diff")] + [
        ("gpu-liveserve", LIVESERVE, k) for k in (
            "file_accept_length", "seed1_accept_length", "live_accept_length", "live_vs_file_accept_rel_diff",
            "file_seed_accept_rel_diff")],
    "live vs file (third run, 500 steps; busy: the file run beside a capture server)": [
        ("gpu-live-vs-file-3", "metrics.json", k) for k in (
            "file_tau_3", "seed1_tau_3", "live_tau_3", "busy_tau_3", "live_vs_file_tau_rel_diff",
            "file_seed_tau_rel_diff", "busy_train_tokens_per_s_ratio", "live_vs_busy_train_tokens_per_s_ratio",
            "busy_rate_per_s")] + [
        ("gpu-liveserve-2", LIVESERVE, k) for k in (
            "file_accept_length", "seed1_accept_length", "live_accept_length", "live_vs_file_accept_rel_diff",
            "file_seed_accept_rel_diff", "online_speedup", "plain_tokens_per_s")],
    "MLA head vs Llama head on SmolLM2": [(run, "metrics.json", k) for run in ("gpu-live-vs-file-2", "gpu-live-vs-file-3")
                                          for k in ("mla_tau_3", "mla_vs_llama_tau_rel_diff", "mla_train_tokens_per_s")]
    + [(run, LIVESERVE, k) for run in ("gpu-liveserve", "gpu-liveserve-2")
       for k in ("mla_accept_length", "mla_vs_llama_accept_rel_diff", "mla_speedup")],
    "MLA load proof, tiny DeepSeek-V3, EAGLE-3.1": [
        ("gpu-mla-tiny-2", "deepseek-mla31/05_acceptance/metrics.json", k) for k in (
            "export_params_checked", "export_params_unloaded", "mla_logits_max_rel_err", "mla_logits_argmax_agreement",
            "fed_layer_ids", "offbyone_fed_layer_ids", "offbyone_doctor_ok", "online_accept_length")],
    "MLA load proof, tiny Kimi-K2.5, EAGLE-3.1": [
        ("gpu-mla-tiny-3", "kimi-mla31/05_acceptance/metrics.json", k) for k in (
            "export_params_checked", "export_params_unloaded", "mla_logits_max_rel_err", "mla_logits_argmax_agreement",
            "fed_layer_ids", "offbyone_fed_layer_ids", "offbyone_doctor_ok", "online_accept_length")],
    "prefill-graph data vs default data, held-out tau(3)": [
        ("gpu-prefill-graph-train-ab", "metrics-graph.json", "heldout_tau_3"),
        ("gpu-prefill-graph-train-ab", "metrics-eager.json", "heldout_tau_3")],
}


def value(record, path, key):
    """The metric, or None where the record lacks it (said in the printout, never guessed)."""
    file = RECORDS / record / path
    if not file.exists():
        return None
    return json.loads(file.read_text()).get(key)


def main():
    for claim, (path, key, runs) in CLAIMS.items():
        values = {run: value(run, path, key) for run in runs}
        found = [v for v in values.values() if isinstance(v, (int, float))]
        median = statistics.median(found) if found else None
        listed = ", ".join(f"{run}: {v:.3f}" if isinstance(v, (int, float)) else f"{run}: absent"
                           for run, v in values.items())
        print(f"{claim} [{key}]: median {median:.3f} of {len(found)} ({listed})" if found
              else f"{claim} [{key}]: no run measured it")
    for claim, rows in SINGLE.items():
        print(f"{claim}:")
        for record, path, key in rows:
            v = value(record, path, key)
            print(f"  {record}/{path} {key}: {v:.4f}" if isinstance(v, (int, float)) else f"  {record}/{path} {key}: {v}")


if __name__ == "__main__":
    main()
