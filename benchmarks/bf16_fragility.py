"""How far the target's own bf16 forward is from its fp32 forward, token by token, on the GPU load test's prompts
(``spec.load_prompts``, the same seed): the figures behind ``spec.token_bounds``. Runs on a CPU.

For each prompt and slot: the worst token's error and which token it is, the 99.9th percentile and the median; then
the bound the load test calibrates from its 8-prompt calibration set (``spec.calibration_set``, x3) against each
prompt's own worst token. A prompt whose worst token is beyond that bound in transformers' own bf16 would fail the
check on any bf16 engine with slot bounds alone.

    python benchmarks/bf16_fragility.py --keys load0103 load0144 --out outputs/records/cpu-bf16-fragile-tokens
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main(argv=None) -> int:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--target", default="embedded:smollm2")
    a.add_argument("--requests", type=int, default=256, help="prompts the load test draws (to rebuild the same)")
    a.add_argument("--seed", type=int, default=11, help="the load test's seed (tests/test_gpu_faults.py LOAD_SEED)")
    a.add_argument("--keys", nargs="*", default=[], help="prompts to measure beside the calibration set")
    a.add_argument("--calibration", type=int, default=8)
    a.add_argument("--layers", nargs="+", type=int, default=[2, 15, 27])
    a.add_argument("--threads", type=int, default=0)
    a.add_argument("--out", default="", help="folder for metrics.json (the table is printed either way)")
    args = a.parse_args(argv)

    import torch

    from eagle3kit import spec
    from eagle3kit.capture.reference import ReferenceEngine
    from eagle3kit.target import resolve_target

    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_target(args.target)
    ref = ReferenceEngine(path, args.layers, final_normed=True)
    b16 = spec.bf16_engine(ref)
    context = json.loads((Path(path) / "config.json").read_text())["max_position_embeddings"]
    prompts = spec.load_prompts(ref.tokenizer, args.requests, context - 8, seed=args.seed)
    cal = spec.calibration_set(prompts, args.calibration)
    keys = list(cal) + [k for k in args.keys if k not in cal]
    rows, worst_cal = [], {}
    for k in keys:
        t0 = time.time()
        r0 = ref.hidden(prompts[k])
        for slot, e in spec.bf16_errors(b16, prompts[k], r0).items():
            t = int(e.argmax())
            row = {"key": k, "calibration": k in cal, "tokens": len(prompts[k]), "slot": str(slot),
                   "worst": round(e.max().item(), 4), "worst_at": t, "worst_token": ref.tokenizer.decode([prompts[k][t]]),
                   "p999": round(e.quantile(0.999).item(), 4), "median": round(e.median().item(), 4)}
            rows.append(row)
            if k in cal:
                worst_cal[str(slot)] = max(worst_cal.get(str(slot), 0.0), row["worst"])
        print(f"{k}: {len(prompts[k])} tokens, {time.time() - t0:.0f} s", flush=True)
    bounds = spec.bounds_from_worst(worst_cal)  # as calibrate_bounds makes them
    for r in rows:
        r["slot_bound"] = round(bounds[r["slot"]], 4)
        r["beyond_slot_bound"] = r["worst"] > bounds[r["slot"]]
    print(spec_table(rows))
    over = sorted({r["key"] for r in rows if r["beyond_slot_bound"]})
    m = {"fragility_prompts": len(keys), "fragility_calibration_keys": list(cal), "fragility_slot_bounds": bounds,
         "fragility_beyond_slot_bound": over, "fragility_rows": rows,
         "fragility_worst_by_key": {k: max(r["worst"] for r in rows if r["key"] == k) for k in keys}}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "metrics.json").write_text(json.dumps(m, indent=1))
    print(f"prompts whose own bf16 forward passes the slot bounds somewhere: {over or 'none'}")
    return 0


def spec_table(rows) -> str:
    from eagle3kit.plots import table

    return table([{k: r[k] for k in ("key", "tokens", "slot", "worst", "worst_at", "worst_token", "p999", "median",
                                     "slot_bound")} for r in rows])


if __name__ == "__main__":
    raise SystemExit(main())
