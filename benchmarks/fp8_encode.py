"""The capture hook's fp8 encoding alone, before and after ``capture/fp8_packed.py``, on the same blocks: what each costs
the scheduler's thread (CPU microseconds to issue it) and its stream (GPU microseconds), and whether they give the same
bytes.

  torch:  ``format.fp8_encode_states`` (about eight kernels, float32 intermediates) and three copies into pinned host
          buffers (the hook's path until this benchmark's session)
  fused:  ``fp8_packed.encode_packed`` (one Triton kernel into one buffer) and one copy

Each round times ``--calls`` encodings of each block per encoder, interleaved; every round is printed, then the median
and the spread (max/min - 1) over rounds. The copies run on the same stream here (the hook puts them on a side stream,
off the scheduler's): the GPU figure with copies is an upper bound of what the stream pays.

usage: python benchmarks/fp8_encode.py [--out DIR] [--rounds 5] [--calls 50] [--shapes 8192x4x576 16384x4x576 ...]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

SHAPES = ["2048x4x576", "8192x4x576", "16384x4x576", "8192x4x7168"]  # SmolLM2 forwards, a Kimi-K2.5 chunk


def block(shape: str, device: str, seed: int = 0) -> torch.Tensor:
    """A captured block of ``shape`` (TxSLOTSxH), bf16: residual-stream-like values (a scale per token and slot over
    four decades, some outliers), rows of zeros and of tiny values (the scale's clamp), as SGLang hands the hook."""
    t, n, h = (int(x) for x in shape.split("x"))
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-2, 2, t * n)[torch.randperm(t * n, generator=g)].reshape(t, n, 1)
    x = torch.randn(t, n, h, generator=g) * scales
    x[:, :, :: max(1, h // 7)] *= 40  # outliers: most values land in e4m3's subnormal range after scaling
    if t > 3:
        x[1] = 0.0
        x[2] = 1e-30
    return x.to(torch.bfloat16).to(device)


def differing_bytes(a: dict, b: dict) -> int:
    return sum(int((a[k].contiguous().view(torch.uint8) != b[k].contiguous().view(torch.uint8)).sum()) for k in a)


def main(argv=None):
    from eagle3kit.capture import fp8_packed
    from eagle3kit.capture.format import fp8_encode_states

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=SHAPES)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="folder for metrics.json (merged into one that is there)")
    a = p.parse_args(argv)
    cuda = a.device.startswith("cuda")
    fused_ok = cuda and fp8_packed.fused_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def torch_path(x, hosts):
        out = fp8_encode_states(x)
        for k, v in out.items():
            hosts[k].copy_(v, non_blocking=True)

    def fused_path(x, hosts):
        buf, _ = fp8_packed.encode_packed(x, fused=True)
        hosts["packed"].copy_(buf, non_blocking=True)

    res: dict = {"fp8_encode_device": torch.cuda.get_device_name() if cuda else "cpu",
                 "fp8_encode_fused_available": fused_ok}
    for shape in a.shapes:
        x = block(shape, a.device)
        ref = fp8_encode_states(x)
        layout, size = fp8_packed.packed_layout(*x.shape)
        paths = {"torch": (torch_path, {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=cuda) for k, v in ref.items()})}
        if fused_ok:
            paths["fused"] = (fused_path, {"packed": torch.empty(size, dtype=torch.uint8, pin_memory=True)})
            for reciprocal in (True, False):  # which scale arithmetic gives torch's bytes on this device
                buf = torch.empty(size, dtype=torch.uint8, device=a.device)
                v = fp8_packed.unpack(buf, layout)
                fp8_packed._TRITON[0].encode(x, v["hidden_states_fp8"], v["hidden_states_scale"],
                                             v["hidden_states_final"], reciprocal=reciprocal)
                res[f"fp8_encode_{shape}_differing_bytes_{'reciprocal' if reciprocal else 'division'}"] = \
                    differing_bytes(ref, v)
        for name, (fn, hosts) in paths.items():  # warm (Triton compiles on its first call)
            fn(x, hosts)
        sync()
        per = {f"{name}_{kind}": [] for name in paths for kind in ("cpu_us", "gpu_us", "gpu_copy_us")}
        for rnd in range(a.rounds):
            for name, (fn, hosts) in paths.items():
                sync()
                t = time.perf_counter()
                for _ in range(a.calls):
                    fn(x, hosts)
                cpu_us = (time.perf_counter() - t) / a.calls * 1e6  # issuing it: the scheduler thread's cost
                sync()
                gpu = {}
                for kind, call in (("gpu_us", lambda: fp8_packed.encode_packed(x, fused=True) if name == "fused"
                                    else fp8_encode_states(x)), ("gpu_copy_us", lambda: fn(x, hosts))):
                    if not cuda:
                        continue
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(a.calls):
                        call()
                    end.record()
                    end.synchronize()
                    gpu[kind] = start.elapsed_time(end) / a.calls * 1e3
                per[f"{name}_cpu_us"].append(cpu_us)
                for kind, v in gpu.items():
                    per[f"{name}_{kind}"].append(v)
                print(f"  round {rnd} {shape} {name}: cpu {cpu_us:.1f} us" +
                      "".join(f", {k} {v:.1f}" for k, v in gpu.items()), flush=True)
        for key, vals in per.items():
            if vals:
                res[f"fp8_encode_{shape}_{key}"] = statistics.median(vals)
                res[f"fp8_encode_{shape}_{key}_rounds"] = " ".join(f"{v:.1f}" for v in vals)
                res[f"fp8_encode_{shape}_{key}_spread"] = max(vals) / min(vals) - 1
        if fused_ok:
            buf, _ = fp8_packed.encode_packed(x, fused=True)
            res[f"fp8_encode_{shape}_differing_bytes"] = differing_bytes(ref, fp8_packed.unpack(buf, layout))
            for kind in ("cpu_us", "gpu_us", "gpu_copy_us"):
                res[f"fp8_encode_{shape}_{kind}_torch_over_fused"] = (res[f"fp8_encode_{shape}_torch_{kind}"] /
                                                                      res[f"fp8_encode_{shape}_fused_{kind}"])
    for k, v in res.items():
        if not k.endswith(("_rounds", "_spread")):
            print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    if a.out:
        from eagle3kit.metrics import update_json

        Path(a.out).mkdir(parents=True, exist_ok=True)
        update_json(Path(a.out) / "metrics.json", res)
    return res


if __name__ == "__main__":
    main()
