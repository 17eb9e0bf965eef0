"""The steps the notebooks call, with their defaults: one place that ties target, data, engine and store."""
from __future__ import annotations

import time
from pathlib import Path

from eagle3kit.capture.reference import ReferenceEngine
from eagle3kit.extract import ReferenceBackend, SGLangBackend, extract, load_samples, settings_for
from eagle3kit.layers import sglang_default_aux
from eagle3kit.store import verify
from eagle3kit.target import TargetInfo, resolve_target


def default_aux(num_layers: int) -> list[int]:
    """EAGLE-3's usual aux layers in the input_of_layer convention (what SGLang feeds with no ids configured)."""
    return sglang_default_aux(num_layers)


def run_extraction(target="embedded:smollm2", data="embedded:sharegpt", out_dir="outputs/extract", engine="transformers",
                   urls=(), aux_layer_ids=None, max_samples=None, max_tokens=2048, storage="bf16", concurrency=64,
                   world_size=1, rank=0, final_normed=False, server_args=(), progress=True, seed=0,
                   heldout_percent=5.0, regenerate=False, regenerate_max_new_tokens=256, reference_device="cpu",
                   reference_dtype="float32", port=30000) -> dict:
    path = resolve_target(target)
    info = TargetInfo.read(path)
    aux = list(aux_layer_ids) if aux_layer_ids else default_aux(info.num_layers)
    layer_ids = aux + [info.num_layers]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    settings = settings_for(path, info, layer_ids, storage, data, max_tokens, final_normed)
    if regenerate:
        settings["regenerated_max_new_tokens"] = regenerate_max_new_tokens
    if engine == "transformers":
        reference = ReferenceEngine(path, aux, final_normed=final_normed, dtype=reference_dtype,
                                    device=reference_device)
        backend = ReferenceBackend(reference, storage)
    elif engine == "sglang":
        def start_server():
            from eagle3kit.capture.server import capture_server

            s = capture_server(path, Path(out_dir) / "samples", aux, port=port, final_normed=final_normed,
                               storage=storage,
                               extra_args=server_args, log_path=Path(out_dir) / "sglang.log")
            s.start().wait_healthy()
            return s
        expect = dict(capture_dir=str(Path(out_dir) / "samples"), aux_layer_ids=aux, num_layers=info.num_layers,
                      final_normed=bool(final_normed), storage=storage)
        backend = SGLangBackend(urls, concurrency, start_server=start_server, expect=expect)
    else:
        raise ValueError(f"engine {engine!r}: choose 'transformers' (CPU reference) or 'sglang' (GPU server)")
    generator = None
    if regenerate:
        from eagle3kit.data.regenerate import SGLangGenerator, TransformersGenerator

        if engine == "transformers":
            generator = TransformersGenerator(reference.tokenizer, reference.model, max_context=max_tokens)
        else:
            def serving():  # the capture server generates too (its hook ignores these requests); started on need
                backend.prepare()
                return backend.urls
            generator = SGLangGenerator(serving, tok, max_context=max_tokens)
    t_data = time.time()
    try:
        samples, report = load_samples(data, tok, max_samples, max_tokens, seed, heldout_percent, world_size, rank,
                                       regenerate_with=generator, regenerate_max_new_tokens=regenerate_max_new_tokens,
                                       regenerate_concurrency=1 if engine == "transformers" else concurrency,
                                       regenerated_cache=Path(out_dir) / "regenerated.jsonl")
        data_seconds = time.time() - t_data
        summary = extract(samples, out_dir, backend, settings, progress=progress)
    finally:
        backend.close()  # also when only regeneration used the server
    rep = verify(out_dir)
    summary.update(verify_checked=rep.checked, verify_ok=rep.ok, verify_problems=len(rep.problems),
                   data_records=report.records, data_kept=report.kept,
                   data_truncated_at_byte=report.truncated_at_byte or 0, layer_ids=layer_ids,
                   data_seconds=data_seconds)  # reading, rendering and (with regenerate) the replies
    summary["failures_list"] = summary.pop("failures")
    write_run_metrics(out_dir, summary)
    return summary


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
