"""Batch extraction: a conversation data set in, a verified hidden-state data set out (see ``store``).

Resumable: a sample is in the manifest only once its file is on disk, and a rerun skips what the manifest holds,
so a crash loses at most the samples in flight. Two engines write the same files: ``sglang`` (a capture server,
one or several for data parallelism) and ``transformers`` (the reference engine, on the CPU).
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3kit import checksum
from eagle3kit.capture.format import STORAGES, remove_dead_writers_tmp
from eagle3kit.data.conversations import load_conversations, split_of
from eagle3kit.data.render import mask_spans
from eagle3kit.data.render_pool import iter_render
from eagle3kit.store import (SETTINGS, ManifestWriter, StoreError, check_settings, compact_manifest,
                             cut_torn_tail, read_manifest, token_sha256, verify)


class PreflightError(RuntimeError):
    pass


class DiskFullError(OSError):
    """The output disk filled up mid-run: the run stopped cleanly (see ``extract``)."""


class _Stop(Exception):
    pass


def _disk_full(marker: dict) -> bool:
    return marker.get("errno") == errno.ENOSPC or "No space left on device" in str(marker.get("reason", ""))


@dataclass
class Sample:
    key: str
    index: int
    conv_id: str
    split: str
    input_ids: list[int]
    loss_mask: list[int]


def _disk_full_error(out_dir: Path, todo: list, totals: dict, failures: list) -> DiskFullError:
    """The stop report: what is kept, what failed (listed in failures.json when it still fits, else here)."""
    listed = Path(out_dir) / "failures.json"
    try:
        from eagle3kit.capture.format import atomic_write

        atomic_write(listed, json.dumps(failures, indent=1).encode())
        where = f"listed in {listed}"
    except OSError:
        where = "not listed on disk (no space): " + ", ".join(f["key"] for f in failures[:20]) + \
            (" ..." if len(failures) > 20 else "")
    left = len(todo) - totals["written"] - totals["failed"]
    unlisted = totals.get("unlisted", 0)
    return DiskFullError(errno.ENOSPC, f"--out {out_dir}: the disk is full. This run wrote {totals['written']} of "
                         f"{len(todo)} samples and stopped" + (f" ({unlisted} of them could not be entered in the "
                                                               f"manifest and will be captured again)" if unlisted else "")
                         + f"; {totals['failed']} failed ({where}), {left} were not tried. Every sample in the manifest"
                         f" is complete; no temporary file is left. Fix: free space (or --storage fp8, about 0.6 of bf16), "
                         f"then rerun the same command: it resumes")


def prepare_samples(conversations, tokenizer, max_tokens: int = 2048, seed: int = 0, heldout_percent: float = 5.0,
                    world_size: int = 1, rank: int = 0, min_loss_tokens: int = 1, leave_out=(),
                    skipped: dict | None = None, workers: int | None = None) -> list[Sample]:
    """Render, mask and shard (sample i belongs to rank i % world_size). Keys are stable across reruns.
    ``leave_out``: conversation ids not to render (their indices, and so every other key, stay). ``skipped``: where
    the conversations of this shard that become no sample are counted, by reason (the loader's report's).
    ``workers``: processes that render (None: ``render_pool.workers_for``); the samples are the same for any number."""
    return list(iter_samples(conversations, tokenizer, max_tokens, seed, heldout_percent, world_size, rank,
                             min_loss_tokens, leave_out, skipped, workers))


def iter_samples(conversations, tokenizer, max_tokens: int = 2048, seed: int = 0, heldout_percent: float = 5.0,
                 world_size: int = 1, rank: int = 0, min_loss_tokens: int = 1, leave_out=(),
                 skipped: dict | None = None, workers: int | None = None):
    """``prepare_samples`` one sample at a time (``skipped`` is complete once it is exhausted)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    mine = [(i, conv) for i, conv in enumerate(conversations) if i % world_size == rank and conv["id"] not in leave_out]
    return _samples(mine, iter_render(tokenizer, [conv for _, conv in mine], max_tokens, min_loss_tokens, workers),
                    seed, heldout_percent, world_size, rank, skipped)


def _samples(mine, results, seed, heldout_percent, world_size, rank, skipped):
    for (i, conv), (r, why) in zip(mine, results):
        if why:
            if skipped is not None:  # a shard's own count, beside the loader's counts of every conversation
                why = why if world_size == 1 else f"{why} (rank {rank}'s shard of {world_size})"
                skipped[why] = skipped.get(why, 0) + 1
            continue
        yield Sample(f"s{i:07d}", i, conv["id"], split_of(conv["id"], seed, heldout_percent), r[0], r[1])


def bytes_per_token(n_states: int, hidden_size: int, storage: str, final_normed: bool = False) -> float:
    per = {"bf16": n_states * hidden_size * 2, "fp8": (n_states - 1) * (hidden_size + 4) + hidden_size * 2,
           "fp32": n_states * hidden_size * 4}[storage]
    return per + 8 + (hidden_size * (4 if storage == "fp32" else 2) if final_normed else 0)  # + int64 token id (+ normed final state)


def preflight(samples, n_states: int, hidden_size: int, storage: str, out_dir: Path, final_normed=False,
              margin: float = 0.05) -> dict:
    """Estimated bytes against free disk; refuses before anything is written."""
    tokens = sum(len(s.input_ids) for s in samples)
    need = int(tokens * bytes_per_token(n_states, hidden_size, storage, final_normed))
    probe = Path(out_dir)
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    est = {"tokens": tokens, "estimated_bytes": need, "free_bytes": free}
    if need > free * (1 - margin):
        raise PreflightError(
            f"extraction needs about {need / 1e9:.2f} GB ({tokens} tokens x {n_states} layers x {hidden_size} x "
            f"{storage}) but {probe} has {free / 1e9:.2f} GB free. Fix: free space, choose another --out, use "
            f"--storage fp8 (about 0.6 of bf16), or fewer samples/tokens")
    return est


class ReferenceBackend:
    """The transformers engine. ``batch_tokens`` 0: one prompt per forward (the CPU default). Above 0: prompts of
    similar length together, right-padded, at most that many tokens (padding included) per forward: on a GPU one
    135M-parameter forward per prompt ran 14.6 K tokens/s (gpu-drafter-data-attempt2). A batch that fails (out of
    memory) is run again one prompt at a time; a prompt that fails alone is reported as failed."""

    def __init__(self, engine, storage: str = "bf16", batch_tokens: int = 0):
        # ``engine``: a ReferenceEngine, or a function that makes one in ``prepare`` (a data file with nothing to
        # capture is refused before it, without loading the model)
        self._engine, self.storage, self.batch_tokens = engine, storage, int(batch_tokens)

    @property
    def engine(self):
        if not hasattr(self._engine, "capture"):
            self._engine = self._engine()
        return self._engine

    def prepare(self) -> None:
        """The model loaded (if only a function that makes it was given): extract calls this once the data has
        something to capture, before its clock for the capture starts."""
        _ = self.engine

    def close(self, samples_dir: Path | None = None) -> None:
        pass

    def _one(self, samples_dir: Path, s: Sample, tensors=None) -> dict:
        try:
            return self.engine.capture(samples_dir, s.key, s.input_ids, storage=self.storage, tensors=tensors)
        except Exception as e:  # noqa: BLE001 - keep going, report the sample as failed
            return {"status": "error", "key": s.key, "reason": f"{type(e).__name__}: {e}",
                    "errno": getattr(e, "errno", None)}

    def run(self, samples_dir: Path, todo: list[Sample], on_done) -> None:
        for group in batches_by_length(todo, self.batch_tokens):
            states = None
            if len(group) > 1:
                try:
                    states = self.engine.hidden_batched([s.input_ids for s in group])
                except Exception as e:  # noqa: BLE001 - e.g. out of memory: one prompt per forward instead
                    print(f"[extract] a batch of {len(group)} prompts failed ({type(e).__name__}: {e}); "
                          f"running them one at a time", flush=True)
            for i, s in enumerate(group):
                on_done(s.key, self._one(samples_dir, s, states[i] if states else None))


def batches_by_length(samples: list, batch_tokens: int) -> list[list]:
    """Groups of samples for padded forwards: sorted by length, each group's size x its longest prompt at most
    ``batch_tokens`` (a longer prompt alone); ``batch_tokens`` 0 or below: one sample per group, in order."""
    if batch_tokens <= 0:
        return [[s] for s in samples]
    groups, cur = [], []
    for s in sorted(samples, key=lambda x: len(x.input_ids)):
        if cur and (len(cur) + 1) * len(s.input_ids) > batch_tokens:
            groups.append(cur)
            cur = []
        cur.append(s)
    return groups + ([cur] if cur else [])


class SGLangBackend:
    """Capture servers (one URL per data-parallel server) whose hooks write into ``samples_dir``; with no URLs,
    ``start_server()`` starts one, and only when there is work to do."""

    def __init__(self, urls, concurrency: int = 64, timeout: float = 600, start_server=None, expect=None):
        self.urls, self.concurrency, self.timeout = list(urls), concurrency, timeout
        self.start_server = start_server
        self.expect = expect  # the capture config given URLs must match (capture.server.check_capture_server)
        self.server = None
        self._checked = False

    def prepare(self) -> None:
        """Start the server (not timed as extraction) when no URLs were given; check the given ones once."""
        if not self.urls:
            if self.start_server is None:
                raise ValueError("engine sglang needs urls of capture servers, or a server to start")
            self.server = self.start_server()
            self.urls = [self.server.url]
        elif self.server is None and not self._checked:
            from eagle3kit.capture.server import check_capture_server

            for url in self.urls:
                check_capture_server(url, self.expect or {})
            self._checked = True

    def run(self, samples_dir: Path, todo: list[Sample], on_done) -> None:
        from eagle3kit.capture.client import CaptureClient

        client = CaptureClient(self.urls, samples_dir, timeout=self.timeout)
        client.capture_many(((s.key, s.input_ids) for s in todo), concurrency=self.concurrency, on_done=on_done)

    def close(self, samples_dir: Path | None = None) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
            if samples_dir is not None:  # a sample it was writing when stopped: its temporary file goes too
                swept = remove_dead_writers_tmp(samples_dir, wait_s=10)
                if swept:
                    print(f"[extract] removed {swept} half-written temporary files of the stopped server", flush=True)


def extract(samples: list[Sample], out_dir, backend, settings: dict, progress: bool = True, retries: int = 1) -> dict:
    """Capture every sample not yet in the manifest (and those that fail verification); samples that fail get
    ``retries`` more tries in the same run. Returns totals for metrics.json."""
    out_dir = Path(out_dir)
    if settings.get("storage") not in STORAGES:
        raise ValueError(f"storage {settings.get('storage')!r}: choose one of {STORAGES}")
    if (out_dir / SETTINGS).exists():  # a resume: other settings refused first (a first run's are written after
        check_settings(out_dir, settings)  # the preflight, so that one it refuses locks none: its advice works)
    samples_dir = out_dir / "samples"
    # a run stopped mid-write (killed, or its server was) left half-written temporary files: never data, and
    # they hold disk space a resume needs (a minute old at least: a writer of another pid namespace looks dead)
    swept = remove_dead_writers_tmp(samples_dir, min_age_s=60) if samples_dir.is_dir() else 0
    if swept:
        print(f"[extract] removed {swept} half-written temporary files of writers that are gone", flush=True)
    malformed: list = []
    done = read_manifest(out_dir, malformed)
    by_key = {s.key: s for s in samples}
    for key, e in done.items():
        s = by_key.get(key)
        if s is not None and e["token_sha256"] != token_sha256(s.input_ids):
            raise StoreError(f"sample {key} in {out_dir} was made from other tokens (the data or template changed)."
                             f" Fix: use a new output directory; nothing was changed")
    # a resume repairs: what `verify` finds wrong with this run's samples (missing, cut, changed, other layers)
    repair = {p["key"]: p["problem"] for p in verify(out_dir).problems if p["key"] in by_key} if done else {}
    if repair or malformed:  # failing samples are captured again, garbled lines dropped
        for key, why in list(repair.items())[:5]:
            print(f"[extract] capturing {key} again: {why}", flush=True)
        print(f"[extract] {len(repair)} samples fail verification and are captured again; {len(malformed)} "
              f"malformed manifest lines dropped", flush=True)
        compact_manifest(out_dir, drop=set(repair))
        done = {k: e for k, e in done.items() if k not in repair}
    todo = [s for s in samples if s.key not in done]
    est = preflight(todo, len(settings["layer_ids"]), settings["hidden_size"], settings["storage"], out_dir,
                    settings.get("final_normed", False))
    check_settings(out_dir, settings)
    samples_dir.mkdir(parents=True, exist_ok=True)
    totals = {"written": 0, "failed": 0, "tokens": 0, "bytes": 0, "retried": 0}
    failures = []
    if not todo:
        return {"samples": len(samples), "already_done": len(samples), "repaired": 0,
                "manifest_lines_dropped": len(malformed), **totals, "seconds": 0.0,
                "tokens_per_s": 0.0, "startup_seconds": 0.0, "estimated_bytes": 0, "failures": []}
    t_start = time.time()
    backend.prepare()
    bar = None
    if progress:
        from eagle3kit.metrics import progress_bar

        bar = progress_bar(total=len(todo), unit="sample", desc="extract", smoothing=0.1)
    manifest = ManifestWriter(out_dir)
    t0 = time.time()

    def on_done(key, marker):
        s = by_key[key]
        ok = marker.get("status") == "ok" and marker.get("n_tokens") == len(s.input_ids)
        if ok:
            manifest.append({"key": key, "index": s.index, "conv_id": s.conv_id, "split": s.split,
                             "n_tokens": len(s.input_ids), "file": marker["file"], "bytes": marker["bytes"],
                             **checksum.carry(marker), "token_sha256": token_sha256(s.input_ids),
                             "loss_spans": mask_spans(s.loss_mask), "storage": marker.get("storage")},
                            samples_dir / marker["file"])
            totals["written"] += 1
            totals["tokens"] += len(s.input_ids)
            totals["bytes"] += marker["bytes"]
        else:
            totals["failed"] += 1
            failures.append({"key": key, "status": marker.get("status"),
                             "reason": marker.get("reason", f"n_tokens {marker.get('n_tokens')} != {len(s.input_ids)}")})
            if _disk_full(marker):
                raise _Stop  # every later sample would fail the same way: stop here, cleanly
        if bar is not None:
            dt = max(time.time() - t0, 1e-9)
            bar.set_postfix(tok_s=f"{totals['tokens'] / dt:,.0f}", GB=f"{totals['bytes'] / 1e9:.2f}",
                            failed=totals["failed"], refresh=False)
            bar.update(1)

    full = False
    try:
        try:
            backend.run(samples_dir, todo, on_done)
            again = {f["key"] for f in failures}
            if again and retries:  # a sample that failed (a hook error, a server hiccup) gets one more try, named
                for f in failures[:5]:
                    print(f"[extract] capturing {f['key']} again: {f['status']}: {f['reason'][:200]}", flush=True)
                print(f"[extract] {len(again)} failed samples: one more try", flush=True)
                failures.clear()
                totals["failed"] -= len(again)
                totals["retried"] = len(again)
                backend.run(samples_dir, [s for s in todo if s.key in again], on_done)
        except _Stop:
            full = True
        seconds = time.time() - t0
    finally:
        try:
            manifest.close()
        except OSError as e:  # the lines of the last group: their samples are captured again by a resume
            if e.errno != errno.ENOSPC:
                raise
            full, totals["unlisted"] = True, manifest.queued()
        if bar is not None:
            bar.close()
        backend.close(samples_dir)
    if full:
        raise _disk_full_error(out_dir, todo, totals, failures)
    return {"samples": len(samples), "already_done": len(samples) - len(todo), "repaired": len(repair),
            "manifest_lines_dropped": len(malformed), **totals, "seconds": seconds,
            "tokens_per_s": totals["tokens"] / seconds if seconds > 0 else 0.0, "startup_seconds": t0 - t_start,
            "estimated_bytes": est["estimated_bytes"], "failures": failures}


def settings_for(target_path, info, layer_ids, storage, data, max_tokens, final_normed=False,
                 final_slot: str = "pre_norm") -> dict:
    """``final_slot`` ``post_norm`` (a capture inside SGLang's prefill graph) is recorded; ``pre_norm``, the default,
    is what a data set without the key holds."""
    return {"target": str(target_path), "num_layers": info.num_layers, "hidden_size": info.hidden_size,
            "layer_ids": list(layer_ids), "layer_convention": "input_of_layer", "storage": storage,
            "final_normed": final_normed, "data": data, "max_tokens": max_tokens,
            **({"final_slot": final_slot} if final_slot != "pre_norm" else {})}


def load_samples(data: str, tokenizer, max_samples: int | None, max_tokens: int, seed: int = 0,
                 heldout_percent: float = 5.0, world_size: int = 1, rank: int = 0, regenerate_with=None,
                 regenerate_max_new_tokens: int = 512, regenerate_concurrency: int = 1, regenerated_cache=None,
                 regenerate_seconds: float | None = None, lazy: bool = False):
    """Conversations -> rendered samples of this shard; also returns the loader's report (truncation etc.).
    ``lazy``: the samples as an iterator (``iter_samples``; the report's skip counts are complete once it is
    exhausted), for a caller that keeps them compactly.
    ``regenerate_with``: a generator (see data.regenerate) that replaces the assistant turns first; the replies are
    kept in ``regenerated_cache`` (JSONL) so that a resumed run renders exactly the same tokens.
    ``regenerate_seconds``: no new conversation is regenerated after that long (0: only the cached replies), counted
    from when the generator's servers answer (``prepare()``: their start is not part of it); the conversations left
    without the target's replies are not captured, and are counted in the report's skipped."""
    if max_samples is not None and max_samples <= 0:
        raise ValueError(f"max_samples={max_samples}: give a positive number or None for all")
    limit = None if max_samples is None else max_samples * world_size
    convs, report = load_conversations(data, limit=limit)
    left: set = set()  # conversations without the target's replies (a regeneration budget): not data
    if regenerate_with is not None:
        import json

        from eagle3kit.data.regenerate import regenerate

        cache = Path(regenerated_cache) if regenerated_cache else None
        done = {}
        if cache is not None and cache.exists():
            done = _read_regenerated(cache)
        mine = [c for i, c in enumerate(convs) if i % world_size == rank and c["id"] not in done]
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cut_torn_tail(cache)  # the torn reply _read_regenerated dropped: appended to, it would join the next one
        if mine and regenerate_seconds and hasattr(regenerate_with, "prepare"):
            regenerate_with.prepare()  # servers started before the budget's clock: it counts replies only
        deadline = None if regenerate_seconds is None else time.monotonic() + regenerate_seconds
        with open(cache if cache is not None else os.devnull, "a") as f:
            for c in regenerate(mine, regenerate_with, regenerate_max_new_tokens, regenerate_concurrency, deadline):
                done[c["id"]] = c
                f.write(json.dumps(c) + "\n")
                f.flush()  # a crash keeps every reply generated so far
        left = {c["id"] for c in mine if c["id"] not in done}
        if left:  # only with a time budget: these keep their original replies
            why = "not regenerated within the time budget (regenerate_minutes)"
            report.skipped[why] = report.skipped.get(why, 0) + len(left)
            print(f"{'only replies already regenerated used' if regenerate_seconds == 0 else 'regeneration stopped at its time budget'}: "
                  f"{len(left)} of {len(range(rank, len(convs), world_size))} conversations left out (a rerun into the same "
                  f"folder with a larger budget regenerates and captures them)")
        convs = [done.get(c["id"], c) if i % world_size == rank else c for i, c in enumerate(convs)]
    samples = iter_samples(convs, tokenizer, max_tokens, seed, heldout_percent, world_size, rank, leave_out=left,
                           skipped=report.skipped)
    return (samples if lazy else list(samples)), report


def _read_regenerated(cache: Path) -> dict:
    """The replies a previous run regenerated. A torn last line (that run was killed mid-write) is dropped and
    regenerated again; a bad line elsewhere means the file is not ours and is refused."""
    import json

    from eagle3kit.data.conversations import DataError

    lines = [ln for ln in cache.read_text().splitlines() if ln.strip()]
    done = {}
    for n, line in enumerate(lines, 1):
        try:
            c = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):
                print(f"{cache}: last line torn (a run was killed while writing it); that reply is regenerated")
                continue
            raise DataError(f"{cache}:{n}: not a JSON line. Fix: remove the file to regenerate every reply "
                            f"(the captured samples stay)") from None
        done[c["id"]] = c
    return done
