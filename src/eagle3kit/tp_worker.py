"""One rank of the CPU tensor-parallel reference: ``torchrun --nproc-per-node N -m eagle3kit.tp_worker ...``, or
``python -m eagle3kit.tp_worker --nproc N ...`` (what ``tp_check.run_cpu_tp`` runs): torch's elastic launcher, the
agent and rendezvous torchrun runs, with the ranks forked from the launcher once it has imported torch, transformers
and the reference engine (~10 s of imports a fresh rank would pay each, 3 ranks on 2 cores; a forkserver would pay
them once more in an interpreter of its own).

transformers shards the model over the ranks (``tp_plan="auto"``, gloo on the CPU); every rank writes its own
capture files (``<key>.rank<r>.safetensors``) so that the TP check can compare them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.models.llama.modeling_llama",
           "eagle3kit.capture.reference", "eagle3kit.tp_worker"]


def launch(argv: list[str], nproc: int) -> None:
    """``main(argv)`` on ``nproc`` gloo ranks of this host, started by torch's elastic launcher, forked from this
    process once it has imported ``PRELOAD`` (it computes nothing before the fork: no thread pool for a child to
    inherit); the ranks' output goes to this process's. A rank that fails raises (ChildFailedError)."""
    import importlib
    import shutil
    import socket
    import tempfile

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for m in PRELOAD:
        importlib.import_module(m)
    logs = tempfile.mkdtemp(prefix="e3k-tp-")
    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, rdzv_backend="c10d",
                       rdzv_endpoint=f"127.0.0.1:{port}", run_id=f"e3k-tp-{os.getpid()}", max_restarts=0,
                       start_method="fork", monitor_interval=0.05, logs_specs=DefaultLogsSpecs(log_dir=logs))
    try:
        elastic_launch(cfg, main)(argv)
    finally:  # the launcher's own log folder: the ranks' output already went to this process's
        shutil.rmtree(logs, ignore_errors=True)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", required=True, help="JSON file: {key: [token ids]}")
    p.add_argument("--layers", nargs="+", type=int, required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--storage", default="fp32")
    p.add_argument("--nproc", type=int, default=0, help="launch this many ranks (torch's elastic launcher) instead "
                   "of being one (under torchrun)")
    a = p.parse_args(argv)
    if a.nproc:
        args = list(sys.argv[1:] if argv is None else argv)
        i = args.index("--nproc")
        return launch(args[:i] + args[i + 2:], a.nproc)
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3kit.capture.reference import ReferenceEngine

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    tok = AutoTokenizer.from_pretrained(a.target)
    model = AutoModelForCausalLM.from_pretrained(a.target, tp_plan="auto", dtype=getattr(torch, a.dtype)).eval()
    engine = ReferenceEngine(a.target, a.layers, model=model, tokenizer=tok)
    prompts = json.loads(open(a.prompts).read())
    rank, size = dist.get_rank(), dist.get_world_size()
    for key, ids in prompts.items():
        engine.capture(a.out, key, ids, rank=rank, tp_size=size, storage=a.storage)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
