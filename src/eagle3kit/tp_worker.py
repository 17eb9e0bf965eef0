"""One rank of the CPU tensor-parallel reference: ``torchrun --nproc-per-node N -m eagle3kit.tp_worker ...``.

transformers shards the model over the ranks (``tp_plan="auto"``, gloo on the CPU); every rank writes its own
capture files (``<key>.rank<r>.safetensors``) so that the TP check can compare them.
"""
from __future__ import annotations

import argparse
import json
import os


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", required=True, help="JSON file: {key: [token ids]}")
    p.add_argument("--layers", nargs="+", type=int, required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--storage", default="fp32")
    a = p.parse_args()
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
