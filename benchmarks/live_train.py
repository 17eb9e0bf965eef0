"""Live training against training from files, on one GPU (#44): the same conversations, recipe, seed and steps.

  1. ``extract`` with a capture server started here writes the conversations' states to disk (the file baseline's data);
  2. ``train`` from those files (seed 0, and seed 1 for the spread of two trainings of one recipe);
  3. ``train --live``: a capture server colocated on the same GPU streams the same conversations to the trainer;
  4. with ``--fault-after S``: a live training whose capture server is killed with SIGKILL S seconds into its steps;
  5. ``busy``: the file run's data, recipe, seed and steps, while a capture server beside it on the same GPU captures
     the training conversations at the live run's pace and drops them: the load the live run's server puts on the GPU
     and the host, without the stream; live over busy is what the stream itself costs, busy over file what sharing
     the GPU with a capture server costs (``--busy-rate``: captures per second when no live run came before);
  6. ``mla`` (#46): the file run's data, recipe, seed and steps with the MLA head (Eagle3DeepseekV2ForCausalLM) in
     place of the Llama head; SmolLM2 is no MLA target, so the head's MLA sizes are set here (``MLA``: the rope and
     latent sizes SGLang's triton MLA kernels compile for, 9 heads as SmolLM2's attention).
Prints every figure; ``--out`` gets metrics.json: ``live_vs_file_tau_rel_diff`` (held-out tau at serving steps),
``file_seed_tau_rel_diff`` (the yardstick), ``live_train_tokens_per_s_ratio`` (live over file, optimizer steps
only), ``live_wait_share``, ``live_hidden_state_bytes_on_disk``, ``live_peak_host_mb`` against ``live_stream_bound_mb``,
``busy_train_tokens_per_s_ratio`` (busy over file) and ``live_vs_busy_train_tokens_per_s_ratio``, and the fault run's
``fault_live_samples_lost`` / ``_duplicated`` / ``fault_live_server_restarts``.

usage: python benchmarks/live_train.py --out DIR [--samples 2000] [--steps 400] [--fault-after 30]
       python benchmarks/live_train.py --served STEP   (05_acceptance's folder of gpu_record.sh's liveserve phase: the
       live drafter served as main, the file ones as controls "file" and "seed1", the MLA head as "mla")
       python benchmarks/live_train.py --scale RUN --scale-data DATA   (gpu_record.sh's scale phase: one live run's
       distinct samples beside what this disk holds as files, and its accept lengths in SGLang)
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import threading
import time
from pathlib import Path

SERVER = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--mem-fraction-static", "0.35"]


MLA = {"drafter": "mla", "mla_num_attention_heads": 9, "mla_q_lora_rank": 384, "mla_kv_lora_rank": 512,
       "mla_qk_nope_head_dim": 64, "mla_qk_rope_head_dim": 64, "mla_v_head_dim": 64}


def recipe(a) -> dict:
    return {"target": "embedded:smollm2", "draft_vocab_size": 16384, "ttt_steps": 5, "serving_steps": 3,
            "tokens_per_batch": a.tokens_per_batch, "rows_per_batch": 2, "lr": 1e-3, "max_steps": a.steps, "epochs": 30,
            "workers": 4, "eval_every": 0, "progress": False, "save_every": 200}


def live_settings(a, port: int, stream_dir: str) -> dict:
    return {"engine": "sglang", "max_samples": a.samples, "max_tokens": a.max_tokens, "heldout_percent": 5,
            "server_args": SERVER, "port": port, "stream_gb": a.stream_gb, "concurrency": 64,
            "stream_dir": stream_dir}


def ram_folder(need_gb: float) -> Path:
    """/dev/shm when it has room for ``need_gb``; else a tmpfs of that size mounted for the benchmark (a container's
    /dev/shm is often 64 MB)."""
    import shutil
    import subprocess

    if shutil.disk_usage("/dev/shm").free > need_gb * 1e9:
        return Path("/dev/shm")
    where = Path("/root/live-shm")
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(need_gb) + 1}g", "tmpfs", str(where)], check=True)
    return where


def killer(out: Path, after_s: float, log: list) -> None:
    """SIGKILL the live run's capture server ``after_s`` seconds after its first optimizer step (its log)."""
    first = None
    while first is None:
        lines = (out / "train_log.jsonl").read_text().splitlines() if (out / "train_log.jsonl").exists() else []
        if lines:
            first = time.time()
        time.sleep(0.2)
    time.sleep(after_s)
    import subprocess

    pids = subprocess.run(["pgrep", "-f", "sglang.launch_server.*--port 30031"], capture_output=True, text=True).stdout
    for pid in pids.split():
        try:
            os.killpg(int(pid), signal.SIGKILL)
            log.append({"killed_pgid": int(pid), "at_s": time.time() - first})
        except ProcessLookupError:
            pass


def colocated_load(rate: float, stop: threading.Event, ready: threading.Event, folder: Path, a, log: dict) -> None:
    """A capture server on port 30051 capturing the training conversations at ``rate`` per second (cycling through
    them) and dropping each capture as it lands, until ``stop``; ``ready`` once it answers. ``log``: what it did."""
    try:
        _load(rate, stop, ready, folder, a, log)
    except Exception as e:  # noqa: BLE001 - reported in the busy run's figures; the training goes on without load
        log["busy_error"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        ready.set()


def _load(rate, stop, ready, folder, a, log) -> None:
    import shutil

    from transformers import AutoTokenizer

    from eagle3kit.capture.client import CaptureClient
    from eagle3kit.capture.server import capture_server, stop_all
    from eagle3kit.extract import load_samples
    from eagle3kit.pipeline import default_aux
    from eagle3kit.target import TargetInfo, resolve_target

    path = resolve_target("embedded:smollm2")
    rendered, _ = load_samples("embedded:sharegpt", AutoTokenizer.from_pretrained(path), a.samples, a.max_tokens)
    ids = [s.input_ids for s in rendered if s.split == "train"]
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "samples").mkdir(parents=True)
    server = capture_server(path, folder / "samples", default_aux(TargetInfo.read(path).num_layers), port=30051,
                            extra_args=SERVER, log_path=folder.parent / f"{folder.name}-sglang.log")
    try:
        server.start().wait_healthy()
        client = CaptureClient([server.url], folder / "samples")
        t0, sent, done = time.time(), [0], [0]
        ready.set()

        def take(n):
            if stop.is_set():
                return None
            due = min(n, int((time.time() - t0) * rate) + 1 - sent[0])
            got = [(f"busy-{sent[0] + j}", ids[(sent[0] + j) % len(ids)]) for j in range(max(0, due))]
            sent[0] += len(got)
            return got

        def drop(key, marker):
            done[0] += marker.get("status") == "ok"
            client.clear(key)
        client.capture_stream(take, concurrency=64, on_done=drop)
        log.update(busy_captures_sent=sent[0], busy_captures_ok=done[0], busy_seconds=time.time() - t0)
    finally:
        stop_all([server])
        shutil.rmtree(folder, ignore_errors=True)


def served(step: Path) -> dict:
    """SGLang's accept lengths at 05's serving setting, from 05's metrics.json (a complete or a cut run's, which
    ``record_partial`` summarised), as relative differences against the file-trained drafter: the live one (main),
    the other seed of the file recipe (the yardstick) and the MLA head; merged into that metrics.json."""
    from eagle3kit.metrics import update_json

    m = json.loads((step / "metrics.json").read_text())
    file = m.get("file_accept_length")
    if not file:
        raise SystemExit(f"{step}/metrics.json: no file_accept_length (the file-trained control was not measured)")
    res = {"live_accept_length": m["online_accept_length"], "file_accept_length": file}
    res["live_vs_file_accept_rel_diff"] = abs(m["online_accept_length"] - file) / file
    if "seed1_accept_length" in m:
        res["file_seed_accept_rel_diff"] = abs(m["seed1_accept_length"] - file) / file
    if "mla_accept_length" in m:
        res["mla_vs_llama_accept_rel_diff"] = (m["mla_accept_length"] - file) / file
    for k, v in res.items():
        print(f"{k:40s} {v}")
    update_json(step / "metrics.json", res)
    return res


def scale(run: Path, data: Path, disk: str = "/") -> dict:
    """The scale phase's figures: ``run`` is an ``eagle3kit run`` folder whose 04_train trained live and whose
    05_acceptance served it; ``data`` an extraction of some of the same conversations (files on this disk), whose mean
    bytes per sample size what the live run's distinct samples would take as files, against the room on ``disk``.
    Merged into ``run``'s metrics.json."""
    import shutil

    from eagle3kit.metrics import update_json
    from eagle3kit.store import read_manifest

    tr = json.loads((run / "04_train" / "metrics.json").read_text())
    if "live_distinct_samples" not in tr:
        raise SystemExit(f"{run}/04_train/metrics.json: no live_distinct_samples (04_train did not train live)")
    rows = list(read_manifest(data).values())
    if not rows:
        raise SystemExit(f"{data}/manifest.jsonl: no samples (the extraction that sizes a file sample wrote none)")
    sized = sum(r["bytes"] for r in rows)
    per_sample = sized / len(rows)
    room = shutil.disk_usage(disk).free + sized  # what a data set could fill: the free space and the sizer's own files
    res = {"live_distinct_samples": tr["live_distinct_samples"], "file_bytes_per_sample": per_sample,
           "file_bytes_per_sample_from": len(rows), "disk_room_gb": room / 1e9,
           "disk_capacity_samples": int(room // per_sample),
           "live_distinct_samples_as_files_gb": tr["live_distinct_samples"] * per_sample / 1e9,
           "live_hidden_state_bytes_on_disk": tr.get("live_hidden_state_bytes_on_disk"),
           "heldout_tau_3": tr.get("heldout_tau_3"), "train_steps": tr.get("train_steps")}
    res["live_distinct_over_disk_capacity"] = res["live_distinct_samples"] / res["disk_capacity_samples"]
    acc_path = run / "05_acceptance" / "metrics.json"
    if acc_path.exists():
        acc = json.loads(acc_path.read_text())
        res.update({f"accept_length_{n}_1_{n + 1}": acc[f"steps{n}_accept_length"] for n in (3, 7)
                    if f"steps{n}_accept_length" in acc})
    for k, v in res.items():
        print(f"{k:40s} {v}")
    update_json(run / "metrics.json", res)
    return res


def summarise(runs: dict, res: dict) -> None:
    """The comparisons of the runs so far, into ``res`` (written after every run: a run cut by the phase's limit
    keeps the figures of the runs before it)."""
    tau = {k: v.get("heldout_tau_3") for k, v in runs.items()}
    if "file" in runs and "live" in runs:
        f, lv = runs["file"], runs["live"]
        res.update(file_tau_3=tau["file"], live_tau_3=tau["live"],
                   live_vs_file_tau_rel_diff=abs(tau["live"] - tau["file"]) / tau["file"],
                   file_train_tokens_per_s=f["train_tokens_per_s"], live_train_tokens_per_s=lv["train_tokens_per_s"],
                   live_train_tokens_per_s_ratio=lv["train_tokens_per_s"] / f["train_tokens_per_s"],
                   file_data_wait_fraction=f["train_data_wait_fraction"],
                   **{k: v for k, v in lv.items() if k.startswith("live_") and isinstance(v, (int, float, str))})
        res["live_peak_host_mb"] = lv["live_peak_stream_mb"]
    if "seed1" in runs and "file" in runs:
        res.update(seed1_tau_3=tau["seed1"], file_seed_tau_rel_diff=abs(tau["seed1"] - tau["file"]) / tau["file"])
    if "mla" in runs and "file" in runs:
        res.update(mla_tau_3=tau["mla"], mla_vs_llama_tau_rel_diff=(tau["mla"] - tau["file"]) / tau["file"],
                   mla_train_tokens_per_s=runs["mla"]["train_tokens_per_s"])
    if "busy" in runs and "file" in runs:
        b = runs["busy"]
        res.update(busy_train_tokens_per_s=b["train_tokens_per_s"], busy_tau_3=tau["busy"],
                   busy_train_tokens_per_s_ratio=b["train_tokens_per_s"] / runs["file"]["train_tokens_per_s"],
                   **{k: v for k, v in b.items() if k.startswith("busy_") and isinstance(v, (int, float))})
        if "live" in runs:
            res["live_vs_busy_train_tokens_per_s_ratio"] = (runs["live"]["train_tokens_per_s"]
                                                            / b["train_tokens_per_s"])
    if "fault" in runs:
        fr = runs["fault"]
        res.update({f"fault_{k}": v for k, v in fr.items() if k.startswith("live_") and isinstance(v, (int, float))})
        res.update(fault_train_steps=fr["train_steps"], fault_kills=len(fr["kills"]),
                   fault_kill_at_s=fr["kills"][0]["at_s"] if fr["kills"] else -1, fault_tau_3=tau["fault"])


def main(argv=None):
    from eagle3kit.drafter.train import TrainConfig, train
    from eagle3kit.metrics import update_json
    from eagle3kit.pipeline import run_extraction

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out")
    p.add_argument("--served", help="05_acceptance's folder of the liveserve phase: its accept-length figures only")
    p.add_argument("--scale", help="an `eagle3kit run` folder whose 04_train trained live (gpu_record.sh's scale "
                                   "phase)")
    p.add_argument("--scale-data", help="--scale: an extraction of some of the same conversations (file bytes/sample)")
    p.add_argument("--work", default="/root/work/live")
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--stream-gb", type=float, default=4.0)
    p.add_argument("--tokens-per-batch", type=int, default=4096)
    p.add_argument("--fault-after", type=float, default=0, help="seconds into the fault run's steps (0: no fault run)")
    p.add_argument("--busy-rate", type=float, default=20.0,
                   help="busy run: captures per second when no live run came before it (else the live run's pace)")
    p.add_argument("--only", nargs="*", default=["file", "seed1", "live", "fault"],
                   help="runs, in the order given: file, seed1, live, busy, fault, mla")
    a = p.parse_args(argv)
    if a.served:
        return served(Path(a.served))
    if a.scale:
        if not a.scale_data:
            p.error("--scale needs --scale-data (an extraction's folder: what a sample takes as a file)")
        return scale(Path(a.scale), Path(a.scale_data))
    if not a.out:
        p.error("--out is required (or --served)")
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    res = {"samples_asked": a.samples, "steps": a.steps}
    data = work / "data"
    if not (data / "manifest.jsonl").exists() and {"file", "seed1", "mla"} & set(a.only):
        t0 = time.time()
        ex = run_extraction(target="embedded:smollm2", out_dir=data, engine="sglang", max_samples=a.samples,
                            max_tokens=a.max_tokens, heldout_percent=5, server_args=SERVER, port=30021,
                            progress=False)
        res.update(extract_seconds=time.time() - t0, extract_samples=ex["written"], extract_bytes=ex["bytes"])
    runs = {}
    ram = ram_folder(2 * a.stream_gb + 2) if {"live", "fault", "busy"} & set(a.only) else None
    res["live_ram_folder"] = str(ram)
    for name in a.only:
        cfg = {**recipe(a), "out_dir": str(work / name)}
        if name in ("file", "seed1", "mla", "busy"):
            cfg.update(data=str(data), seed=1 if name == "seed1" else 0, **(MLA if name == "mla" else {}))
        else:
            cfg.update(data="embedded:sharegpt", live=live_settings(a, 30031 if name == "fault" else 30041,
                                                                    str(ram / f"eagle3kit-live-{name}")))
        kill_log: list = []
        if name == "fault":
            if not a.fault_after:
                continue
            threading.Thread(target=killer, args=(work / name, a.fault_after, kill_log), daemon=True).start()
        load: dict = {}
        if name == "busy":  # the live run's captures per second of its wall time, its setup's captures included
            lv = runs.get("live")
            rate = lv["live_samples_captured"] / lv["wall_seconds"] if lv else a.busy_rate
            stop, ready = threading.Event(), threading.Event()
            loader = threading.Thread(target=colocated_load, args=(rate, stop, ready, ram / "eagle3kit-busy", a, load))
            loader.start()
            ready.wait()
            load["busy_rate_per_s"] = rate
        t0 = time.time()
        try:
            s = train(TrainConfig.from_dict(cfg))
        finally:
            if name == "busy":
                stop.set()
                loader.join()
        s["wall_seconds"] = time.time() - t0
        s["kills"] = kill_log
        s.update(load)
        runs[name] = s
        (out / f"train-{name}.json").write_text(json.dumps(s, indent=1, sort_keys=True, default=str))
        for f in ("train_log.jsonl", "evals.jsonl", "sglang.log"):
            if (work / name / f).exists():
                os.system(f"gzip -c {work / name / f} > {out / f'{name}-{f}.gz'}")
        summarise(runs, res)
        update_json(out / "metrics.json", res)
        print(f"[{name}] {s['train_steps']} steps, {s['train_tokens_per_s']:,.0f} tokens/s, tau_3 "
              f"{s.get('heldout_tau_3')}, wall {s['wall_seconds']:.0f} s", flush=True)
    res["bench_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for k, v in res.items():
        print(f"{k:40s} {v}")
    update_json(out / "metrics.json", res)
    return res


if __name__ == "__main__":
    main()
