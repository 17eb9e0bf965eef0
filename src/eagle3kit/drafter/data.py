"""Training data: captured samples read from disk, aligned for the drafter, packed to a token budget, streamed.

Sources (``open_source``):
  * an eagle3kit data set (``eagle3kit extract``; bf16 or fp8 storage: fp8 is decoded to bf16 on read), by split
  * a speculators export (``eagle3kit export speculators`` or speculators' own data generation): the Arrow data
    set's input_ids/loss_mask and ``hidden_states/hs_{i}.safetensors``
Every sample is checked as it is read (the file's sha256 and its token ids against the manifest, or the Arrow row;
shapes, finite values); a bad one is skipped and counted, never trained on.

Memory stays bounded whatever the data set's size: the packing plan needs only the manifest's lengths; samples are
read by DataLoader worker processes a batch at a time (``prefetch`` batches ahead per worker).
Order is a seeded permutation per epoch and batch j goes to rank j % world_size, so a run can resume at any
step (``start``) and a two-rank run sees the same global batches as one rank accumulating two.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3kit.store import StoreError, all_finite, read_manifest, read_settings, records_post_norm


class SampleError(ValueError):
    pass


@dataclass
class SourceInfo:
    layer_ids: list[int] | None  # input_of_layer ids of the slots (aux..., final), when the source says so
    hidden_size: int
    n_states: int  # aux slots + 1 (the final pre-norm state)
    target: str | None
    final_pre_norm: bool | None


class CaptureSource:
    """An eagle3kit data set: the manifest's samples of one split (None: all), in index order."""

    def __init__(self, out_dir, split: str | None = "train"):
        self.root = Path(out_dir)
        if not (self.root / "manifest.jsonl").exists():
            raise StoreError(f"{self.root} is not an eagle3kit data set (no manifest.jsonl). Fix: pass the --out "
                             f"folder of `eagle3kit extract`, or a speculators export")
        self.settings = read_settings(self.root)
        self.entries = sorted((e for e in read_manifest(self.root).values() if split is None or e.get("split") == split),
                              key=lambda e: e["index"])
        self.split = split

    def __len__(self):
        return len(self.entries)

    def length(self, i: int) -> int:
        return int(self.entries[i]["n_tokens"])

    def info(self) -> SourceInfo:
        s = self.settings
        ids = s.get("layer_ids")
        return SourceInfo(ids, int(s.get("hidden_size", 0)), len(ids) if ids else 0, s.get("target"),
                          not records_post_norm(s))

    def load(self, i: int) -> dict:
        from eagle3kit.store import load_checked

        e = self.entries[i]
        try:  # the file's checksum and its token ids against the manifest: a flipped bit is never trained on
            return load_checked(self.root, e)
        except StoreError as ex:
            raise SampleError(f"{e['file']}: {ex}") from None
        except Exception as ex:  # noqa: BLE001 - unreadable file: counted by the caller
            raise SampleError(f"{e['file']}: unreadable ({type(ex).__name__}: {ex})") from None

    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        from safetensors import safe_open

        from eagle3kit.data.render import spans_to_mask

        e = self.entries[i]
        try:
            with safe_open(str(self.root / "samples" / e["file"]), "pt") as f:
                ids = f.get_tensor("token_ids")
        except Exception as ex:  # noqa: BLE001 - a cut or unreadable file: the caller counts and skips it
            raise SampleError(f"{e['file']}: unreadable ({type(ex).__name__}: {ex})") from None
        return ids, torch.tensor(spans_to_mask(e["loss_spans"], e["n_tokens"]), dtype=torch.int64)


class SpeculatorsSource:
    """speculators' --data-path layout: Arrow data set (input_ids, loss_mask) + hidden_states/hs_{row}.safetensors."""

    def __init__(self, path):
        from datasets import load_from_disk

        self.root = Path(path)
        self.ds = load_from_disk(str(self.root))
        self.ds.set_format("torch")
        self._lengths = [int(n) for n in self.ds["seq_len"]] if "seq_len" in self.ds.column_names else \
            [len(r) for r in self.ds["input_ids"]]

    def __len__(self):
        return len(self._lengths)

    def length(self, i: int) -> int:
        return self._lengths[i]

    def info(self) -> SourceInfo:
        from safetensors import safe_open

        with safe_open(str(self.root / "hidden_states" / "hs_0.safetensors"), "pt") as f:
            meta = f.metadata() or {}
            shape = f.get_slice("hidden_states").get_shape()
        ids = json.loads(meta["layer_ids"]) if "layer_ids" in meta else None
        return SourceInfo(ids, int(shape[2]), int(shape[1]), meta.get("model"), True if ids else None)

    def load(self, i: int) -> dict:
        from safetensors.torch import load_file

        p = self.root / "hidden_states" / f"hs_{i}.safetensors"
        try:
            t = load_file(str(p))
        except Exception as ex:  # noqa: BLE001
            raise SampleError(f"{p.name}: unreadable ({type(ex).__name__}: {ex})") from None
        row = self.ds[i]
        if not torch.equal(t["token_ids"].to(torch.int64), row["input_ids"].to(torch.int64)):
            raise SampleError(f"{p.name}: token ids differ from row {i} of the Arrow data set")
        return {"hidden_states": t["hidden_states"], "token_ids": t["token_ids"], "loss_mask": row["loss_mask"]}

    def tokens(self, i: int):
        row = self.ds[i]
        return row["input_ids"], row["loss_mask"]


def open_source(path, split: str | None = "train"):
    p = Path(path)
    if (p / "manifest.jsonl").exists():
        return CaptureSource(p, split)
    if (p / "dataset_info.json").exists() and (p / "hidden_states").is_dir():
        return SpeculatorsSource(p)
    raise StoreError(f"{p}: neither an eagle3kit data set (manifest.jsonl) nor a speculators export "
                     f"(dataset_info.json + hidden_states/). Fix: pass the folder `eagle3kit extract --out` wrote")


VAL_SEED = 0  # the validation carve-out's seed: one split per data set, whatever the training's own seed


class Subset:
    """Some samples of a source (``indices``: positions in it, in that order), read as a source of their own."""

    def __init__(self, source, indices):
        self.source, self.indices = source, list(indices)

    def __len__(self):
        return len(self.indices)

    def length(self, i: int) -> int:
        return self.source.length(self.indices[i])

    def info(self) -> SourceInfo:
        return self.source.info()

    def load(self, i: int) -> dict:
        return self.source.load(self.indices[i])

    def tokens(self, i: int):
        return self.source.tokens(self.indices[i])


def carve_validation(source, percent: float, max_samples: int = 0) -> tuple:
    """(train, validation) of a train split: ``percent`` of its samples (rounded, at least 1 when above 0, never all,
    at most ``max_samples`` when that is above 0)
    drawn by a seeded permutation of the sample positions (``VAL_SEED``), so every run and every resume on that data
    set draws the same ones; each keeps the source's order. The validation samples choose the best checkpoint and
    are never trained on; the held-out split stays for the report. ``percent`` 0: (source, None)."""
    n = len(source)
    val = validation_positions(n, percent, max_samples)
    if not val:
        return source, None
    return Subset(source, [i for i in range(n) if i not in val]), Subset(source, sorted(val))


def validation_positions(n: int, percent: float, max_samples: int = 0) -> set[int]:
    """The positions ``carve_validation`` takes out of a train split of ``n`` samples (a live training's too)."""
    if not percent or n == 0:
        return set()
    k = max(1, round(n * percent / 100))
    k = min(k, max_samples) if max_samples > 0 else k
    if k >= n:
        raise ValueError(f"val_percent={percent}: {k} of the {n} training samples would be validation, none left to "
                         f"train on. Fix: a smaller val_percent (or 0: no checkpoint choice), or extract more samples")
    return set(random.Random(VAL_SEED).sample(range(n), k))


def align(sample: dict, n_states: int, hidden_size: int, max_rows: int | None = None) -> dict:
    """One sample as drafter rows (see drafter.objective): row t = aux g_t, token x_{t+1}, final state at t+1,
    loss mask of x_{t+1}. Checks shapes and finiteness (SampleError otherwise)."""
    hs, ids, mask = sample["hidden_states"], sample["token_ids"], sample["loss_mask"]
    if hs.dim() != 3 or hs.shape[1] != n_states or hs.shape[2] != hidden_size:
        raise SampleError(f"hidden states {tuple(hs.shape)}, expected [T, {n_states}, {hidden_size}]")
    if hs.shape[0] != ids.shape[0] or ids.shape[0] != mask.shape[0] or ids.shape[0] < 2:
        raise SampleError(f"{hs.shape[0]} states, {ids.shape[0]} token ids, {mask.shape[0]} mask entries")
    n = hs.shape[0] - 1 if max_rows is None else min(hs.shape[0] - 1, max_rows)
    aux = hs[:n, :-1].reshape(n, -1)
    final = hs[1:n + 1, -1]
    if not (all_finite(aux) and all_finite(final)):
        raise SampleError("non-finite hidden states")
    return {"aux": aux, "final": final, "input_ids": ids[1:n + 1].to(torch.int64),
            "loss_mask": mask[1:n + 1].to(torch.int64)}


def plan(lengths: list[int], tokens_per_batch: int, seed: int | None, epoch: int = 0) -> list[list[int]]:
    """Sample indices per packed batch: a seeded permutation (None: in order), greedily packed to at most
    ``tokens_per_batch`` rows (a longer sample is cut to the budget)."""
    order = list(range(len(lengths)))
    if seed is not None:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    batches, cur, used = [], [], 0
    for i in order:
        n = min(max(lengths[i] - 1, 0), tokens_per_batch)
        if n == 0:
            continue
        if cur and used + n > tokens_per_batch:
            batches.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        batches.append(cur)
    return batches


def epoch_plan(lengths: list[int], tokens_per_batch: int, seed: int, epoch: int, n_batches: int) -> list[list[int]]:
    """Exactly ``n_batches`` packed batches for ``epoch`` (training's fixed step -> (epoch, batch) map, which resume
    relies on): the epoch's seeded plan cut to ``n_batches``, or, when this epoch's permutation packs into fewer
    batches than epoch 0's did, completed with its own first batches again."""
    batches = plan(lengths, tokens_per_batch, seed, epoch)
    if not batches:
        raise ValueError("no sample has a token to train on")
    while len(batches) < n_batches:
        batches = batches + batches[: n_batches - len(batches)]
    return batches[:n_batches]


def collate(parts: list[dict], first_doc: int = 0) -> dict:
    """``sample_ids``: each row's sample index in the source (a part's ``sample``; -1 unknown), for the teacher's
    token cache (``objective.TeacherTokens``)."""
    docs = [torch.full((p["input_ids"].shape[0],), first_doc + d, dtype=torch.int64) for d, p in enumerate(parts)]
    pos = [torch.arange(1, p["input_ids"].shape[0] + 1, dtype=torch.int64) for p in parts]
    sids = [torch.full((p["input_ids"].shape[0],), p.get("sample", -1), dtype=torch.int64) for p in parts]
    out = {k: torch.cat([p[k] for p in parts]) for k in ("aux", "final", "input_ids", "loss_mask")}
    out.update(doc_ids=torch.cat(docs), position_ids=torch.cat(pos), sample_ids=torch.cat(sids))
    return out


def collate_rows(rows: list[list[dict]], row_len: int, n_aux: int, hidden_size: int) -> dict:
    """Several packed rows as one micro-batch (``ttt.draft_steps(rows=...)``): each row padded to ``row_len``, then
    concatenated. Doc ids stay unique across rows; padding gets doc id -(r + 1) (its own causal block, so no query
    is left without a key) and loss mask 0, so no loss or count sees it (``real_rows`` counts the others)."""
    dtype = next(parts[0]["aux"].dtype for parts in rows if parts)
    out, first = [], 0
    for r, parts in enumerate(rows):
        row = collate(parts, first) if parts else None
        first += len(parts)
        pad = row_len - (0 if row is None else row["input_ids"].shape[0])
        if pad < 0:
            raise ValueError(f"a packed row of {row_len - pad} tokens is longer than row_len {row_len}")
        if pad:
            fill = {"aux": torch.zeros(pad, n_aux, dtype=dtype), "final": torch.zeros(pad, hidden_size, dtype=dtype),
                    "input_ids": torch.zeros(pad, dtype=torch.int64), "loss_mask": torch.zeros(pad, dtype=torch.int64),
                    "doc_ids": torch.full((pad,), -(r + 1), dtype=torch.int64),
                    "position_ids": torch.arange(1, pad + 1, dtype=torch.int64),
                    "sample_ids": torch.full((pad,), -1, dtype=torch.int64)}
            row = fill if row is None else {k: torch.cat([row[k], fill[k]]) for k in fill}
        out.append(row)
    return {k: torch.cat([o[k] for o in out]) for k in out[0]}


def real_rows(batch: dict) -> int:
    """Rows of a batch that stand for data (not ``collate_rows``' padding)."""
    return int((batch["doc_ids"] >= 0).sum())


class PackedBatches(torch.utils.data.IterableDataset):
    """Packed rows ``start..`` of ``batches`` that belong to ``rank`` (j % world == rank), ``rows`` of them per
    micro-batch (``collate_rows``; 1: the row as it is), read by the DataLoader's workers in turn (worker w takes this
    rank's micro-batches w, w + W, ...: the loader returns them in order).
    Yields (j, batch, skipped): j the micro-batch's first row, ``skipped`` the reasons of samples left out of it."""

    def __init__(self, source, batches, n_states: int, hidden_size: int, tokens_per_batch: int, start: int = 0,
                 rank: int = 0, world: int = 1, rows: int = 1):
        self.source, self.batches = source, batches
        self.n_states, self.hidden_size, self.budget = n_states, hidden_size, tokens_per_batch
        self.start, self.rank, self.world, self.rows = start, rank, world, rows

    def _row(self, j: int, skipped: list) -> list[dict]:
        parts, used = [], 0
        for i in self.batches[j]:
            try:
                a = align(self.source.load(i), self.n_states, self.hidden_size, self.budget - used)
            except SampleError as e:
                skipped.append(f"sample {i}: {e}")
                continue
            a["sample"] = i
            parts.append(a)
            used += a["input_ids"].shape[0]
        return parts

    def __iter__(self):
        wi = torch.utils.data.get_worker_info()
        wid, nw = (wi.id, wi.num_workers) if wi else (0, 1)
        mine = [j for j in range(self.start, len(self.batches)) if j % self.world == self.rank]
        for local, g in enumerate(range(0, len(mine), self.rows)):
            if local % nw != wid:
                continue
            skipped = []
            rows = [self._row(j, skipped) for j in mine[g:g + self.rows]]
            if not any(rows):
                batch = None
            elif self.rows == 1:
                batch = collate(rows[0])
            else:
                batch = collate_rows(rows, self.budget, (self.n_states - 1) * self.hidden_size, self.hidden_size)
            yield mine[g], batch, skipped


def loader(source, batches, n_states, hidden_size, tokens_per_batch, start=0, rank=0, world=1, workers: int = 2,
           pin: bool = False, rows: int = 1):
    ds = PackedBatches(source, batches, n_states, hidden_size, tokens_per_batch, start, rank, world, rows)
    kw = {"num_workers": workers, "prefetch_factor": 2, "persistent_workers": False} if workers > 0 else {}
    # its own generator: the workers' base seed is not drawn from the global one (a resume, which makes one loader
    # more, would leave the global generator elsewhere than the uninterrupted run)
    return torch.utils.data.DataLoader(ds, batch_size=None, pin_memory=pin, generator=torch.Generator(), **kw)
