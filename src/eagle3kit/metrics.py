"""Where a notebook writes its numbers: one flat ``metrics.json`` per executed notebook.

The runner sets ``EAGLE3KIT_STEP_DIR`` for each notebook it executes; a notebook opened by hand in JupyterLab
writes under ``outputs/interactive/<notebook>/`` instead, so both ways leave the same files.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

STEP_DIR_ENV = "EAGLE3KIT_STEP_DIR"
Scalar = (int, float, str, bool)


def step_dir(name: str = "notebook") -> Path:
    """The folder of the running step (plots, logs and work files go there)."""
    d = os.environ.get(STEP_DIR_ENV)
    path = Path(d) if d else Path("outputs") / "interactive" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def progress_bar(**kw):
    """A tqdm bar; in a notebook the runner executes (its output becomes the executed copy and the log) it
    refreshes at most every 30 s, so long GPU runs still show progress without thousands of fragments."""
    from tqdm.auto import tqdm

    if os.environ.get(STEP_DIR_ENV):
        kw = {**kw, "mininterval": 30.0, "maxinterval": 60.0}
    return tqdm(**kw)


def quiet_batch_run() -> None:
    """In a notebook the runner executes: no per-file progress bars of transformers / huggingface_hub."""
    if os.environ.get(STEP_DIR_ENV):
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        try:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except ImportError:
            pass


def _check(key: str, value):
    if not isinstance(key, str) or not key.isidentifier():
        raise ValueError(f"metric name {key!r} must be an identifier such as 'capture_max_rel_err'")
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        value = value.item()
    if value is None or not isinstance(value, Scalar):
        raise TypeError(f"metric {key!r} must be a number, string or bool (flat metrics.json), got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"metric {key!r} is {value}: record finite numbers only")
    return value


def update_json(path, values: dict) -> dict:
    """Merge ``values`` into the JSON object at ``path`` (created if missing), written atomically; the whole dict.
    Processes merging into one file at once (the bad-input trial beside the GPU fault tests) take turns on a lock
    on its folder, so neither loses the other's keys."""
    import fcntl

    path = Path(path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        current = json.loads(path.read_text()) if path.exists() else {}
        current.update(values)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(current, indent=1, sort_keys=True, default=str))
        os.replace(tmp, path)
    finally:
        os.close(folder)  # releases the lock
    return current


def record(**metrics) -> dict:
    """Merge named numbers/strings into the step's ``metrics.json`` and return the whole dict."""
    return update_json(step_dir() / "metrics.json", {k: _check(k, v) for k, v in metrics.items()})
