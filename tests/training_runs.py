"""The CLI trainings of the training tests: argv (one process, or torchrun's ranks), their environment, ranks launched
from preloaded processes, and the weights a run saved last."""
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
    head = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(torchrun), "--master-port",
            str(free_port()), "-m", "eagle3kit.cli"] if torchrun else [sys.executable, "-m", "eagle3kit.cli"]
    return [*head, *train_args(data, out, extra)]


def train_args(data, out, extra=()) -> list[str]:
    """``eagle3kit`` arguments of a TINY training (``launch``'s argv; ``cli``'s after its command)."""
    sets = [a for k, v in {**TINY, **dict(extra)}.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    return ["train", "--data", str(data), "--out", str(out), *sets]


def launch(argv, nproc: int = 2) -> tuple[dict, dict]:
    """``eagle3kit <argv>`` on ``nproc`` gloo ranks, started by torch's elastic launcher (the agent and rendezvous
    torchrun runs) with the CLI's ``main`` as a function, from a forkserver that imported the trainer once (one thread
    each, as ``env()``): a rank skips the ~9 s of imports a fresh interpreter pays (torch, transformers, speculators),
    21 s -> 12 s a two-rank run of the DDP tests on the 2-core machine, with bit-equal weights. Returns ({rank: exit
    code}, {rank: its stdout + stderr}). The kill test starts its ranks with ``start_ranks`` (a session to kill);
    the hang test keeps torchrun itself (a subprocess to time out, and torchrun's own command line run once)."""
    import shutil
    import tempfile
    from pathlib import Path

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from eagle3kit.cli import main

    _forkserver()
    logs = Path(tempfile.mkdtemp(prefix="e3k-launch-"))
    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, rdzv_backend="c10d",
                       rdzv_endpoint=f"127.0.0.1:{free_port()}", run_id=f"e3k-{free_port()}", max_restarts=0,
                       start_method="forkserver", monitor_interval=0.05,
                       logs_specs=DefaultLogsSpecs(log_dir=str(logs), redirects=Std.ALL))
    try:
        codes = elastic_launch(cfg, main)(list(argv))
        return codes, {r: "".join(f.read_text() for f in sorted(logs.rglob(f"attempt_0/{r}/std*.log")))
                       for r in range(nproc)}
    finally:
        shutil.rmtree(logs, ignore_errors=True)


def _forkserver():
    """multiprocessing's forkserver context, started once per process with the trainer imported (preloaded) and one
    thread (its environment when it starts is its children's)."""
    import multiprocessing
    import multiprocessing.forkserver

    multiprocessing.set_forkserver_preload(["eagle3kit.cli", "eagle3kit.drafter.train", "speculators.models.eagle3"])
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if old is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = old
    return multiprocessing.get_context("forkserver")


def start(argv, log):
    """``eagle3kit <argv>`` in a process of its own session (killpg stops it and its loader workers), its output in
    ``log``, forked from the preloaded forkserver (``_forkserver``): a test that kills a run skips the ~9 s of
    imports a fresh interpreter pays. Returns the started multiprocessing Process."""
    p = _forkserver().Process(target=_cli_in_session, args=(list(argv), str(log)))
    p.start()
    return p


def start_ranks(argv, log, nproc: int = 2):
    """``eagle3kit <argv>`` on ``nproc`` gloo ranks, as ``launch`` runs them, but in a process of its own session (the
    elastic agent, forked from the preloaded forkserver), the ranks forked from it, all their output in ``log``: a
    test that kills the run (os.killpg: the agent and its ranks together, as SIGKILL to torchrun's group) skips the
    ~9 s of imports that torchrun and each of its fresh ranks pay. The launcher's log folder goes beside ``log`` (a
    killed launcher leaves it). Returns the started multiprocessing Process."""
    p = _forkserver().Process(target=_ranks_in_session, args=(list(argv), str(log), nproc))
    p.start()
    return p


def _ranks_in_session(argv, log, nproc):
    import tempfile

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from eagle3kit.cli import main

    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, rdzv_backend="c10d",
                       rdzv_endpoint=f"127.0.0.1:{free_port()}", run_id=f"e3k-{free_port()}", max_restarts=0,
                       start_method="fork", monitor_interval=0.05,
                       logs_specs=DefaultLogsSpecs(log_dir=tempfile.mkdtemp(prefix="e3k-ranks-", dir=os.path.dirname(log))))
    elastic_launch(cfg, main)(list(argv))


def _cli_in_session(argv, log):
    from eagle3kit.cli import main

    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.exit(main(argv))


def env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}


def weights(out):
    return torch.load(out / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)["model"]
