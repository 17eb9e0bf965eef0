"""Extraction throughput on the GPU, all in one run with the same prompts (prints a table, writes metrics.json):

  (a) plain SGLang prefill, no capture (max_new_tokens 0, many requests in flight): SGLang with its own defaults
      (CUDA graphs on: the server a user runs without eagle3kit; the baseline of every ratio) and with
      ``--disable-cuda-graph`` (what capture needs); also the capture server answering requests it does not capture
      (the cost of the hooks alone)
  (b) eagle3kit capture at its best concurrency (bf16 and fp8 storage, ``--storages``), timed until the last marker
      (files in the page cache) and until ``os.sync()`` returned (durable: the bytes on disk); ``graph``: bf16 with
      SGLang's prefill CUDA graph kept on (``prefill_graph``, ``capture.graph_plugin``; the final slot post-norm)
  (c) the serial method used before: one request in flight, max_new_tokens 1, on a seeded random subset of the same
      prompts (the same length distribution), once per round like every other pass
  (d) the disk: durable write bandwidth of files of a sample's size on the captures' disk, measured in the same run
      (first, before any server starts, so that a run cut by its time limit keeps it);
      the physical limit of capture per storage is min(plain prefill, the disk's durable bytes/s / bytes per token),
      the disk's figure the larger of write-then-sync and the sync phase alone (disk_write.limit_bytes_per_s)
Every pass runs ``--rounds`` times, in turn with the others. Ratios are taken per round (the same round's passes)
and reported as the median, every round and their spread ((max - min) / median): ``ratio_vs_plain_default`` (page
cache, bf16; goal >= 0.9), ``durable_ratio_vs_limit_<storage>`` (goal >= 0.9), ``ratio_vs_serial_fair``,
``ratio_spread``. Each pass's best, median and rounds are kept too (``*_rounds``). The capture servers' status
counts say where time went: ``hook_us`` (the scheduler's time inside the hooks), ``backpressure_us`` (forwards
waiting for the writer), and the writer's own stages (``capture.writer.stage_shares``: ``io_busy``, the file threads'
busy share, 1.0 when they bind; ``io_hash``/``io_write``/``io_writeback``/``io_encode``/``io_marker``, each stage's
part of it; ``reassembly``; ``d2h_wait``), as ``capture_<pass>_conc<c>_<name>_share``. Every request carries a unique ``extra_key``, so repeated passes over the same prompts
never hit the prefix cache, and every pass starts after the previous pass's captures are removed and all dirty pages
are written back (not timed). With py-spy installed, one round's last-concurrency passes are profiled
(``profile-<pass>-<process>.summary.txt``: scheduler, tokenizer manager, the capture writer process, this client).
``--engine transformers`` measures the CPU reference engine instead (tokens/s).

usage: python benchmarks/extract_throughput.py --out DIR [--samples 2000] [--server-args ...]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def limit_bytes_per_s(disk: dict) -> float:
    from disk_write import limit_bytes_per_s as limit  # benchmarks/disk_write.py

    return limit(disk)


def measure_disk(folder, gb, file_mb):
    from disk_write import measure  # benchmarks/disk_write.py

    return measure(folder, gb=gb, file_mb=file_mb)


def prompts_from_sharegpt(tok, n, max_tokens):
    from eagle3kit.extract import load_samples

    samples, _ = load_samples("embedded:sharegpt", tok, n, max_tokens)
    return {s.key: s.input_ids for s in samples}


def timed_capture(client, prompts, concurrency):
    t = time.time()
    markers = client.capture_many(prompts.items(), concurrency=concurrency)
    dt = time.time() - t
    bad = [m for m in markers if m.get("status") != "ok"]
    return sum(map(len, prompts.values())) / dt, dt, bad, markers


def reencoded_bytes_per_token(capture_dir, storage: str, n: int = 50) -> float:
    """Bytes per token of ``storage`` files, measured by writing ``n`` captured samples again in that storage
    (the writer's own encode and file writer) when this run served no server with it."""
    import tempfile

    from eagle3kit.capture.format import read_sample, write_sample

    files = sorted(Path(capture_dir).glob("*.safetensors"))[:n]
    total = tokens = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i, f in enumerate(files):
            tensors, meta = read_sample(f)
            m = write_sample(Path(tmp), f"s{i}", 0, tensors, {}, storage)
            total, tokens = total + m["bytes"], tokens + m["n_tokens"]
    return total / tokens


def fresh_start(*capture_dirs) -> None:
    """Before a timed pass (not timed): remove the previous pass's captures and write back every dirty page, so
    that no pass pays for deleting or flushing what an earlier one wrote; every pass starts from the same state."""
    for d in capture_dirs:
        for p in Path(d).iterdir():
            if not p.name.startswith("_") and p.suffix in (".safetensors", ".json"):
                p.unlink()
    os.sync()


def report(name: str, value) -> None:
    print(f"  {name}: {value:,.0f}" if isinstance(value, float) else f"  {name}: {value}", flush=True)


def scheduler_counts(client) -> dict:
    time.sleep(1.2)  # the writer process rewrites its status file at most every 0.5 s
    return client.status().get("rank0", {}).get("counts", {})


def plain_prefill(url, prompts, concurrency, max_new_tokens=0):
    import requests

    local = threading.local()

    def one(item):
        key, ids = item
        if not hasattr(local, "s"):  # one kept-alive connection per thread, as the capture client keeps
            local.s = requests.Session()
        s = local.s
        rid = f"plain-{key}-{uuid.uuid4().hex[:8]}"
        # a unique extra_key, as the capture client sends: no pass can hit the prefix cache of an earlier one
        r = s.post(url + "/generate", json={"input_ids": ids, "rid": rid, "extra_key": rid,
                                            "sampling_params": {"max_new_tokens": max_new_tokens}}, timeout=600)
        r.raise_for_status()
    t = time.time()
    with ThreadPoolExecutor(concurrency) as ex:
        list(ex.map(one, prompts.items()))
    return sum(map(len, prompts.values())) / (time.time() - t)


def spy_on(tag, server, out, seconds, client=False):
    """Sampling profiles (benchmarks/pyspy.py) of a server's processes during one pass; stop() them after it."""
    from pyspy import Spy, find

    if seconds <= 0:
        return []
    sched = find(server.proc.pid, "scheduler")
    pids = {"scheduler": sched, "tokenizer": server.proc.pid}
    if server.capture is not None and sched is not None:
        pids["writer"] = find(sched, "eagle3kit.capture.writer_process")
    if client:
        pids["client"] = os.getpid()
    return [Spy(pid, out / f"profile-{tag}-{name}.txt", seconds).start() for name, pid in pids.items()]


def _best(values):
    ok = [v for v in values if v == v]  # NaN: a failed pass
    return max(ok) if ok else float("nan")


def pass_figures(runs: dict) -> dict:
    """Each pass's best, median and every round (``<pass>_tokens_per_s``, ``_median_tokens_per_s``, ``_rounds``);
    a failed pass (NaN) is printed among the rounds but counts in neither figure."""
    res = {}
    for name, values in runs.items():
        ok = [v for v in values if v == v]
        res[f"{name}_tokens_per_s"] = max(ok, default=0.0)
        res[f"{name}_median_tokens_per_s"] = statistics.median(ok) if ok else 0.0
        res[f"{name}_rounds"] = " ".join(f"{v:,.0f}" for v in values)
    return res


def complete_rounds(run_round, rounds: int, runs: dict) -> tuple[dict, int, bool]:
    """Runs ``run_round(r)`` for r in 0..rounds-1 (each appends its passes' figures to ``runs``). Cut by SIGINT (the
    phase's time limit), the rounds already complete still count and the cut one is dropped (its missing passes would
    have run in another spell of the machine); cut in the first round, nothing was measured: the interrupt goes on.
    Returns (runs of the complete rounds, how many, whether it was cut)."""
    done = 0
    try:
        for r in range(rounds):
            run_round(r)
            done += 1
    except KeyboardInterrupt:
        if done == 0:
            raise
        print(f"interrupted in round {done}: {done} of {rounds} rounds complete, summarized", flush=True)
        return {k: v[:done] for k, v in runs.items()}, done, True
    return runs, done, False


# capture passes: name -> (stored format, SGLang's prefill CUDA graph kept on, more capture_config settings); a name
# holds no "_" (the keys split on it). graphsha: the writer as it was before xxh3-128 (sha256 files), the checksum's
# A/B in the same run; graphio8: eight file threads in the writer instead of four
PASSES = {"bf16": ("bf16", False, {}), "fp8": ("fp8", False, {}), "graph": ("bf16", True, {}),
          "graphfp8": ("fp8", True, {}), "graphsha": ("bf16", True, {"checksum": "sha256"}),
          "graphio8": ("bf16", True, {"io_threads": 8})}


def print_figures(res: dict) -> None:
    width = max(map(len, res))
    for k, v in res.items():
        print(f"{k.ljust(width)}  {v:,.3f}" if isinstance(v, float) else f"{k.ljust(width)}  {v}")


def summarize_rounds(runs: dict, rounds: int, concurrency, storages, disk_bytes_per_s: float | None,
                     bytes_per_token: dict) -> dict:
    """The ratios of one benchmark run from its passes' tokens/s per round (``runs``: pass -> one value per round;
    passes ``plain_default_conc<c>``, ``plain_conc<c>``, ``capture_<st>_conc<c>``, ``durable_<st>_conc<c>``,
    ``serial``). Each round's best concurrency per kind; ratios within a round (the same spell of the machine), then
    their median, every round and the spread ((max - min) / median). The physical limit of capture per storage is
    min(plain prefill with SGLang's defaults, durable disk bytes/s / bytes per token); with no disk figure
    (``disk_bytes_per_s`` None: a run cut before it measured the disk) the limits are left out, and
    ``durable_ratio_vs_plain_default_<st>``, always given, bounds each from below (the limit is at most the prefill)."""
    per_round = {kind: [_best([runs[f"{kind}_conc{c}"][r] for c in concurrency]) for r in range(rounds)]
                 for kind in ("plain_default", "plain", *(f"capture_{st}" for st in storages),
                              *(f"durable_{st}" for st in storages))}
    per_round["serial"] = runs["serial"]
    res = {"rounds": rounds}

    def ratio(key, num, den):
        values = [x / y for x, y in zip(num, den) if x == x and y == y and y > 0]
        med = statistics.median(values) if values else float("nan")
        res[key], res[f"{key}_rounds"] = med, " ".join(f"{v:.3f}" for v in values)
        res[f"{key}_spread"] = (max(values) - min(values)) / med if values else float("nan")
    st0 = storages[0]
    ratio("ratio_vs_plain_default", per_round[f"capture_{st0}"], per_round["plain_default"])
    ratio("ratio_vs_plain_nographs", per_round[f"capture_{st0}"], per_round["plain"])
    ratio("ratio_vs_serial_fair", per_round[f"capture_{st0}"], per_round["serial"])
    res["ratio_spread"] = res["ratio_vs_plain_default_spread"]
    prefill = statistics.median(per_round["plain_default"])
    res["plain_default_tokens_per_s"] = prefill
    for st in storages:  # the physical limit: the server's prefill or the disk's durable bandwidth, whichever binds
        ratio(f"durable_ratio_vs_plain_default_{st}", per_round[f"durable_{st}"], per_round["plain_default"])
        ratio(f"ratio_vs_plain_default_{st}", per_round[f"capture_{st}"], per_round["plain_default"])
        if disk_bytes_per_s is None:
            continue
        disk_tps = disk_bytes_per_s / bytes_per_token[st]
        limits = [min(p, disk_tps) for p in per_round["plain_default"]]
        res[f"capture_limit_{st}_tokens_per_s"] = statistics.median(limits)
        res[f"capture_limit_{st}_binds"] = "disk" if disk_tps < prefill else "prefill"
        ratio(f"durable_ratio_vs_limit_{st}", per_round[f"durable_{st}"], limits)
    for fmt in ("bf16", "fp8"):  # the goals name the stored format: its layer-hook pass, else its graph pass
        ran = [st for st in storages if PASSES[st][0] == fmt]
        if not ran or disk_bytes_per_s is None:  # no disk figure: no limits to name
            continue
        res[f"durable_ratio_vs_limit_{fmt}_pass"] = src = fmt if fmt in ran else ran[0]
        for suffix in ("", "_rounds", "_spread"):
            res.setdefault(f"durable_ratio_vs_limit_{fmt}{suffix}", res[f"durable_ratio_vs_limit_{src}{suffix}"])
    return res


_ROUND_LINE = re.compile(r"^\s*round (\d+) (plain_default|plain|serial|hooked_no_capture|capture (\w+))"
                         r"(?: conc(\d+))?( durable)?(?: \(.*\))?: ([\d,.]+|nan)\s*$")


def runs_from_log(lines) -> tuple[dict, int]:
    """The passes' tokens/s per round as this benchmark printed them (``report``), and how many rounds were complete:
    a run cut by its time limit (scripts/gpu_record.sh bench, SIGINT) keeps the rounds it finished; a round cut midway
    is dropped (its passes ran in another spell of the machine than the missing ones would have)."""
    runs: dict[str, dict[int, float]] = {}
    for line in lines:
        m = _ROUND_LINE.match(line)
        if not m:
            continue
        rnd, kind, storage, conc, durable, value = m.groups()
        if storage:
            kind = f"{'durable' if durable else 'capture'}_{storage}"
        name = kind if kind == "serial" else f"{kind}_conc{conc}"
        runs.setdefault(name, {})[int(rnd)] = float(value.replace(",", ""))
    if not runs:
        raise ValueError("no round lines in the log: not this benchmark's output, or cut before its first pass")
    rounds = 1 + max(r for v in runs.values() for r in v)
    # a complete round printed every pass any round printed, the serial pass and a capture among them
    whole = "serial" in runs and any(k.startswith("durable_") for k in runs)
    complete = next((r for r in range(rounds) if not (whole and all(r in v for v in runs.values()))), rounds)
    return {k: [v[r] for r in range(complete)] for k, v in runs.items()}, complete


def gpu(a):
    from transformers import AutoTokenizer

    from eagle3kit.capture.client import CaptureClient
    from eagle3kit.capture.server import SGLangServer, capture_server, stop_all
    from eagle3kit.capture.writer import stage_shares
    from eagle3kit.pipeline import default_aux
    from eagle3kit.target import TargetInfo, resolve_target

    path = resolve_target(a.target)
    info = TargetInfo.read(path)
    aux = default_aux(info.num_layers)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = prompts_from_sharegpt(tok, a.samples, a.max_tokens)
    n_tokens = sum(map(len, prompts.values()))
    out = Path(a.out)
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    extra = list(a.server_args)
    # one GPU, the servers started in turn (each --mem-fraction-static counts what the earlier ones hold)
    mem = lambda f: ["--mem-fraction-static", str(f)]  # noqa: E731
    env = {"EAGLE3KIT_ALLOW_PTRACE": "1"}  # py-spy may attach to the servers' processes (benchmarks/pyspy.py)
    servers = {"plain_default": SGLangServer(path, port=31003, extra_args=extra + mem(0.12),
                                             log_path=out / "bench-plain-default.log", env=env),
               "plain": SGLangServer(path, port=31000, extra_args=extra + ["--disable-cuda-graph"] + mem(0.25),
                                     log_path=out / "bench-plain.log", env=env)}
    # the capture servers share what is left up to 0.8 (the rest: CUDA graphs and activations outside the pools)
    for i, name in enumerate(a.storages):
        storage, prefill_graph, settings = PASSES[name]
        servers[name] = capture_server(path, work / name, aux, port=31010 + i, storage=storage,
                                       prefill_graph=prefill_graph, capture_settings=settings,
                                       extra_args=extra + mem(round(0.25 + 0.55 * (i + 1) / len(a.storages), 3)),
                                       log_path=out / f"bench-capture-{name}.log", env=env)
    import random

    serial = dict(random.Random(a.seed).sample(sorted(prompts.items()), min(a.serial_samples, len(prompts))))
    res = {"bench_prompts": len(prompts), "bench_tokens": n_tokens}
    # the disk first (no server yet, so nothing else writes): a run cut during its rounds keeps its limits
    # (gpu-benchmark-early-writeback, 2026-12-03: measured last, it never ran). Files of a mean sample's bf16 size:
    # every captured slot (aux + final) in bf16 and the token ids, as the writer stores them
    from eagle3kit.extract import bytes_per_token

    sample_mb = bytes_per_token(len(aux) + 1, info.hidden_size, "bf16") * n_tokens / len(prompts) / 2**20
    disk = measure_disk(work / "disk", gb=a.disk_gb, file_mb=sample_mb)
    try:
        for s in servers.values():
            s.start().wait_healthy()
        warm = dict(list(prompts.items())[:32])
        for name in ("plain_default", "plain", a.storages[0]):
            plain_prefill(servers[name].url, warm, 32)
        clients = {st: CaptureClient(servers[st].url, work / st) for st in a.storages}
        for client in clients.values():
            client.capture_many(((f"warm{k}", v) for k, v in warm.items()), 32)
        runs: dict[str, list] = {}  # pass -> tokens/s of each round
        # rounds of every pass in turn: a slow spell of the machine (seen: 20 % between leases, 15 % between two
        # servers within a run) hits every kind of pass alike instead of one; each pass is reported by its best
        def run_round(rnd):
            profile = a.profile_seconds if rnd == a.profile_round % a.rounds else 0
            for c in a.concurrency:
                for name in ("plain_default", "plain"):
                    fresh_start()
                    spies = spy_on(name, servers[name], out, profile) if c == a.concurrency[-1] else []
                    runs.setdefault(f"{name}_conc{c}", []).append(plain_prefill(servers[name].url, prompts, c))
                    for sp in spies:
                        sp.stop()
                    report(f"round {rnd} {name} conc{c}", runs[f"{name}_conc{c}"][-1])
            fresh_start()
            runs.setdefault("serial", []).append(plain_prefill(servers["plain_default"].url, serial, 1, max_new_tokens=1))
            report(f"round {rnd} serial ({len(serial)} random prompts)", runs["serial"][-1])
            # the capture server answering requests it does not capture: the cost of the hooks being there at all
            fresh_start()
            runs.setdefault("hooked_no_capture", []).append(plain_prefill(servers[a.storages[0]].url, prompts,
                                                                          a.concurrency[0]))
            report(f"round {rnd} hooked_no_capture conc{a.concurrency[0]}", runs["hooked_no_capture"][-1])
            for storage, client in clients.items():
                for c in a.concurrency:
                    last = c == a.concurrency[-1]
                    before = scheduler_counts(client)
                    fresh_start(work / storage)
                    spies = spy_on(storage, servers[storage], out, profile, client=True) if last else []
                    tps, dt, bad, markers = timed_capture(client, prompts, c)
                    t_sync = time.time()
                    os.sync()  # until the bytes are on disk: what a sample counted as done must mean
                    durable = tps * dt / (dt + time.time() - t_sync)
                    report(f"round {rnd} capture {storage} conc{c}", tps)
                    report(f"round {rnd} capture {storage} conc{c} durable", durable)
                    runs.setdefault(f"durable_{storage}_conc{c}", []).append(float("nan") if bad else durable)
                    if bad:  # a pass whose captures failed measures nothing: say why, loudly
                        report(f"round {rnd} capture {storage} conc{c} FAILED captures", f"{len(bad)}, first: {bad[0]}")
                    for sp in spies:
                        sp.stop()
                    after = scheduler_counts(client)
                    # the scheduler's share of the pass's wall time in the hooks, and where the writer's went
                    # (its file threads' busy share and their stages, its loop, the copies' wait, back-pressure)
                    res[f"capture_{storage}_conc{c}_hook_share"] = \
                        (after.get("hook_us", 0) - before.get("hook_us", 0)) / 1e6 / dt
                    shares = stage_shares(before, after, dt, servers[storage].capture["io_threads"])
                    res.update({f"capture_{storage}_conc{c}_{k}_share": v for k, v in shares.items()})
                    # a pass with failed captures did less work than it was timed for: it does not count
                    runs.setdefault(f"capture_{storage}_conc{c}", []).append(float("nan") if bad else tps)
                    failed = f"capture_{storage}_conc{c}_failed"
                    res[failed] = res.get(failed, 0) + len(bad)
                    ok = [m for m in markers if m.get("status") == "ok"]
                    if ok:
                        res[f"bytes_per_token_{storage}"] = sum(m["bytes"] for m in ok) / sum(m["n_tokens"] for m in ok)
        runs, rounds, cut = complete_rounds(run_round, a.rounds, runs)  # cut by the phase's limit: those complete
        res.update(rounds_planned=a.rounds, **({"interrupted": True} if cut else {}))
        res.update(pass_figures(runs))
        best_c = max(a.concurrency, key=lambda c: res[f"plain_conc{c}_tokens_per_s"])
        res["plain_prefill_tokens_per_s"] = res[f"plain_conc{best_c}_tokens_per_s"]
        best = {st: max(res[f"capture_{st}_conc{c}_tokens_per_s"] for c in a.concurrency) for st in clients}
        for storage, client in clients.items():
            res[f"capture_{storage}_status"] = json.dumps(client.status().get("rank0", {}).get("counts", {}))
        res["serial_tokens_per_s"] = res["serial_median_tokens_per_s"]
    finally:
        stop_all(servers.values())
    res.update(disk)
    res.update(summarize_rounds(runs, rounds, a.concurrency, list(clients), limit_bytes_per_s(disk),
                                {st: res[f"bytes_per_token_{st}"] for st in clients}))
    for fmt in ("bf16", "fp8"):
        served = [st for st in clients if PASSES[st][0] == fmt and f"bytes_per_token_{st}" in res]
        if f"bytes_per_token_{fmt}" in res:
            continue
        # stored by a graph pass in this run: its files' size; not stored at all: re-encoded captures', measured
        res[f"bytes_per_token_{fmt}"] = (res[f"bytes_per_token_{served[0]}"] if served
                                         else reencoded_bytes_per_token(work / a.storages[0], fmt))
    res["extract_tokens_per_s"] = best[a.storages[0]]  # bf16, the default storage, unless left out
    res["extract_storage"] = a.storages[0]
    res["ratio_vs_plain"] = best[a.storages[0]] / res["plain_prefill_tokens_per_s"]
    res["ratio_vs_serial"] = best[a.storages[0]] / res["serial_tokens_per_s"]
    for storage in a.storages[1:]:
        res[f"extract_{storage}_tokens_per_s"] = best[storage]
        res[f"ratio_vs_plain_{storage}"] = best[storage] / res["plain_prefill_tokens_per_s"]
        res[f"ratio_vs_serial_{storage}"] = best[storage] / res["serial_tokens_per_s"]
    res["bytes_per_token_best"] = min(res["bytes_per_token_bf16"], res["bytes_per_token_fp8"])
    res["ratio_hooked_no_capture_vs_plain"] = res["hooked_no_capture_tokens_per_s"] / res["plain_prefill_tokens_per_s"]
    res["bytes_ratio_fp8_vs_bf16"] = res["bytes_per_token_fp8"] / res["bytes_per_token_bf16"]
    return res


def cpu(a):
    from eagle3kit.capture.reference import ReferenceEngine
    from eagle3kit.pipeline import default_aux
    from eagle3kit.target import TargetInfo, resolve_target

    path = resolve_target(a.target)
    info = TargetInfo.read(path)
    engine = ReferenceEngine(path, default_aux(info.num_layers))
    prompts = prompts_from_sharegpt(engine.tokenizer, a.samples, a.max_tokens)
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    engine.hidden(next(iter(prompts.values())))
    t = time.time()
    for k, ids in prompts.items():
        engine.capture(work, k, ids)
    dt = time.time() - t
    n = sum(map(len, prompts.values()))
    return {"bench_prompts": len(prompts), "bench_tokens": n, "reference_cpu_tokens_per_s": n / dt}


def summarize_log(a) -> int:
    """``--summarize-log``: metrics.json from a run's printed rounds (the storages and concurrencies it printed)."""
    runs, complete = runs_from_log(Path(a.summarize_log).read_text().splitlines())
    if complete == 0:
        raise SystemExit(f"{a.summarize_log}: no complete round to summarize")
    storages = sorted({k.split("_")[1] for k in runs if k.startswith("capture_")}, key=list(PASSES).index)
    concurrency = sorted({int(k.rsplit("conc", 1)[1]) for k in runs if k.startswith("plain_default_conc")})
    res = {"from_log": Path(a.summarize_log).name, "rounds_complete": complete}
    path = Path(a.out) / "metrics.json"  # beside what the writer benchmarks merged there in the same phase
    old = json.loads(path.read_text()) if path.exists() else {}
    # the run's own disk figures and bytes per token where its metrics.json has them (the limits, re-read)
    disk = limit_bytes_per_s(old) if "disk_sync_seconds" in old else None
    if disk is not None:
        res["disk_writeback_bytes_per_s"] = disk
    bpt = {st: old.get(f"bytes_per_token_{st}", old.get(f"bytes_per_token_{PASSES[st][0]}")) for st in storages}
    res.update(summarize_rounds(runs, complete, concurrency, storages, disk if None not in bpt.values() else None, bpt))
    res.update(pass_figures(runs))
    print_figures(res)
    merged = {**old, **res}
    path.write_text(json.dumps(merged, indent=1, sort_keys=True))
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["sglang", "transformers"], default="sglang")
    p.add_argument("--target", default="embedded:smollm2")
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--serial-samples", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    p.add_argument("--out", required=True, help="folder for metrics.json and logs")
    p.add_argument("--work", default="/tmp/eagle3kit-bench", help="scratch folder for the captures")
    p.add_argument("--storages", nargs="+", choices=list(PASSES), default=["bf16", "fp8"],
                   help="capture servers to run (the first is extract_tokens_per_s and ratio_vs_plain_default); a "
                        "format left out has its bytes per token measured on re-encoded captures; graph, graphfp8: "
                        "bf16, fp8 with SGLang's prefill CUDA graph on (prefill_graph); graphsha: graph with sha256 "
                        "files (the checksum before xxh3-128); graphio8: graph with 8 writer file threads")
    p.add_argument("--rounds", type=int, default=3, help="rounds of all passes in turn (ratios per round: median, "
                   "spread)")
    p.add_argument("--seed", type=int, default=0, help="which prompts the serial pass draws")
    p.add_argument("--disk-gb", type=float, default=8, help="GB written to measure the disk's durable bandwidth")
    p.add_argument("--profile-seconds", type=float, default=8,
                   help="py-spy profiles of one round's last-concurrency passes, seconds (0: none)")
    p.add_argument("--profile-round", type=int, default=-1,
                   help="the round profiled (default the last; an earlier one when a time limit may cut the last)")
    p.add_argument("--summarize-log", metavar="LOG", help="no passes: the figures of an earlier run from its printed "
                   "rounds (bench.log), its complete rounds only (a run cut before this benchmark kept its own); no "
                   "disk figure there, so no limits: durable_ratio_vs_plain_default_<storage> bounds them from below")
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[])
    a = p.parse_args(argv)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    if a.summarize_log:
        return summarize_log(a)
    sys.path.insert(0, str(Path(__file__).parent))  # benchmarks/pyspy.py
    os.environ["EAGLE3KIT_ALLOW_PTRACE"] = "1"
    from eagle3kit.capture.writer_process import allow_profiler

    allow_profiler()  # py-spy, our child, may attach to this client too
    res = gpu(a) if a.engine == "sglang" else cpu(a)
    print_figures(res)
    (Path(a.out) / "metrics.json").write_text(json.dumps(res, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
