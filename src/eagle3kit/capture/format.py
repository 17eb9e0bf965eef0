"""The capture file: one safetensors file per request (per rank), in speculators' sample layout, plus a marker.

``<key>.rank<r>.safetensors``
    hidden_states   [T, n_aux + 1, H]  bf16   residual stream at the aux layer boundaries, then the last layer's
                                              output before the final norm (speculators' training input); a
                                              capture inside SGLang's prefill graph holds the norm's output there
                                              instead (metadata final_slot: post_norm)
    (fp8 storage:   hidden_states_fp8 [T, n_aux, H] float8_e4m3fn + hidden_states_scale [T, n_aux] float32 for
                    the aux slots, and hidden_states_final [T, H] bf16 for the last slot, instead: the last slot is
                    the teacher's input (the target's logits), which e4m3 would perturb; files of the first fp8
                    layout, every slot in hidden_states_fp8, still read)
    token_ids       [T] int64
    final_normed    [T, H] bf16 (optional)    the final norm's output, what the logits see (SpecForge's hidden_state)
    metadata        layer ids in the "input of layer k" convention, engine, rank, tp size, storage
``<key>.rank<r>.json``
    the marker, written last: {"status": "ok", "checksum", "bytes", "n_tokens", ...} or
    {"status": "incomplete" | "error", "reason": ...}. Its presence means the request is finished.
Both are written under a temporary name and renamed, so a reader never sees half a file.
``_done.rank<r>.jsonl``
    the journal: each marker again, one line each, appended once the marker exists. A client waiting for many
    captures reads the new lines of one file instead of looking for each marker (``JournalTail``). Several
    writers may share it (SGLang's ``--dp N`` workers, or servers writing one folder): each line is one
    ``write`` to a file opened for appending, so lines never mix.
``_status.rank<r>.json`` (``_status.dp<d>.rank<r>.json`` under ``--dp N``)
    each writer's counters, ignored rows by kind and last error, rewritten about every half second.
"""
from __future__ import annotations

import json
import os
import struct
import threading
import time
from pathlib import Path

import torch

from eagle3kit import checksum as _checksum

FORMAT = "eagle3kit-capture/1"
STORAGES = ("bf16", "fp8", "fp32")  # fp32: exact copies of a float32 engine (TP check on the CPU)
FP8_MAX = 448.0  # float8_e4m3fn


def capture_metadata(engine: str, model: str, rank: int, tp_size: int, layer_ids: list[int], num_layers: int,
                     final_normed: bool, final_slot: str = "pre_norm") -> dict:
    """What every capture file says about itself (the hook and the reference engine write the same).
    ``final_slot``: ``pre_norm`` (the last layer's output before the final norm) or ``post_norm`` (the norm's output:
    a capture inside SGLang's prefill graph, ``graph_plugin``)."""
    if final_slot not in ("pre_norm", "post_norm"):
        raise ValueError(f"final_slot={final_slot!r}: 'pre_norm' or 'post_norm'")
    return {"engine": engine, "model": model, "rank": rank, "tp_size": tp_size, "layer_ids": list(layer_ids),
            "layer_convention": "input_of_layer", "num_layers": num_layers, "final_normed": final_normed,
            "final_slot": final_slot,
            "final": f"output of layer {num_layers - 1} " + ("before the final norm" if final_slot == "pre_norm" else
                                                             "after the final norm")}


def sample_name(key: str, rank: int) -> str:
    return f"{key}.rank{rank}"


def fp8_encode(hs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., H]`` states as e4m3 values and one float32 scale per vector (per token and slot): on whatever device
    ``hs`` lives (the capture hook runs it on the GPU, so half the bytes cross to the host)."""
    x = hs.float()
    scale = (x.abs().amax(dim=-1) / FP8_MAX).clamp_min(1e-12)
    return (x / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale


def fp8_encode_states(hs: torch.Tensor) -> dict:
    """``[T, n, H]`` captured states in the fp8 layout: the aux slots as e4m3 with a scale per vector, the last slot
    (the final state before the norm, from which the trainer computes the target's logits) in bf16. Quantized, that
    slot moved the target's argmax on 11 of 480 ShareGPT tokens (SmolLM2; ``tests/test_extract.py -k teachers``):
    training targets that are not the target's. On whatever device ``hs`` lives (the capture hook runs it on the GPU)."""
    q, scale = fp8_encode(hs[:, :-1])
    return {"hidden_states_fp8": q.contiguous(), "hidden_states_scale": scale.contiguous(),
            "hidden_states_final": hs[:, -1].to(torch.bfloat16).contiguous()}


def encode(tensors: dict, storage: str = "bf16") -> dict:
    """Turn captured tensors into the stored tensors of one storage option. fp8 states already encoded (by the
    capture hook, ``fp8_encode_states``) are stored as they are."""
    if storage not in STORAGES:
        raise ValueError(f"storage {storage!r} unknown: choose one of {STORAGES}")
    out = {"token_ids": tensors["token_ids"].to(torch.int64).contiguous()}
    if "hidden_states_fp8" in tensors:
        if storage != "fp8":
            raise ValueError(f"states encoded as fp8 cannot be stored as {storage}")
        out["hidden_states_fp8"] = tensors["hidden_states_fp8"].contiguous()
        out["hidden_states_scale"] = tensors["hidden_states_scale"].float().contiguous()
        if tensors.get("hidden_states_final") is not None:
            out["hidden_states_final"] = tensors["hidden_states_final"].to(torch.bfloat16).contiguous()
    elif storage in ("bf16", "fp32"):
        out["hidden_states"] = tensors["hidden_states"].to(
            torch.bfloat16 if storage == "bf16" else torch.float32).contiguous()
    else:
        out.update(fp8_encode_states(tensors["hidden_states"]))
    if tensors.get("final_normed") is not None:
        fdt = torch.float32 if storage == "fp32" else torch.bfloat16
        out["final_normed"] = tensors["final_normed"].to(fdt).contiguous()
    return out


def decode(stored: dict) -> dict:
    """The inverse of ``encode``: ``hidden_states`` in bf16 whatever the storage (what training reads)."""
    out = dict(stored)
    if "hidden_states_fp8" in out:
        q = out.pop("hidden_states_fp8").float()
        hs = (q * out.pop("hidden_states_scale").unsqueeze(-1)).to(torch.bfloat16)
        final = out.pop("hidden_states_final", None)  # absent in the first fp8 layout (every slot in e4m3)
        out["hidden_states"] = hs if final is None else torch.cat([hs, final.to(torch.bfloat16).unsqueeze(1)], 1)
    if "hidden_states" not in out or "token_ids" not in out:
        raise ValueError(f"not an eagle3kit capture: tensors {sorted(stored)}")
    return out


_ST_DTYPES = {torch.float64: "F64", torch.int64: "I64", torch.float32: "F32", torch.int32: "I32",
              torch.bfloat16: "BF16", torch.float16: "F16", torch.float8_e4m3fn: "F8_E4M3", torch.uint8: "U8"}


def _string_metadata(metadata: dict) -> dict:
    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}
    meta["format"] = FORMAT
    return meta


def write_safetensors(path: Path, tensors: dict, metadata: dict,
                      checksum: str = _checksum.DEFAULT, timing: dict | None = None) -> tuple[int, str]:
    """Write a safetensors file (atomically) straight from the tensors' buffers; returns (bytes, its checksum as
    ``"<algorithm>:<hex>"``, ``eagle3kit.checksum``). ``timing`` (a Counter) gets the microseconds spent hashing
    (``io_hash_us``), starting the writeback (``io_writeback_us``) and the rest (``io_write_us``: open, write,
    rename): what the writer's status reports, to tell which of them binds a capture pass.

    The hot path of the capture: a header, then each tensor's memory handed to ``write`` and the hasher as a
    buffer, so no serialized copy is made and the GIL is released during both (the writer threads live inside
    SGLang's scheduler process). Tensors are laid out by descending element size, as safetensors does, so each
    one is aligned for a zero-copy reader."""
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header, bufs, off = {}, [], 0
    for name in order:
        t = tensors[name].detach().contiguous().cpu()
        if t.dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} has no safetensors name here")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
        if n:
            bufs.append(t.reshape(-1).view(torch.uint8).numpy())
    header["__metadata__"] = _string_metadata(metadata)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    head = struct.pack("<Q", len(h)) + h
    clock = time.perf_counter_ns
    t_start, t_hash = clock(), 0
    hasher = _checksum.new(checksum)
    hasher.update(head)
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            for b in bufs:
                f.write(b)
                t = clock()
                hasher.update(b)
                t_hash += clock() - t
            f.flush()
            t = clock()
            start_writeback(f.fileno())
            t_wb = clock() - t
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    digest = hasher.hexdigest()
    if timing is not None:
        t_all = clock() - t_start
        timing["io_hash_us"] += t_hash // 1000
        timing["io_writeback_us"] += t_wb // 1000
        timing["io_write_us"] += (t_all - t_hash - t_wb) // 1000
    return len(head) + off, _checksum.field(checksum, digest)["checksum"]


def _sync_file_range():
    """libc's sync_file_range (Linux), or None."""
    try:
        import ctypes
        import ctypes.util

        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).sync_file_range
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        return fn
    except (OSError, AttributeError):
        return None


_SYNC_FILE_RANGE = _sync_file_range()
# writeback of each sample file starts as soon as it is written (SYNC_FILE_RANGE_WRITE: queued, not awaited), so the
# disk writes overlap the capture instead of piling up in the page cache for the manifest's group fsync or a final
# sync to pay at once (GPU benchmark, 2026-12-01: the sync after a pass took as long as the pass). E3K_EARLY_WRITEBACK=0
# turns it off (the benchmark's comparison).
EARLY_WRITEBACK = os.environ.get("E3K_EARLY_WRITEBACK", "1") != "0"


def start_writeback(fd: int) -> None:
    """Queue the file's dirty pages for writing to disk, without waiting (Linux); a no-op elsewhere."""
    if EARLY_WRITEBACK and _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, 2)  # SYNC_FILE_RANGE_WRITE; an error only means no head start


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def _tmp_writer_pid(tmp: Path) -> int | None:
    """The writer's pid in a name ``_tmp_name`` made; None for any other file."""
    parts = tmp.name.split(".")
    try:
        return int(parts[-3]) if tmp.name.startswith(".") and parts[-1] == "tmp" and len(parts) >= 5 else None
    except ValueError:
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def remove_dead_writers_tmp(samples_dir, wait_s: float = 0.0, min_age_s: float = 0.0) -> int:
    """Remove the temporary files (``.<file>.<pid>.<thread>.tmp``) of writers whose process is gone: a capture server
    stopped or killed while it wrote a sample (the disk full, the run interrupted) leaves its half-written file, which
    no rename will ever claim (seen on the GPU, gpu-drafter-pipeline-10/faults). A living writer's file is kept;
    ``wait_s`` gives a process that is still exiting that long to go, ``min_age_s`` keeps files younger than that
    (a writer in another pid namespace looks dead from here). Returns how many were removed."""
    end = time.time() + wait_s
    removed = 0
    while True:
        alive = 0
        for f in Path(samples_dir).glob(".*.tmp"):
            pid = _tmp_writer_pid(f)
            if pid is None:
                continue  # not a writer's temporary file
            try:
                old = time.time() - f.stat().st_mtime >= min_age_s
            except FileNotFoundError:
                continue  # renamed or removed meanwhile
            if _pid_alive(pid) or not old:
                alive += 1
                continue
            f.unlink(missing_ok=True)
            removed += 1
        if not alive or time.time() >= end:
            return removed
        time.sleep(0.2)


def atomic_write(path: Path, data: bytes) -> None:
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:  # a full disk, say: no half-written temporary stays behind
        tmp.unlink(missing_ok=True)
        raise


def write_sample(out_dir: Path, key: str, rank: int, tensors: dict, metadata: dict, storage: str = "bf16",
                 extra_marker: dict | None = None, checksum: str = _checksum.DEFAULT,
                 timing: dict | None = None) -> dict:
    """Encode, write ``<key>.rank<r>.safetensors`` then its marker; returns the marker. ``timing``: as
    ``write_safetensors``'s, and ``io_encode_us`` (the storage's encoding here) and ``io_marker_us``."""
    t = time.perf_counter_ns()
    stored = encode(tensors, storage)
    t_encode = time.perf_counter_ns() - t
    name = sample_name(key, rank)
    nbytes, digest = write_safetensors(Path(out_dir) / f"{name}.safetensors", stored, {**metadata, "storage": storage},
                                       checksum, timing)
    hs = stored.get("hidden_states", stored.get("hidden_states_fp8"))
    n_states = int(hs.shape[1]) + ("hidden_states_final" in stored)  # fp8: the last slot is stored apart
    marker = {"status": "ok", "key": key, "rank": rank, "file": f"{name}.safetensors", "bytes": nbytes,
              "checksum": digest, "n_tokens": int(hs.shape[0]),
              "n_states": n_states, "hidden_size": int(hs.shape[2]), "storage": storage,
              "time": time.time(), **(extra_marker or {})}
    t = time.perf_counter_ns()
    write_marker(out_dir, key, rank, marker)
    if timing is not None:
        timing["io_encode_us"] += t_encode // 1000
        timing["io_marker_us"] += (time.perf_counter_ns() - t) // 1000
    return marker


def write_marker(out_dir: Path, key: str, rank: int, marker: dict) -> None:
    """The marker, then its journal line (one ``write`` to a file opened for appending: whole lines, never
    interleaved with another thread's or process's)."""
    data = json.dumps(marker).encode()
    atomic_write(Path(out_dir) / f"{sample_name(key, rank)}.json", data)
    fd = os.open(journal_path(out_dir, rank), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data + b"\n")
    finally:
        os.close(fd)


def journal_path(out_dir, rank: int) -> Path:
    return Path(out_dir) / f"_done.rank{rank}.jsonl"


def status_path(out_dir, rank: int, dp_rank: int | None = None) -> Path:
    """One status file per writer: per TP rank, and per data-parallel worker when SGLang runs ``--dp N``."""
    return Path(out_dir) / (f"_status.rank{rank}.json" if dp_rank is None else f"_status.dp{dp_rank}.rank{rank}.json")


def read_statuses(out_dir) -> dict:
    """Every writer's status, keyed ``rank<r>`` (or ``dp<d>.rank<r>``); unreadable ones are skipped."""
    out = {}
    for p in sorted(Path(out_dir).glob("_status.*.json")):
        try:
            out[p.name[len("_status."):-len(".json")]] = json.loads(p.read_text())
        except (OSError, ValueError):
            pass
    return out


class JournalTail:
    """The markers appended to a rank's journal since this tail was opened (earlier lines are not read)."""

    def __init__(self, out_dir, rank: int = 0):
        self.path = journal_path(out_dir, rank)
        try:
            st = self.path.stat()
            self.offset, self.inode = st.st_size, st.st_ino
        except FileNotFoundError:
            self.offset, self.inode = 0, None
        self._rest = b""

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_ino != self.inode or st.st_size < self.offset:  # a new journal: read it from its start
                    self.offset, self.inode, self._rest = 0, st.st_ino, b""
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *lines, self._rest = (self._rest + data).split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]


def read_marker(out_dir: Path, key: str, rank: int = 0) -> dict | None:
    p = Path(out_dir) / f"{sample_name(key, rank)}.json"
    return json.loads(p.read_text()) if p.exists() else None


def read_sample(path: Path) -> tuple[dict, dict]:
    """(decoded tensors, metadata) of one capture file."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        stored = {k: f.get_tensor(k) for k in f.keys()}
    return decode(stored), {k: _maybe_json(v) for k, v in meta.items()}


def _maybe_json(v: str):
    try:
        return json.loads(v)
    except (ValueError, TypeError):
        return v
