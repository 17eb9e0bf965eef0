"""The trainer's side of the live stream: a data source (``drafter.data``'s interface: ``len``, ``length``,
``tokens``, ``info``, ``load``) whose samples are captured while the trainer runs and never reach a disk.

``load(i)`` runs in the DataLoader's worker processes. It waits for the capture of sample ``i`` of the current epoch
in the stream folder (on a RAM filesystem), reads the file once, checks it as a file of a data set is checked (its
checksum against the capture's marker, its token ids equal to the ids that were asked for, its shape, its layers,
finite values), and hands it over. Then it frees the stream: the file goes (or into the epoch cache) and a line in
``consumed.rank<r>.jsonl`` says which sample was taken. A sample that fails a check is never trained on: its files go,
a reject note asks the producer (``stream.LiveStream``, in the trainer's main process) to capture it again, and the
worker waits for the new capture.
"""
from __future__ import annotations

import json
import os
import time
from array import array
from pathlib import Path

import torch

from eagle3kit.capture.format import read_marker, sample_name

CONSUMED = "consumed.rank{rank}.jsonl"
REJECTS = "rejects"
STATUS = "stream.rank{rank}.json"
CACHE = "cache"


class LiveSample:
    """One training conversation of a live run, kept for the whole run: its token ids (4 bytes a token) and loss mask
    (1 byte a token). As Python lists they took ~44 bytes a token: tens of GB a rank at 600 K conversations, copied
    page by page into each loader worker that read them (reference counts write to every element)."""

    __slots__ = ("index", "conv_id", "_ids", "_mask")

    def __init__(self, index: int, conv_id: str, input_ids, loss_mask):
        self.index = index  # the conversation's index in the data set (as extract's keys)
        self.conv_id = conv_id
        self._ids, self._mask = array("i", input_ids), bytes(loss_mask)
        if len(self._ids) != len(self._mask):
            raise ValueError(f"sample {index}: {len(self._ids)} token ids, {len(self._mask)} loss-mask entries")

    @property
    def input_ids(self) -> list[int]:
        return self._ids.tolist()

    @property
    def loss_mask(self) -> list[int]:
        return list(self._mask)

    @property
    def n_tokens(self) -> int:
        return len(self._ids)

    def tensors(self):
        """(token ids, loss mask) as int64 tensors."""
        return (torch.frombuffer(self._ids, dtype=torch.int32).long(),  # the array is writable: read in place
                torch.frombuffer(bytearray(self._mask), dtype=torch.uint8).long())  # bytes are not: one copy

    def __repr__(self) -> str:
        return f"LiveSample({self.index}, {self.conv_id!r}, {self.n_tokens} tokens)"


def epoch_key(epoch: int, index: int) -> str:
    """One capture of one sample in one epoch: a sample captured again in a later epoch is another key."""
    return f"e{epoch:03d}s{index:07d}"


def heldout_key(index: int) -> str:
    return f"h{index:07d}"


def validation_key(index: int) -> str:
    return f"v{index:07d}"


class StreamError(RuntimeError):
    """The stream cannot deliver (the producer stopped on a fault it cannot mend, or a sample never came)."""


def check_capture(stream_dir: Path, marker: dict, want_ids, n_states: int, hidden_size: int) -> dict:
    """The decoded tensors of a capture (``<stream_dir>/samples/<file>``) whose marker is ``ok``, or ValueError naming what is wrong: the file's
    checksum against its marker, token ids against the request, shape, layers, finite values."""
    from eagle3kit import checksum
    from eagle3kit.store import StoreError, all_finite, read_checked

    if marker.get("status") != "ok":
        raise ValueError(f"capture failed: {marker.get('reason', marker.get('status'))}")
    try:
        t, meta = read_checked(stream_dir, {"file": marker["file"], **checksum.carry(marker)})
    except (StoreError, KeyError) as e:
        raise ValueError(str(e)) from None
    ids = t["token_ids"].to(torch.int64)
    want = torch.as_tensor(want_ids, dtype=torch.int64)
    if ids.shape != want.shape or not torch.equal(ids, want):
        raise ValueError(f"token ids differ from the request ({ids.shape[0]} captured, {want.shape[0]} asked)")
    hs = t["hidden_states"]
    if tuple(hs.shape) != (want.shape[0], n_states, hidden_size):
        raise ValueError(f"hidden states {tuple(hs.shape)}, expected [{want.shape[0]}, {n_states}, {hidden_size}]")
    if not all_finite(hs):
        raise ValueError("non-finite hidden states")
    return {"hidden_states": hs, "token_ids": ids, "meta": meta}


class LiveSource:
    """The train split of a live run, as ``drafter.data`` reads sources. Picklable (the DataLoader's workers get a
    copy): it holds the samples' token ids and the stream folder, never the producer."""

    def __init__(self, samples: list[LiveSample], stream_dir, info, layer_ids: list[int], rank: int = 0,
                 timeout_s: float = 600.0, cache: bool = False):
        self.samples = samples
        self.stream_dir = Path(stream_dir)
        self._info = info
        self.layer_ids = list(layer_ids)
        self.rank, self.timeout_s, self.cache = rank, timeout_s, cache
        self.epoch = 0
        self.scheduled = False  # set by schedule(): a sample exists only once its epoch's order is known
        self.stream = None  # the producer (main process only; dropped when pickled)

    def __getstate__(self):
        d = dict(self.__dict__)
        d["stream"] = None
        return d

    def __len__(self):
        return len(self.samples)

    def length(self, i: int) -> int:
        return self.samples[i].n_tokens

    def info(self):
        return self._info

    def tokens(self, i: int):
        return self.samples[i].tensors()

    def schedule(self, epoch: int, order: list[int]) -> None:
        """The samples this rank will load in ``epoch``, in the order it loads them: the producer captures them in
        that order, as far ahead as the stream's bound allows."""
        self.epoch, self.scheduled = epoch, True
        if self.stream is not None:
            self.stream.schedule(epoch, order)

    def progress(self) -> dict:
        return self.stream.progress() if self.stream is not None else {}

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()

    def _fatal(self) -> str | None:
        try:
            st = json.loads((self.stream_dir / STATUS.format(rank=self.rank)).read_text())
        except (OSError, ValueError):
            return None
        return st.get("fatal")

    def load(self, i: int) -> dict:
        """Sample ``i`` of the scheduled epoch, checked. A capture that fails its check is captured again (never
        skipped, never trained on); only a sample asked for outside any schedule is a SampleError."""
        from eagle3kit.drafter.data import SampleError

        if not self.scheduled:
            raise SampleError(f"live sample {i}: captured only once an epoch's order is scheduled")
        s = self.samples[i]
        key = epoch_key(self.epoch, s.index)
        samples = self.stream_dir / "samples"
        deadline = time.monotonic() + self.timeout_s
        delay = 0.001
        while True:
            marker = _read_marker(samples, key)
            if marker is not None and marker.get("status") == "ok":
                ids, mask = s.tensors()
                try:
                    t = check_capture(self.stream_dir, marker, ids, self._info.n_states, self._info.hidden_size)
                except ValueError as e:
                    self._reject(key, marker, str(e))
                    continue
                self._consumed(key, s.index, marker)
                return {"hidden_states": t["hidden_states"], "token_ids": t["token_ids"], "loss_mask": mask}
            fatal = self._fatal()
            if fatal:
                raise StreamError(f"live stream stopped: {fatal}")
            if time.monotonic() > deadline:
                raise StreamError(f"sample {s.index} ({key}) did not arrive within timeout_s={self.timeout_s:.0f} s; "
                                  f"stream state: {self._status_line()}. Fix: check the capture servers (their logs), "
                                  f"or raise live timeout_s")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.05)

    def _status_line(self) -> str:
        try:
            return (self.stream_dir / STATUS.format(rank=self.rank)).read_text()[:500]
        except OSError:
            return "no status written"

    def _reject(self, key: str, marker: dict, why: str) -> None:
        """Never trained on: its files go, and the producer is asked for it again."""
        samples = self.stream_dir / "samples"
        (samples / marker.get("file", f"{sample_name(key, 0)}.safetensors")).unlink(missing_ok=True)
        (samples / f"{sample_name(key, 0)}.json").unlink(missing_ok=True)
        d = self.stream_dir / REJECTS
        d.mkdir(exist_ok=True)
        tmp = d / f".{key}.{os.getpid()}"
        tmp.write_text(json.dumps({"key": key, "reason": why}))
        os.replace(tmp, d / f"{key}.json")

    def _consumed(self, key: str, index: int, marker: dict) -> None:
        samples = self.stream_dir / "samples"
        f = samples / marker["file"]
        if self.cache:  # kept for later epochs (the producer evicts what is over the cache's bound)
            cache = self.stream_dir / CACHE
            os.replace(f, cache / f"s{index:07d}.safetensors")
            (cache / f"s{index:07d}.json").write_text(json.dumps(marker))
        else:
            f.unlink(missing_ok=True)
        (samples / f"{sample_name(key, 0)}.json").unlink(missing_ok=True)
        line = json.dumps({"key": key, "index": index, "epoch": self.epoch, "bytes": marker.get("bytes", 0),
                           "pid": os.getpid()}).encode() + b"\n"
        fd = os.open(self.stream_dir / CONSUMED.format(rank=self.rank), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def _read_marker(samples: Path, key: str) -> dict | None:
    try:
        return read_marker(samples, key, 0)
    except (OSError, ValueError):  # being renamed into place, or gone with a reject
        return None


class MemorySource:
    """Samples held in host RAM (the live run's held-out set: captured once, checked, kept for the evaluations)."""

    def __init__(self, items: list[dict], info):
        self.items, self._info = items, info

    def __len__(self):
        return len(self.items)

    def length(self, i: int) -> int:
        return int(self.items[i]["token_ids"].shape[0])

    def info(self):
        return self._info

    def load(self, i: int) -> dict:
        return self.items[i]

    def tokens(self, i: int):
        return self.items[i]["token_ids"], self.items[i]["loss_mask"]
