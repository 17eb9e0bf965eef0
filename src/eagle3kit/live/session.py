"""A live training's data: conversations rendered as extract renders them, a capture engine, the stream between
them, and the held-out set (captured once, checked, kept in host RAM). ``drafter.training_setup.setup`` calls
``open_live`` when its TrainConfig has ``live`` settings."""
from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

from eagle3kit.data.render_pool import usable_cores
from eagle3kit.live.config import LiveConfig, LiveError
from eagle3kit.live.source import LiveSample, LiveSource, MemorySource, check_capture, heldout_key, validation_key
from eagle3kit.live.stream import LiveStream, ReferenceFeeder, SGLangFeeder

TMPFS_MAGIC = 0x01021994


def on_ram(path: Path) -> bool:
    """Whether ``path`` lies on a RAM filesystem (tmpfs, ramfs): files there never reach a disk."""
    import ctypes
    import ctypes.util

    class Statfs(ctypes.Structure):
        _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 256)]
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    buf = Statfs()
    if libc.statfs(str(path).encode(), ctypes.byref(buf)) != 0:
        return False
    return buf.f_type in (TMPFS_MAGIC, 0x858458F6)  # tmpfs, ramfs


def stream_dir_for(out_dir: Path, lc: LiveConfig, rank: int) -> Path:
    """The stream's folder: the given one, or one under /dev/shm named after the training's out_dir (a resumed run
    finds and clears its own; two trainings never share one)."""
    if lc.stream_dir:
        return Path(lc.stream_dir)
    tag = hashlib.sha256(str(Path(out_dir).resolve()).encode()).hexdigest()[:12]
    return Path("/dev/shm") / f"eagle3kit-live-{tag}-rank{rank}"


def open_live(cfg, dist, out_dir: Path):
    """(train source, held-out source or None, validation source or None, summary extras) for ``cfg`` (a TrainConfig
    with ``live``)."""
    from transformers import AutoTokenizer

    from eagle3kit.drafter.data import SourceInfo, validation_positions
    from eagle3kit.extract import bytes_per_token, load_samples
    from eagle3kit.pipeline import default_aux
    from eagle3kit.target import TargetInfo, resolve_target

    lc = LiveConfig.from_dict(cfg.live)
    path = resolve_target(cfg.target or "embedded:smollm2")
    tinfo = TargetInfo.read(path)
    aux = list(lc.aux_layer_ids) if lc.aux_layer_ids else default_aux(tinfo.num_layers)
    if not all(1 <= k < tinfo.num_layers for k in aux):
        raise LiveError(f"live aux_layer_ids {aux}: in the input_of_layer convention ids run from 1 to "
                        f"{tinfo.num_layers - 1} for {path}")
    layer_ids = aux + [tinfo.num_layers]
    stream = stream_dir_for(out_dir, lc, dist.rank)
    if lc.urls:  # running servers write where they were started: that folder (its parent) is the stream
        if not lc.stream_dir:
            raise LiveError("live urls: give stream_dir, the folder whose samples/ the servers capture into (started "
                            "with capture_dir=<stream_dir>/samples on a RAM filesystem)")
    else:
        shutil.rmtree(stream, ignore_errors=True)  # a killed run's leftovers: never data for this one
    stream.mkdir(parents=True, exist_ok=True)
    if not on_ram(stream):
        raise LiveError(f"live stream_dir {stream} is not on a RAM filesystem (tmpfs): hidden states would reach a "
                        f"disk. Fix: a folder under /dev/shm, or leave stream_dir empty")
    samples_dir = stream / "samples"
    reference = None
    if lc.engine == "transformers":
        from eagle3kit.capture.reference import ReferenceEngine

        reference = ReferenceEngine(path, aux, device=lc.reference_device)
        feeder = ReferenceFeeder(reference, lc.storage)
        tok = reference.tokenizer
    else:
        tok = AutoTokenizer.from_pretrained(path)

        def start_server():
            from eagle3kit.capture.server import capture_server

            s = capture_server(path, samples_dir, aux, port=lc.port, storage=lc.storage,
                               prefill_graph=lc.prefill_graph, extra_args=lc.server_args,
                               log_path=Path(out_dir) / "sglang.log")
            s.start().wait_healthy()
            return s
        expect = dict(capture_dir=str(samples_dir), aux_layer_ids=aux, num_layers=tinfo.num_layers,
                      final_normed=False, storage=lc.storage, prefill_graph=bool(lc.prefill_graph))
        relay = None
        if lc.relay_port:
            from eagle3kit.live.relay import RelayReceiver

            relay = RelayReceiver(samples_dir, lc.relay_port + dist.rank, lc.relay_senders, timeout_s=lc.timeout_s)
        feeder = SGLangFeeder(lc.urls, lc.concurrency, lc.timeout_s, start_server=start_server, expect=expect,
                              relay=relay)
    # the capture server starts (tens of seconds: weights, kernels) while the conversations render; with
    # regeneration the generator starts it, before the replies it renders from
    background = None
    if lc.engine == "sglang" and not lc.regenerate:
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(1, thread_name_prefix="e3k-live-start")
        background = pool.submit(feeder.prepare, samples_dir)
        pool.shutdown(wait=False)
    live = None
    try:
        generator = None
        if lc.regenerate:
            from eagle3kit.data.regenerate import SGLangGenerator, TransformersGenerator

            if reference is not None:
                generator = TransformersGenerator(reference.tokenizer, reference.model, max_context=lc.max_tokens)
            else:
                def serving():
                    feeder.prepare(samples_dir)
                    return feeder.urls
                generator = SGLangGenerator(serving, tok, max_context=lc.max_tokens)
        t0 = time.monotonic()
        rendered, report = load_samples(
            cfg.data, tok, lc.max_samples, lc.max_tokens, lc.split_seed, lc.heldout_percent, regenerate_with=generator,
            regenerate_max_new_tokens=lc.regenerate_max_new_tokens,
            regenerate_concurrency=1 if reference is not None else lc.concurrency,
            regenerated_cache=Path(out_dir) / "regenerated.jsonl" if lc.regenerate else None, lazy=True)
        train, held = [], []  # each sample kept compactly as it is rendered (the data set never held as lists)
        for s in rendered:
            if s.split == "train":
                train.append(LiveSample(s.index, s.conv_id, s.input_ids, s.loss_mask))
            elif len(held) < lc.heldout_max_samples:
                held.append(s)
        seconds = {"live_setup_render_seconds": time.monotonic() - t0}
        if not train:
            raise LiveError(f"--data {cfg.data}: no training conversation ({report.records} records read, "
                            f"all held out or skipped). Fix: more conversations, or a lower heldout_percent")
        try:  # the validation samples that choose the best checkpoint: the positions a file training carves out
            val_at = set(validation_positions(len(train), cfg.val_percent, cfg.val_max_samples))
        except ValueError as e:
            raise LiveError(f"--data {cfg.data}: {e}") from None
        val = [s for i, s in enumerate(train) if i in val_at]
        train = [s for i, s in enumerate(train) if i not in val_at]
        info = SourceInfo(layer_ids, tinfo.hidden_size, len(layer_ids), str(path), not lc.prefill_graph)
        source = LiveSource(train, stream, info, layer_ids, rank=dist.rank, timeout_s=lc.timeout_s,
                            cache=lc.cache_gb > 0 and cfg.epochs > 1)
        bpt = bytes_per_token(len(layer_ids), tinfo.hidden_size, lc.storage)
        live = LiveStream(feeder, source, bpt, int(lc.stream_gb * 1e9), int(lc.cache_gb * 1e9), lc.max_attempts,
                          owns_dir=not lc.urls, log_path=Path(out_dir) / f"stream_log.rank{dist.rank}.jsonl")
        t0 = time.monotonic()
        if background is not None:
            background.result()  # the server's start, or its error
        live.prepare()
        seconds["live_setup_server_wait_seconds"] = time.monotonic() - t0  # after the rendering: what it did not hide
        source.stream = live
        # captured once, checked, kept in host RAM: every rank the same sets (each scores its share)
        t0 = time.monotonic()
        heldout = MemorySource(_capture_once(live, held, info, heldout_key), info) if held else None
        val_src = MemorySource(_capture_once(live, val, info, validation_key), info) if val else None
        seconds["live_setup_capture_seconds"] = time.monotonic() - t0
        print(f"[live] {report.records} conversations rendered in {seconds['live_setup_render_seconds']:.1f} s "
              f"({usable_cores()} cores usable); the capture server ready "
              f"{seconds['live_setup_server_wait_seconds']:.1f} s after; {len(held)} held-out and {len(val)} validation "
              f"samples captured and checked in {seconds['live_setup_capture_seconds']:.1f} s", flush=True)
        extras = {"live_conversations": report.records, "live_train_conversations": len(train),
                  "live_heldout_samples": len(held), "live_val_samples": len(val), "live_stream_dir": str(stream),
                  "live_engine": lc.engine, "live_storage": lc.storage, "live_bytes_per_token": bpt, **seconds}
        return source, heldout, val_src, extras
    except BaseException:  # a server started here stops with the error (it would outlive the call)
        if background is not None:
            background.exception()  # its start ends first (a server it started is then closed below)
        try:
            if live is not None:
                live.close()
        finally:
            feeder.close()
        raise


def _capture_once(live: LiveStream, samples, info, key_of) -> list[dict]:
    """Samples captured through the stream once (the held-out and validation sets), checked as every streamed sample
    is, kept in RAM."""
    import torch

    markers = live.capture_now([(key_of(s.index), s.input_ids) for s in samples])
    items = []
    for s in samples:
        m = markers[key_of(s.index)]
        try:
            t = check_capture(live.dir, m, s.input_ids, info.n_states, info.hidden_size)
        except ValueError as e:
            raise LiveError(f"sample {s.index} ({key_of(s.index)}): its capture fails the check ({e})") from None
        finally:
            (live.samples_dir / m["file"]).unlink(missing_ok=True)
            (live.samples_dir / f"{key_of(s.index)}.rank0.json").unlink(missing_ok=True)
        items.append({"hidden_states": t["hidden_states"], "token_ids": t["token_ids"],
                      "loss_mask": torch.tensor(s.loss_mask, dtype=torch.int64)})
    return items


def disk_bytes_of_states(out_dir: Path) -> int:
    """Bytes of hidden-state files (``*.safetensors`` other than the drafter's weights) under ``out_dir``: a live
    training writes none."""
    total = 0
    for root, _, files in os.walk(out_dir):
        for f in files:
            if f.endswith(".safetensors") and f != "model.safetensors":
                total += os.path.getsize(os.path.join(root, f))
    return total
