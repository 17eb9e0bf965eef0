"""TP-replication check: are the hidden states every tensor-parallel rank holds the same, layer by layer?

With plain TP every rank holds the all-reduced residual stream, so dumping one rank is enough *if* the ranks agree;
this measures it (bitwise-equal fraction, max abs diff, max ULP distance per layer) instead of assuming it.
Under DP attention ranks hold different tokens: the check then says so instead of comparing.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch


def ordered_bits(x: torch.Tensor) -> torch.Tensor:
    """Floats as integers whose difference counts representable values (ULPs) between them."""
    if x.dtype == torch.bfloat16:
        i = x.view(torch.int16).to(torch.int64)
        sign_bit = 1 << 15
    elif x.dtype == torch.float32:
        i = x.view(torch.int32).to(torch.int64)
        sign_bit = 1 << 31
    else:
        raise TypeError(f"ULP distance for {x.dtype} is not defined here (bf16 or float32)")
    return torch.where(i < 0, -(i + sign_bit), i)  # negative floats map below zero, monotonically


def compare_ranks(capture_dir, keys, ranks) -> list[dict]:
    """Per layer slot: fraction of elements bitwise equal to rank 0 on every rank, max |diff|, max ULP distance.
    One rank: nothing to compare, no rows (a rank compared with itself would report a meaningless 1.0)."""
    capture_dir = Path(capture_dir)
    rows = {}
    if len(ranks) < 2:
        return []
    for key in keys:
        raw0, meta = _raw(capture_dir / f"{key}.rank{ranks[0]}.safetensors")
        for r in ranks[1:]:
            raw, _ = _raw(capture_dir / f"{key}.rank{r}.safetensors")
            if raw.shape != raw0.shape:
                raise ValueError(f"{key}: rank {r} holds {tuple(raw.shape)}, rank {ranks[0]} {tuple(raw0.shape)} "
                                 f"(different tokens per rank: DP attention?)")
            for j, layer in enumerate(meta["layer_ids"]):
                a, b = raw0[:, j], raw[:, j]
                ulp = (ordered_bits(a) - ordered_bits(b)).abs()
                row = rows.setdefault(layer, {"layer_id": layer, "elements": 0, "equal": 0, "max_abs_diff": 0.0,
                                              "max_ulp": 0})
                row["elements"] += a.numel()
                row["equal"] += int((ulp == 0).sum())
                row["max_abs_diff"] = max(row["max_abs_diff"], (a.float() - b.float()).abs().max().item())
                row["max_ulp"] = max(row["max_ulp"], int(ulp.max()))
    out = []
    for layer in sorted(rows):
        r = rows[layer]
        r["bitwise_equal_fraction"] = r["equal"] / max(r["elements"], 1)
        out.append(r)
    return out


def _raw(path: Path) -> tuple[torch.Tensor, dict]:
    """The stored hidden states in their stored dtype (no decoding: bits are what is compared), and the layer ids."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        if "hidden_states" not in f.keys():
            raise ValueError(f"{path}: TP check needs bf16/fp32 storage, not {sorted(f.keys())}")
        return f.get_tensor("hidden_states"), {"layer_ids": json.loads(f.metadata()["layer_ids"])}


def verdict(rows: list[dict], n_ranks: int) -> str:
    if n_ranks < 2:
        return "not run: one rank, nothing to compare (run with TP > 1 to check replication)"
    if all(r["bitwise_equal_fraction"] == 1.0 for r in rows):
        return "replicated: every rank holds bitwise-identical hidden states; dumping one rank is exact"
    worst = max(r["max_ulp"] for r in rows)
    return f"NOT bitwise replicated (max {worst} ULP): dump every rank or a fixed rank and expect rank-dependent noise"


def ranks_found(capture_dir, key) -> list[int]:
    return sorted(int(p.name.split(".rank")[1].split(".")[0]) for p in Path(capture_dir).glob(f"{key}.rank*.safetensors"))


def run_cpu_tp(target, out_dir, prompts: dict, aux_layer_ids, n_ranks: int, timeout: float = 1800) -> str:
    """Real tensor parallelism on the CPU: torchrun + gloo + transformers' tp_plan, each rank writing captures.
    ``n_ranks`` must divide the target's attention and KV heads (the tp_plan splits heads; SGLang pads or replicates
    instead): refused here, naming the ranks that fit, not as a shape error inside a rank."""
    from eagle3kit.target import TargetInfo

    info = TargetInfo.read(Path(target))
    if n_ranks < 1 or info.num_heads % n_ranks or info.num_kv_heads % n_ranks:
        fit = [n for n in range(1, info.num_heads + 1) if info.num_heads % n == 0 and info.num_kv_heads % n == 0]
        raise ValueError(f"tp_ranks={n_ranks}: the target's {info.num_heads} attention heads and {info.num_kv_heads} "
                         f"KV heads do not split over {n_ranks} ranks on the CPU (transformers' tp_plan splits heads). "
                         f"Fix: tp_ranks in {fit}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts_file = out_dir / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    # torch's elastic launcher (torchrun's agent and rendezvous), the ranks forked from preloaded processes
    cmd = [sys.executable, "-m", "eagle3kit.tp_worker", "--nproc", str(n_ranks), "--target", str(target), "--out",
           str(out_dir), "--prompts", str(prompts_file), "--layers", *map(str, aux_layer_ids)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    log = p.stdout + p.stderr
    (out_dir / "torchrun.log").write_text(log)
    if p.returncode != 0:
        raise RuntimeError(f"CPU TP run failed (exit {p.returncode}); log {out_dir / 'torchrun.log'}:\n{log[-3000:]}")
    return log


def run_sglang_tp(target, out_dir, prompts: dict, aux_layer_ids, n_ranks: int, server_args=(), port: int = 30100,
                  log_path=None) -> dict:
    """A capture server with ``--tp n_ranks`` dumping every rank; returns the server's status per rank."""
    from eagle3kit.capture.client import CaptureClient
    from eagle3kit.capture.server import capture_server

    extra = list(server_args)
    if "--tp" not in extra and "--tp-size" not in extra:
        extra += ["--tp", str(n_ranks)]
    server = capture_server(target, out_dir, aux_layer_ids, port=port, ranks="all", extra_args=extra,
                            log_path=log_path or Path(out_dir) / "sglang.log")
    with server:
        clients = [CaptureClient(server.url, out_dir, rank=r) for r in range(n_ranks)]
        for c in clients[1:]:  # rank 0's client clears its own; another rank's file of an earlier run must not count
            for key in prompts:
                c.clear(key)
        clients[0].capture_many(prompts.items(), concurrency=len(prompts))
        for c in clients[1:]:
            for key in prompts:
                c.wait(key)
        return clients[0].status()
