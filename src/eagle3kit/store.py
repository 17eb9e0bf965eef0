"""A data set of captured hidden states on disk, what training reads, and how it is checked.

<out_dir>/
  extraction.json     the settings the data set was made with (a resume with other settings is refused)
  manifest.jsonl      one line per finished sample, appended after its file is on disk (fsynced, in groups):
                      key, index, conv_id, split, n_tokens, file, bytes, checksum (eagle3kit.checksum; lines
                      written before 2026-12-05 hold sha256), token_sha256, loss_spans
  samples/            <key>.rank<r>.safetensors + <key>.rank<r>.json (markers), written by the capture
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load

from eagle3kit import checksum
from eagle3kit.capture.format import decode, read_sample
from eagle3kit.data.render import spans_to_mask

MANIFEST = "manifest.jsonl"
SETTINGS = "extraction.json"


class StoreError(ValueError):
    pass


def token_sha256(token_ids) -> str:
    t = torch.as_tensor(token_ids, dtype=torch.int64).contiguous()
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def read_manifest(out_dir: Path, malformed: list | None = None) -> dict[str, dict]:
    """key -> last manifest line for it. A line that is not a sample's entry is left out (its sample counts as not
    done, so a resume captures it again); a torn last line is what a crash while appending leaves, any other one is
    added to ``malformed`` as (line number, text) when a list is given (``verify`` reports them)."""
    path = Path(out_dir) / MANIFEST
    entries: dict[str, dict] = {}
    if not path.exists():
        return entries
    with open(path) as f:
        lines = f.readlines()
    for n, line in enumerate(lines, 1):
        try:
            e = json.loads(line)
            entries[e["key"]] = e
        except (json.JSONDecodeError, KeyError, TypeError):
            torn_tail = n == len(lines) and not line.endswith("\n")
            if malformed is not None and not torn_tail:
                malformed.append((n, line.strip()[:80]))
    return entries


def compact_manifest(out_dir: Path, drop: set = frozenset()) -> None:
    """Rewrite the manifest with the last good line of each key not in ``drop`` (atomically, fsynced): what a resume
    does when lines are malformed or samples are to be captured again."""
    path = Path(out_dir) / MANIFEST
    keep = [e for k, e in sorted(read_manifest(out_dir).items(), key=lambda kv: kv[1]["index"]) if k not in drop]
    tmp = path.with_name(f".{MANIFEST}.tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in keep)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


def cut_torn_tail(path) -> int:
    """Cut a JSONL file back to its last newline; returns the bytes cut. A crash or a full disk in the middle of an
    append leaves a torn last line; the next run's first append would join it into one bad line inside the file,
    which hides the complete record written onto it and reads as corruption ever after (seen on the GPU:
    gpu-drafter-pipeline-9/faults, a manifest after a disk-full stop and its resume). Every appender of a file that
    a resume reopens calls this first. A last line that is a whole JSON object (only its newline was lost) is what the
    readers count as written: it is kept and given its newline, not cut (the manifest's reader had counted such a
    sample as done, and this cut it, so the resume captured neither; an audit's case)."""
    path = Path(path)
    if not path.exists():
        return 0
    with open(path, "rb+") as f:
        end = f.seek(0, os.SEEK_END)
        if not end:
            return 0
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return 0
        pos, cut = end, 0
        while pos > 0:
            start = max(0, pos - 65536)
            f.seek(start)
            i = f.read(pos - start).rfind(b"\n")
            if i >= 0:
                cut = start + i + 1
                break
            pos = start
        f.seek(cut)
        try:
            whole = isinstance(json.loads(f.read(end - cut)), dict)  # an object's truncation never parses
        except ValueError:
            whole = False
        if whole:
            f.seek(end)
            f.write(b"\n")
        else:
            f.truncate(cut)
        f.flush()
        os.fsync(f.fileno())
    return 0 if whole else end - cut


class ManifestWriter:
    """Appends a sample's manifest line only once its file is on disk (a power cut cannot leave a "done" sample
    without its bytes). ``append(entry, file)`` queues; every ``group`` entries or ``seconds`` (and at ``close``) the
    queued files are fsynced, then their folder (the renames that made them), then the lines are appended and the
    manifest fsynced: one group of syncs, off the server's path. A crash before a group's turn leaves those samples
    out of the manifest (their files may exist): a resume captures them again."""

    def __init__(self, out_dir: Path, group: int = 64, seconds: float = 2.0):
        self.path = Path(out_dir) / MANIFEST
        cut = cut_torn_tail(self.path)  # a previous run's torn last line (its sample is not done: captured again)
        if cut:
            print(f"[extract] {self.path}: cut a torn last line ({cut} bytes) that a stopped run left", flush=True)
        self._f = open(self.path, "a")
        self.group, self.seconds = group, seconds
        self._queued: list[tuple[dict, Path | None]] = []
        self._since = time.monotonic()

    def append(self, entry: dict, file: Path | None = None) -> None:
        self._queued.append((entry, file))
        if len(self._queued) >= self.group or time.monotonic() - self._since >= self.seconds:
            self.flush()

    def flush(self) -> None:
        if not self._queued:
            return
        folders = set()
        for _, file in self._queued:
            if file is not None:
                _fsync_path(file)
                folders.add(Path(file).parent)
        for d in folders:
            _fsync_path(d)
        self._f.write("".join(json.dumps(e, separators=(",", ":")) + "\n" for e, _ in self._queued))
        self._f.flush()
        os.fsync(self._f.fileno())
        self._queued.clear()
        self._since = time.monotonic()

    def queued(self) -> int:
        """Entries waiting for their group's sync (not yet in the manifest)."""
        return len(self._queued)

    def close(self):
        try:
            self.flush()
        finally:
            self._f.close()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


LATER_KEYS = {"split"}  # settings that data sets made before they existed do not record (a resume accepts those)


def read_settings(out_dir) -> dict:
    """A data set's settings (``extraction.json``); {} when it has none (a speculators export, an older eagle3kit)."""
    path = Path(out_dir) / SETTINGS
    return json.loads(path.read_text()) if path.exists() else {}


def records_post_norm(settings: dict) -> bool:
    """Whether a data set's settings record its last slot as the final norm's output (``final_slot: post_norm``:
    captured inside SGLang's prefill graph, or derived); without the key it is the state before the norm."""
    return settings.get("final_slot", "pre_norm") == "post_norm"


SETTING_DEFAULTS = {"final_slot": "pre_norm"}  # what a data set's settings mean where they leave the key out


def check_settings(out_dir: Path, settings: dict) -> None:
    """Write extraction.json on the first run; on a resume, refuse other settings (they would mix data sets)."""
    path = Path(out_dir) / SETTINGS
    if path.exists():
        # a key left out when it holds its default (final_slot: pre_norm) compares as that default on both sides: a
        # post-norm data set resumed without --prefill-graph would otherwise mix the two kinds of last slot
        old = {**SETTING_DEFAULTS, **json.loads(path.read_text())}
        diff = {k: (old.get(k), v) for k, v in {**SETTING_DEFAULTS, **settings}.items()
                if old.get(k) != v and (k in old or k not in LATER_KEYS)}
        if diff:
            raise StoreError(f"{out_dir} was made with other settings {diff} (old, new). Fix: resume with the same "
                             f"settings, or choose a new output directory; nothing in {out_dir} was changed")
        return
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=1, sort_keys=True))


def load_entry(out_dir: Path, entry: dict) -> dict:
    """One sample as training reads it: hidden_states (bf16 whatever the storage), token_ids, loss_mask."""
    tensors, _ = read_sample(Path(out_dir) / "samples" / entry["file"])
    tensors["loss_mask"] = torch.tensor(spans_to_mask(entry["loss_spans"], entry["n_tokens"]), dtype=torch.int64)
    return tensors


def read_checked(out_dir: Path, entry: dict) -> tuple[dict, dict]:
    """(decoded tensors, file metadata) of a sample, read once and hashed and parsed from the same bytes;
    StoreError naming the problem when the file is missing, differs from the manifest's checksum or is unreadable."""
    path = Path(out_dir) / "samples" / entry["file"]
    if not path.exists():
        raise StoreError(f"file {path.name} is missing")
    blob = path.read_bytes()
    try:
        ok = checksum.matches(entry, blob)
    except (KeyError, ValueError) as ex:
        raise StoreError(f"the manifest's line for {path.name} names no usable checksum ({ex}); its file cannot be "
                         f"checked. Fix: capture it again (`eagle3kit extract` with the same settings)") from None
    if not ok:
        raise StoreError(f"checksum differs from the manifest ({path.name} changed or is corrupt)")
    try:
        return decode(load(blob)), _file_metadata(blob)
    except Exception as ex:  # noqa: BLE001 - any parse failure is the file's problem
        raise StoreError(f"{path.name} unreadable: {type(ex).__name__}: {ex}") from None


def load_checked(out_dir: Path, entry: dict) -> dict:
    """``load_entry`` of a sample whose file checksum and token ids match the manifest (StoreError otherwise):
    what exporters hand to another trainer, which has no way to check."""
    t, _ = read_checked(out_dir, entry)
    if token_sha256(t["token_ids"]) != entry["token_sha256"]:
        raise StoreError(f"{entry['file']}: token ids differ from the manifest's")
    t["loss_mask"] = torch.tensor(spans_to_mask(entry["loss_spans"], entry["n_tokens"]), dtype=torch.int64)
    return t


class HiddenStatesDataset(torch.utils.data.Dataset):
    """The finished samples of one split, in index order (bf16 and fp8 storage alike)."""

    def __init__(self, out_dir, split: str | None = "train"):
        self.out_dir = Path(out_dir)
        entries = [e for e in read_manifest(self.out_dir).values() if split is None or e.get("split") == split]
        self.entries = sorted(entries, key=lambda e: e["index"])

    def __len__(self):
        return len(self.entries)

    def __getitem__(self, i):
        return load_entry(self.out_dir, self.entries[i])


@dataclass
class VerifyReport:
    checked: int = 0
    ok: int = 0
    problems: list = field(default_factory=list)  # {"key", "problem"}
    unlisted: list = field(default_factory=list)  # sample files on disk that no manifest entry names (not data)

    @property
    def passed(self) -> bool:
        return self.checked > 0 and not self.problems


def require_dataset(out_dir) -> Path:
    """``out_dir`` as a Path, or StoreError naming it when it is not a data set ``eagle3kit extract`` wrote."""
    out_dir = Path(out_dir)
    if not (out_dir / "manifest.jsonl").exists() and not (out_dir / SETTINGS).exists():
        raise StoreError(f"{out_dir} is not an eagle3kit data set (no manifest.jsonl, no {SETTINGS}); give the --out "
                         f"folder of `eagle3kit extract`")
    return out_dir


def all_finite(t: torch.Tensor) -> bool:
    """No inf or NaN in ``t``. bf16 on the CPU by its bits (a value is inf or NaN when its 8 exponent bits are all
    set): one masked max in numpy, ~12x faster than ``torch.isfinite(t).all()``, which took most of ``verify``'s time
    (benchmarks/verify_throughput.py under cProfile); other dtypes and devices by ``torch.isfinite``."""
    if t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.numel():
        return int((t.contiguous().view(torch.int16).numpy() & 0x7F80).max()) != 0x7F80
    return bool(torch.isfinite(t).all())


def verify(out_dir, expected_states: int | None = None, hidden_size: int | None = None,
           workers: int | None = None) -> VerifyReport:
    """Every manifest entry: file present, checksum, token ids, length, layer count, hidden size, finite values.
    ``workers`` threads check samples at once (default: the cores, at most 8; hashing, decoding and the finite-value
    scan release the GIL): one thread checked ~0.4 GB/s before the bit-level finite check, ~0.8 GB/s after (2-core CPU,
    benchmarks/verify_throughput.py), and 03's checks of GPU data sets (17.8 GB in gpu-drafter-pipeline-10, 35 GB in
    -8) ran past their phase's limit. Problems are reported in the samples' order whatever the number of workers."""
    out_dir = require_dataset(out_dir)
    settings = read_settings(out_dir)
    expected_states = expected_states or (len(settings["layer_ids"]) if "layer_ids" in settings else None)
    hidden_size = hidden_size or settings.get("hidden_size")
    rep, malformed = VerifyReport(), []
    entries = read_manifest(out_dir, malformed)
    if not (out_dir / MANIFEST).exists():
        rep.problems.append({"key": MANIFEST, "problem": f"missing from {out_dir}: no sample is part of the data set "
                             f"without it. Fix: rerun the extraction with the same settings into {out_dir} (it "
                             f"captures the samples again)"})
    listed = {e.get("file") for e in entries.values()}
    rep.unlisted = sorted(p.name for p in (out_dir / "samples").glob("*.safetensors") if p.name not in listed) \
        if (out_dir / "samples").is_dir() else []
    for n, text in malformed:  # a done sample's line garbled: its sample is not in the data set until recaptured
        rep.problems.append({"key": f"{MANIFEST}:{n}", "problem": f"not a sample entry ({text!r}); a resume of the "
                             f"extraction captures what it named again"})

    def check(e: dict) -> str | None:  # the sample's problem, or None
        try:
            t, meta = read_checked(out_dir, e)
        except StoreError as err:
            return str(err)
        layers = meta.get("layer_ids")
        hs, ids = t["hidden_states"], t["token_ids"]
        if "layer_ids" in settings and layers is not None and json.loads(layers) != settings["layer_ids"]:
            return f"captured at layers {json.loads(layers)}, the data set's settings say {settings['layer_ids']}"
        if hs.shape[0] != e["n_tokens"] or ids.shape[0] != e["n_tokens"]:
            return f"{hs.shape[0]} hidden-state rows / {ids.shape[0]} token ids, manifest says {e['n_tokens']}"
        if token_sha256(ids) != e["token_sha256"]:
            return "token ids differ from the ones sent"
        if expected_states and hs.shape[1] != expected_states:
            return f"{hs.shape[1]} layers, expected {expected_states}"
        if hidden_size and hs.shape[2] != hidden_size:
            return f"hidden size {hs.shape[2]}, expected {hidden_size}"
        if not all_finite(hs):
            return "non-finite values"
        return None

    ordered = sorted(entries.items(), key=lambda kv: kv[1]["index"])
    workers = min(max(1, workers or min(8, os.cpu_count() or 1)), max(1, len(ordered)))
    pool = ThreadPoolExecutor(workers, thread_name_prefix="verify") if workers > 1 else None
    # in the samples' order; each thread holds one sample at a time
    problems = (pool.map if pool else map)(check, (e for _, e in ordered))
    try:
        for (key, _), problem in zip(ordered, problems):
            rep.checked += 1
            if problem is None:
                rep.ok += 1
            else:
                rep.problems.append({"key": key, "problem": problem})
    finally:
        if pool:
            pool.shutdown(cancel_futures=True)
    return rep


def _file_metadata(blob: bytes) -> dict:
    """The ``__metadata__`` of a safetensors file's header (strings)."""
    n = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8:8 + n]).get("__metadata__", {})


def new_folder(dest, what: str, force: bool = False) -> Path:
    """``dest`` made as an empty folder for ``what`` (derive, export) to write; a ``FolderError`` (a StoreError too)
    when ``folders.claim`` refuses it (a file, or a folder holding what ``what`` did not write; nothing is changed
    then)."""
    import shutil

    from eagle3kit.folders import FolderError, claim

    dest = Path(dest)
    try:
        replace = claim(dest, what, force)
    except FolderError as e:
        raise StoreError(str(e)) from None
    if replace:
        shutil.rmtree(dest)
    dest.mkdir(parents=True, exist_ok=True)
    return dest


def publish(tmp: Path, dest: Path) -> Path:
    """``tmp`` (a folder written beside ``dest``, made by mkdtemp) becomes ``dest`` by one rename, readable by other
    users (mkdtemp's 0700 would keep a server running as another user out); a ``dest`` already there is replaced (the
    caller has ``folders.claim``-ed it)."""
    import shutil

    os.chmod(tmp, 0o755)
    old = None
    if dest.exists():  # moved aside first: ``dest`` is the old folder or the new one, never a part of either
        old = dest.with_name(f"{tmp.name}.old")
        os.replace(dest, old)
    os.replace(tmp, dest)
    _fsync_path(dest.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return dest


def leaves_no_partial_dest(fn):
    """For ``fn(src, dest, ...)`` writing a new folder ``dest`` (new, empty, ``fn``'s own earlier output, or any
    folder with ``force=True``: ``folders.claim``): ``fn`` writes
    into a hidden sibling (``.<name>.partial-*``) that becomes ``dest`` by one rename when it returns. So ``dest``
    never holds a part: not when ``fn`` raises (the sibling is removed and ``dest`` left as it was, so a rerun after
    the fix finds it as before), and not when the process is killed (a killed SpecForge export used to leave a
    smaller data set at ``dest`` that loads; an audit's case: 25 of 91 samples)."""
    import functools
    import shutil
    import tempfile

    from eagle3kit.folders import FolderError, claim, mark

    kind = fn.__name__.replace("to_", "export ")  # derive, export speculators, export specforge

    @functools.wraps(fn)
    def wrapper(src, dest, *args, force: bool = False, **kwargs):
        dest_path = Path(dest)
        try:
            claim(dest_path, kind, force)  # nothing the user put there is replaced (``folders``)
        except FolderError as e:
            raise StoreError(str(e)) from None
        dest_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest_path.name}.partial-", dir=dest_path.parent))
        try:
            out = fn(src, tmp, *args, **kwargs)
            mark(tmp, kind)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        publish(tmp, dest_path)
        return {**out, "dest": str(dest_path)} if isinstance(out, dict) and "dest" in out else out
    return wrapper


@leaves_no_partial_dest
def derive(src, dest, storage: str | None = None, final_slot: str | None = None, keep_final_normed: bool = False) -> dict:
    """A new data set from ``src`` with every sample re-encoded: ``storage`` (e.g. fp8 from bf16 captures: the same
    ``encode`` the capture writer uses) and/or ``final_slot="post_norm"`` (the last slot replaced by the final norm's
    output, what an engine that hands out post-norm states gives; for the acceptance experiment, needs a capture
    with ``final_normed``). Splits, keys and loss spans are kept; ``dest`` must be new."""
    from eagle3kit.capture.format import write_sample

    src = require_dataset(src)
    if not (src / SETTINGS).exists():
        raise StoreError(f"{src} has no {SETTINGS} (a data set of an older eagle3kit?): extract it again to derive")
    dest = new_folder(dest, "derive")
    settings = json.loads((src / SETTINGS).read_text())
    if final_slot not in (None, "pre_norm", "post_norm"):
        raise StoreError(f"final_slot={final_slot!r}: choose 'post_norm' (or leave it unset)")
    if records_post_norm(settings):
        if final_slot == "pre_norm":
            raise StoreError(f"{src}: its last slot is the final norm's output (final_slot post_norm); the state "
                             f"before the norm cannot be recovered from it. Fix: capture without --prefill-graph")
        final_slot = None  # post_norm already: nothing to replace
    if final_slot == "post_norm" and not settings.get("final_normed"):
        raise StoreError(f"{src} holds no final_normed states: capture with --final-normed to derive post-norm data")
    new = {**settings, "storage": storage or settings["storage"], "derived_from": str(src),
           "final_normed": bool(settings.get("final_normed") and keep_final_normed)}
    if final_slot:
        new["final_slot"] = final_slot
    check_settings(dest, new)
    (dest / "samples").mkdir(parents=True, exist_ok=True)
    writer = ManifestWriter(dest)
    n = 0
    try:
        for e in sorted(read_manifest(src).values(), key=lambda e: e["index"]):
            try:  # a sample that fails its checksum never becomes data of the new set
                tensors, meta = read_checked(src, e)
            except StoreError as err:
                raise StoreError(f"{src}: sample {e['key']}: {err}; nothing of it was derived. Fix: `eagle3kit "
                                 f"extract` with the same settings into {src} captures failing samples again "
                                 f"(`eagle3kit verify {src}` lists them), then derive into a new folder") from None
            if final_slot == "post_norm":
                hs = tensors["hidden_states"].clone()
                hs[:, -1] = tensors["final_normed"]
                tensors["hidden_states"] = hs
                meta["final"] = "output of the final norm (post-norm)"
                meta["final_slot"] = "post_norm"
            if not keep_final_normed:
                tensors.pop("final_normed", None)
                meta["final_normed"] = False
            key = e["key"]
            m = write_sample(dest / "samples", key, 0, tensors, meta, new["storage"])
            entry = {k: v for k, v in e.items() if k != "sha256"}  # the old file's; the new one's comes with m
            writer.append({**entry, "file": m["file"], "bytes": m["bytes"], **checksum.carry(m),
                           "storage": new["storage"]}, dest / "samples" / m["file"])
            n += 1
    finally:
        writer.close()
    return {"samples": n, "dest": str(dest), "storage": new["storage"], "final_slot": new.get("final_slot", "pre_norm")}
