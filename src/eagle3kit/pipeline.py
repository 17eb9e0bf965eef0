"""The steps the notebooks call, with their defaults: one place that ties target, data, engine and store."""
from __future__ import annotations

import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path

from eagle3kit.capture.reference import ReferenceEngine
from eagle3kit.data.conversations import DataError
from eagle3kit.extract import ReferenceBackend, SGLangBackend, extract, load_samples, settings_for
from eagle3kit.extract_config import ExtractConfig
from eagle3kit.layers import sglang_default_aux
from eagle3kit.store import verify
from eagle3kit.target import TargetInfo, resolve_target


SPLIT_RULE = "heldout if sha256(f'{seed}:{conv_id}')[:8] % 10000 < heldout_percent * 100"  # data.conversations.split_of


def default_aux(num_layers: int) -> list[int]:
    """EAGLE-3's usual aux layers in the input_of_layer convention (what SGLang feeds with no ids configured)."""
    return sglang_default_aux(num_layers)


def run_extraction(cfg: ExtractConfig | None = None, **kw) -> dict:
    """Capture a data set with the settings ``cfg`` (an ``ExtractConfig``), or with keyword settings ``kw`` (its fields;
    checked by ``ExtractConfig.from_dict``). Checked whole before anything is loaded or written.
    ``regenerate_minutes``: with ``regenerate``, start no new conversation after that long and capture those
    regenerated (0: only the replies already cached in the folder); None: every conversation.
    ``regenerate_servers`` (engine sglang): servers that write the replies, the capture server and plain SGLang
    servers beside it on ports ``port`` + 11, + 12, ... (``data.regenerate.HelperServers``; stopped before the
    capture), each with ``concurrency`` replies in flight. ``reference_batch_tokens`` (engine transformers): tokens
    per padded forward of prompts of similar length (0: one prompt per forward); None: 16384 on cuda, 0 on cpu.
    ``prefill_graph`` (engine sglang): capture with SGLang's prefill CUDA graph on (``capture.graph_plugin``); the
    last slot is then the final norm's output (recorded ``final_slot: post_norm``; the trainer's teacher honours it)."""
    if cfg is None:
        cfg = ExtractConfig.from_dict(kw)
    elif kw:
        raise TypeError("run_extraction: give an ExtractConfig or keyword settings, not both")
    else:
        cfg.validate()
    if cfg.engine == "transformers":
        from eagle3kit.target import check_device

        check_device(str(cfg.reference_device), "--reference-device")
    reference_batch_tokens = cfg.reference_batch_tokens
    if reference_batch_tokens is None:
        reference_batch_tokens = 16384 if str(cfg.reference_device).startswith("cuda") else 0
    path = resolve_target(cfg.target)
    info = TargetInfo.read(path)
    if not cfg.urls:  # weights loaded here (the reference engine, or the SGLang server started here)
        from eagle3kit.target import check_weight_files

        check_weight_files(path)
    aux = list(cfg.aux_layer_ids) if cfg.aux_layer_ids else default_aux(info.num_layers)
    check_extraction_settings(cfg.out_dir, aux, info.num_layers)
    layer_ids = aux + [info.num_layers]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    settings = settings_for(path, info, layer_ids, cfg.storage, cfg.data, cfg.max_tokens, cfg.final_normed,
                            "post_norm" if cfg.prefill_graph else "pre_norm")
    settings["split"] = {"seed": cfg.seed, "heldout_percent": cfg.heldout_percent, "rule": SPLIT_RULE}
    if cfg.regenerate:
        settings["regenerated_max_new_tokens"] = cfg.regenerate_max_new_tokens
    if cfg.engine == "transformers":
        def reference_engine():  # with the tokenizer above
            return ReferenceEngine(path, aux, final_normed=cfg.final_normed, dtype=cfg.reference_dtype,
                                   device=cfg.reference_device, tokenizer=tok)
        # the model loaded first where the target writes the replies, else once the data has something to capture
        reference = reference_engine() if cfg.regenerate else None
        backend = ReferenceBackend(reference or reference_engine, cfg.storage, batch_tokens=reference_batch_tokens)
    else:  # sglang (ExtractConfig.validate admits no other engine)
        def start_server():
            from eagle3kit.capture.server import capture_server

            s = capture_server(path, Path(cfg.out_dir) / "samples", aux, port=cfg.port, final_normed=cfg.final_normed,
                               storage=cfg.storage, prefill_graph=cfg.prefill_graph,
                               extra_args=cfg.server_args, log_path=Path(cfg.out_dir) / "sglang.log")
            s.start().wait_healthy()
            return s
        expect = dict(capture_dir=str(Path(cfg.out_dir) / "samples"), aux_layer_ids=aux, num_layers=info.num_layers,
                      final_normed=bool(cfg.final_normed), storage=cfg.storage, prefill_graph=bool(cfg.prefill_graph))
        backend = SGLangBackend(cfg.urls, cfg.concurrency, start_server=start_server, expect=expect)
    generator, helpers = None, None
    if cfg.regenerate:
        from eagle3kit.data.regenerate import HelperServers, SGLangGenerator, TransformersGenerator

        if cfg.engine == "transformers":
            generator = TransformersGenerator(reference.tokenizer, reference.model, max_context=cfg.max_tokens)
        else:
            def helper(i):
                from eagle3kit.capture.server import SGLangServer

                return SGLangServer(path, port=cfg.port + 11 + i, extra_args=cfg.server_args,
                                    log_path=Path(cfg.out_dir) / f"sglang-regenerate-{i + 1}.log")

            def serving():  # the capture server generates too (its hook ignores these requests); started on need,
                helpers.start()  # with the helpers' processes beside it (staggered)
                backend.prepare()
                return backend.urls
            generator = SGLangGenerator(serving, tok, max_context=cfg.max_tokens)
            helpers = HelperServers(cfg.regenerate_servers - 1, helper, generator.add_url)
    with exclusive(cfg.out_dir):  # one extraction per folder at a time
        t_data = time.time()
        try:
            samples, report = load_samples(
                cfg.data, tok, cfg.max_samples, cfg.max_tokens, cfg.seed, cfg.heldout_percent, cfg.world_size, cfg.rank,
                regenerate_with=generator,
                regenerate_max_new_tokens=cfg.regenerate_max_new_tokens,
                regenerate_concurrency=1 if cfg.engine == "transformers" else cfg.concurrency * cfg.regenerate_servers,
                regenerated_cache=Path(cfg.out_dir) / "regenerated.jsonl",
                regenerate_seconds=None if cfg.regenerate_minutes is None else 60 * cfg.regenerate_minutes)
            data_seconds = time.time() - t_data
            if helpers is not None:
                helpers.stop()  # the GPU and the CPU back to the capture
            if not samples:
                why = ", ".join(f"{v} {k}" for k, v in report.skipped.items()) or "none skipped"
                raise DataError(f"--data {cfg.data}: nothing to capture ({report.records} records read, {report.kept} "
                                f"usable conversations [{why}], none rendered within --max-tokens {cfg.max_tokens} for "
                                f"shard {cfg.rank}/{cfg.world_size}). Fix: give conversations with a user turn and an "
                                f"assistant reply")
            summary = extract(samples, cfg.out_dir, backend, settings, progress=cfg.progress)
        finally:
            if helpers is not None:
                helpers.stop()
            backend.close()  # also when only regeneration used the server
        rep = verify(cfg.out_dir)
        summary.update(verify_checked=rep.checked, verify_ok=rep.ok, verify_problems=len(rep.problems),
                       data_records=report.records, data_kept=report.kept, data_skipped=dict(report.skipped),
                       data_skipped_total=sum(report.skipped.values()),
                       data_truncated_at_byte=report.truncated_at_byte or 0, layer_ids=layer_ids,
                       data_seconds=data_seconds)  # reading, rendering and (with regenerate) the replies
        if helpers is not None:
            summary.update(regenerate_servers_healthy=1 + len(helpers.healthy),
                           regenerate_helpers_failed=helpers.failed)
        if cfg.prefill_graph and not cfg.urls:  # what SGLang really ran: it turns its prefill graph off for some models
            summary.update(prefill_graph_report(Path(cfg.out_dir) / "sglang.log"))
        summary["failures_list"] = summary.pop("failures")
        write_run_metrics(cfg.out_dir, summary)
    return summary


def prefill_graph_report(log_path) -> dict:
    """The capture server's prefill batches on SGLang's prefill CUDA graph and eager (its log), and a note when none ran
    on the graph: SGLang 0.5.14 turns the graph off for multimodal models (Kimi-K2.5's wrapper among them), under DP
    attention and other settings. The capture is as correct either way; only the speed gained differs."""
    from eagle3kit.spec import graph_prefills

    n = graph_prefills(log_path)
    out = {"prefill_batches_graphed": n["graphed"], "prefill_batches_eager": n["eager"]}
    if n["eager"] and not n["graphed"]:
        out["prefill_graph_note"] = (f"SGLang ran all {n['eager']} prefill batches eagerly ({log_path}): its prefill "
                                     f"graph is off for this model or these flags, so --prefill-graph gains no graph "
                                     f"here (the capture is as correct)")
    return out


def _holder_ended(holder: str) -> bool:
    """True when ``holder`` ("pid N on HOST", as exclusive writes it) names a process of this host that is gone."""
    parts = holder.split()
    if len(parts) != 4 or parts[0] != "pid" or parts[2] != "on" or parts[3] != socket.gethostname():
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return True
    except (ValueError, PermissionError):
        return False
    return False


@contextmanager
def exclusive(out_dir, kind: str = "extraction", orphan_wait_s: float = 30.0):
    """Hold ``<out>/.lock`` (flock) while an extraction (or a training: ``kind``) writes there: a second one into the
    same folder is refused at once, naming the holder. When the holder named in the file has ended on this host (a
    killed run), the lock can still be held for a moment by the processes it forked, which are exiting: that is
    waited for, up to ``orphan_wait_s``. A folder this call created and left empty (a run refused after its checks,
    e.g. nothing to capture) is removed again, so it locks no settings."""
    import fcntl

    out = Path(out_dir)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    lock = out / ".lock"
    f = open(lock, "a+")
    deadline = None
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            if _holder_ended(holder):  # its forked children (loader workers) still hold the lock while they exit
                deadline = deadline or time.monotonic() + orphan_wait_s
                if time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
            f.close()
            gone = (f"; that process has ended but processes it started still hold the lock after {orphan_wait_s:g} s: "
                    f"stop them (fuser {lock})" if deadline else "")
            raise ValueError(f"--out {out}: another {kind} is writing there ({holder}{gone}); wait for it to finish, "
                             f"or choose another --out" + (" (shards of one data set each get their own folder)"
                                                           if kind == "extraction" else "")) from None
    try:
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}")
        f.flush()
        yield
    finally:
        lock.unlink(missing_ok=True)
        f.close()  # closing releases the flock
        if created and not any(out.iterdir()):
            out.rmdir()


def check_extraction_settings(out_dir, aux, num_layers) -> None:
    """The settings checks that need the target (``ExtractConfig.validate`` has the others): the layer ids against
    its depth, and the out folder. Run before anything is loaded or written (so a refused run leaves the folder as it
    was). Each error names the option and the fix."""
    def need(ok, msg):
        if not ok:
            raise ValueError(msg)
    need(len(set(aux)) == len(aux) and list(aux) == sorted(aux),
         f"--layers {' '.join(map(str, aux))}: layer ids must be distinct and increasing (the slots are stored in "
         f"that order); fix: --layers {' '.join(map(str, sorted(set(aux))))}")
    need(all(1 <= k < num_layers for k in aux), f"--layers {' '.join(map(str, aux))}: in the input_of_layer "
                                                f"convention ids run from 1 to {num_layers - 1} for this target")
    out = Path(out_dir)
    need(not out.exists() or out.is_dir(), f"--out {out} is a file; give a folder (it is created if missing)")
    probe = out if out.exists() else next((p for p in out.parents if p.exists()), Path("."))
    need(probe.is_dir(), f"--out {out}: {probe} is a file, so no folder can be made under it; choose another --out")
    need(os.access(probe, os.W_OK), f"--out {out}: {probe} is not writable; choose a folder you can write to")


def write_run_metrics(out_dir, summary: dict) -> dict:
    """``<out>/metrics.json``: this run's totals (flat) and the whole data set's as the manifest holds it after
    every run so far; the failed samples of this run, with their reasons, in ``<out>/failures.json``."""
    import json

    from eagle3kit.capture.format import atomic_write
    from eagle3kit.store import read_manifest

    entries = read_manifest(out_dir).values()
    tokens = sum(e["n_tokens"] for e in entries)
    nbytes = sum(e["bytes"] for e in entries)
    flat = {k: v for k, v in summary.items() if isinstance(v, (int, float, str, bool))}
    flat.update(dataset_samples=len(entries), dataset_tokens=tokens, dataset_bytes=nbytes,
                dataset_bytes_per_token=nbytes / tokens if tokens else 0.0)
    atomic_write(Path(out_dir) / "metrics.json", json.dumps(flat, indent=1, sort_keys=True).encode())
    failures = Path(out_dir) / "failures.json"
    if summary.get("failures_list"):
        atomic_write(failures, json.dumps(summary["failures_list"], indent=1).encode())
    else:
        failures.unlink(missing_ok=True)
    return flat
