"""The trainer's resume point, ``<out_dir>/checkpoints/last.pt``: how it is written and read back.

Written whole or not at all (a temporary file, then a rename); read with ``weights_only``, so a file planted in an
out_dir cannot run code when it is loaded. The trainer resumes from it; the export check (``export.loadback_rel_err``)
compares an export with it.
"""
from __future__ import annotations

import os
import pickle
import random
from pathlib import Path

import torch


class CheckpointError(ValueError):
    pass


def atomic_save(obj, path: Path) -> None:
    """``torch.save`` to ``path`` through a temporary file: a crash mid-write leaves the previous file, and a failed
    write (a full disk) removes the temporary one."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_checkpoint(path: Path) -> dict:
    """A checkpoint this trainer wrote: tensors, numbers, strings and containers only (``weights_only``), so a file
    planted in the out_dir cannot run code when it is loaded."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        raise CheckpointError(f"{path}: not a checkpoint eagle3kit wrote ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200]}). Python objects in it are never unpickled. Fix: remove "
                              f"it (training starts again) or choose a new out_dir") from None


def rng_state(device: torch.device) -> dict:
    """The generators a step may draw from: this process's CPU and Python ones and its own GPU's (every visible GPU's
    would not restore on a host that shows fewer)."""
    st = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        st["cuda"] = torch.cuda.get_rng_state(device)
    return st


def set_rng(st: dict, device: torch.device) -> None:
    """Every rank gets rank 0's saved state (only rank 0 writes checkpoints): exact, since every rank is seeded alike
    and draws in lockstep, so their generators are equal at every step."""
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    if "cuda" in st and device.type == "cuda":
        cuda = st["cuda"]
        if isinstance(cuda, (list, tuple)):  # a checkpoint of before: one state per GPU it saw
            cuda = cuda[device.index or 0] if (device.index or 0) < len(cuda) else cuda[0]
        torch.cuda.set_rng_state(cuda, device)
