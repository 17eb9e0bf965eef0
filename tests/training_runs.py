"""The CLI trainings of the training tests: argv (one process, or torchrun's ranks), their environment, and the
weights a run saved last."""
import json
import os
import socket
import sys

import torch

from tests.conftest import ROOT
from tests.conftest import TINY_DRAFTER as TINY


def free_port() -> int:
    """A port no one listens on now: parallel test workers each run their torchrun on its own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(data, out, extra=(), torchrun=0):
    sets = [a for k, v in {**TINY, **dict(extra)}.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    head = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(torchrun), "--master-port",
            str(free_port()), "-m", "eagle3kit.cli"] if torchrun else [sys.executable, "-m", "eagle3kit.cli"]
    return [*head, "train", "--data", str(data), "--out", str(out), *sets]


def env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}


def weights(out):
    return torch.load(out / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)["model"]
