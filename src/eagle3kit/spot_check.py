"""``eagle3kit verify --reference N``: N samples of a data set, drawn at random, recomputed by the reference engine
(transformers) from their own token ids and checked per token (``spec.check_sample``, bounds calibrated on bf16 and
raised at each sample's own bf16-fragile tokens, ``spec.token_bounds``).

Checksums prove the files are what was written; this proves what was written is the target's states at the data
set's layers: a capture at the wrong layers, a shifted token, another request's rows or a post-norm final slot
fails here even though every checksum matches (tests/test_spot_check.py). A data set that records its last slot as
post-norm (``final_slot``, a capture inside SGLang's prefill graph) has that slot checked against the reference's
post-norm state instead, so a pre-norm state there fails."""
from __future__ import annotations

import json
import random
from pathlib import Path

from eagle3kit import spec
from eagle3kit.store import SETTINGS, StoreError, load_checked, read_manifest, records_post_norm


def reference_check(out_dir, n: int, seed: int = 0, device: str = "cpu", calibration: int = 2) -> dict:
    """Check ``n`` random samples; returns {"checked", "failed", "rows": per (sample, slot), "bounds"}."""
    from eagle3kit.capture.reference import ReferenceEngine
    from eagle3kit.target import resolve_target

    out_dir = Path(out_dir)
    if n < 1:
        raise StoreError(f"--reference {n}: give the number of samples to recompute (at least 1)")
    settings = json.loads((out_dir / SETTINGS).read_text())
    post = records_post_norm(settings)  # the last slot against the reference's norm output
    entries = sorted(read_manifest(out_dir).values(), key=lambda e: e["index"])
    if not entries:
        raise StoreError(f"{out_dir}: no samples to check")
    picked = random.Random(seed).sample(entries, min(n, len(entries)))
    ref = ReferenceEngine(resolve_target(settings["target"]), settings["layer_ids"][:-1],
                          final_normed=bool(settings.get("final_normed")) or post, device=device)
    samples = {e["key"]: load_checked(out_dir, e) for e in picked}  # checksum and manifest token ids first
    ids = {k: s["token_ids"].tolist() for k, s in samples.items()}
    refs: dict = {}
    errs: dict = {}  # the bf16 forward of a calibration sample serves its check too
    b16 = spec.bf16_engine(ref)
    bounds = spec.calibrate_bounds(ref, spec.calibration_set(ids, calibration), refs=refs, b16=b16, errs=errs)
    rows = []
    for k, s in samples.items():
        r0 = refs.get(k) or ref.hidden(ids[k])
        for r in spec.check_capture(s, ids[k], r0, ref.layer_ids, bounds, b16, post, errs.get(k)):
            rows.append({"key": k, **r})
    failed = sorted({r["key"] for r in rows if not r["ok"]})
    return {"checked": len(samples), "failed": failed, "rows": rows, "bounds": bounds}
