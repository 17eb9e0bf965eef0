"""Exporters from an eagle3kit data set (see ``store``) to the layouts trainers read unmodified.

speculators 0.9.0 (``--data-path DEST``; read through its ArrowDataset / hs_connectors):
  DEST/data-*.arrow, dataset_info.json, state.json   columns input_ids, loss_mask, seq_len; torch format
  DEST/hidden_states/hs_{row}.safetensors            hidden_states [T, n_aux+1, H] bf16 (final slot pre-norm),
                                                      token_ids [T] int64 (row = dataset row)
  DEST/token_freq.pt                                  {token id: count} over loss-masked positions
  bf16 samples are hard-linked (no copy); fp8 samples are decoded to bf16.
Both exporters check every sample against the manifest (file checksum, token ids) first: a sample that fails is left
out and reported (``skipped``), never handed to a trainer that cannot check it; an export of nothing fails.
SpecForge (offline EAGLE-3 data):
  DEST/rows_0-2000/data_{i}.ckpt   torch.save dict: input_ids [T], loss_mask [T], aux_hidden_state [1, T, n_aux*H],
                                    hidden_state [1, T, H] AFTER the final norm (a capture with final_normed, or
                                    one whose last slot is that state: final_slot post_norm, --prefill-graph)
A data set whose last slot is post-norm goes to SpecForge only: speculators applies the target's norm to the last
slot itself.
"""
from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3kit.store import (StoreError, leaves_no_partial_dest, load_checked, new_folder, read_manifest,
                             read_settings, records_post_norm)


def _entries(out_dir, split):
    entries = sorted((e for e in read_manifest(out_dir).values() if split in (None, "all") or e["split"] == split),
                     key=lambda e: e["index"])
    if not entries:
        raise StoreError(f"{out_dir}: no samples of split {split!r} in the manifest (run the extraction first)")
    return entries


def _checked(out_dir, split):
    """(row, entry, sample) of every sample that passes ``load_checked``; the failures in ``skipped``."""
    skipped = []

    def rows():
        row = 0
        for e in _entries(out_dir, split):
            try:
                s = load_checked(out_dir, e)
            except StoreError as err:
                skipped.append(str(err))
                continue
            yield row, e, s
            row += 1
    return rows(), skipped


def _refuse_empty(n: int, skipped: list, out_dir) -> None:
    """Before anything is written to the destination (so a rerun after the fix finds it empty)."""
    if not n:
        raise StoreError(f"{out_dir}: every sample failed its check ({skipped[:3]}...); nothing exported. Fix: "
                         f"`eagle3kit verify {out_dir}`, then rerun the extraction to capture them again")


def _done(out: dict, skipped: list) -> dict:
    for why in skipped[:10]:
        print(f"left out: {why}")
    return {**out, "skipped": len(skipped), "skipped_reasons": skipped[:100]}


@leaves_no_partial_dest
def to_speculators(out_dir, dest, split: str = "train") -> dict:
    from datasets import Dataset

    if records_post_norm(read_settings(out_dir)):
        raise StoreError(f"{out_dir}: its last slot is the final norm's output (final_slot post_norm, a capture inside "
                         f"SGLang's prefill graph); speculators applies the target's norm to it again. Fix: export it "
                         f"to SpecForge (which trains on that state), train it with eagle3kit, or capture without "
                         f"--prefill-graph for speculators")
    out_dir, dest = Path(out_dir), new_folder(dest, "export")
    hs_dir = dest / "hidden_states"
    hs_dir.mkdir()
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    freq: Counter = Counter()
    linked = 0
    checked, skipped = _checked(out_dir, split)
    for row, e, sample in checked:
        src = out_dir / "samples" / e["file"]
        target = hs_dir / f"hs_{row}.safetensors"
        if e.get("storage") == "bf16":
            try:
                os.link(src, target)
                linked += 1
            except OSError:
                save_file({"hidden_states": sample["hidden_states"], "token_ids": sample["token_ids"]}, str(target))
        else:
            save_file({"hidden_states": sample["hidden_states"].contiguous(),
                       "token_ids": sample["token_ids"].contiguous()}, str(target))
        ids, mask = sample["token_ids"].tolist(), sample["loss_mask"].tolist()
        rows["input_ids"].append(ids)
        rows["loss_mask"].append(mask)
        rows["seq_len"].append(len(ids))
        freq.update(t for t, m in zip(ids, mask) if m)
    if not rows["seq_len"]:
        hs_dir.rmdir()
    _refuse_empty(len(rows["seq_len"]), skipped, out_dir)
    ds = Dataset.from_dict(rows)
    ds.set_format("torch")
    ds.save_to_disk(str(dest))
    torch.save(dict(freq), dest / "token_freq.pt")
    return _done({"format": "speculators", "rows": len(rows["seq_len"]), "hard_linked": linked, "dest": str(dest)},
                 skipped)


@leaves_no_partial_dest
def to_specforge(out_dir, dest, split: str = "train") -> dict:
    post = records_post_norm(read_settings(out_dir))
    out_dir, dest = Path(out_dir), new_folder(dest, "export")
    n = 0
    checked, skipped = _checked(out_dir, split)
    for i, e, s in checked:
        if post:  # the last slot is the state SpecForge wants
            s = {**s, "final_normed": s["hidden_states"][:, -1]}
        if "final_normed" not in s:
            raise StoreError(f"{e['file']} has no final_normed state: SpecForge trains on the state after the final "
                             f"norm. Fix: extract with --final-normed (final_normed=True)")
        hs = s["hidden_states"]
        group = dest / f"rows_{i // 2000 * 2000}-{i // 2000 * 2000 + 2000}"
        group.mkdir(exist_ok=True)
        torch.save({"input_ids": s["token_ids"], "loss_mask": s["loss_mask"],
                    "aux_hidden_state": hs[:, :-1].reshape(1, hs.shape[0], -1).contiguous(),
                    "hidden_state": s["final_normed"].unsqueeze(0).contiguous()}, group / f"data_{i}.ckpt")
        n += 1
    _refuse_empty(n, skipped, out_dir)  # nothing was written: every row is written only after its check
    return _done({"format": "specforge", "rows": n, "dest": str(dest)}, skipped)
