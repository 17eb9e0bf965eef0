"""The checksum of a sample file: what the capture's marker and the manifest hold, and what every reader checks.

An entry (a marker, a manifest line) holds ``"checksum": "<algorithm>:<hex digest>"``. Entries written before
2026-12-05 hold ``"sha256": "<hex>"`` instead, and still verify.

``xxh3_128`` (xxhash) is the default. sha256 took a third of each writer thread's time on the GPU host, at 0.88 GB/s
a thread (py-spy, outputs/records/gpu-benchmark-fp8-fused). xxh3-128 hashes about 12 times as fast on one core
(18 GB/s against 1.6 on the CPU machine; ``benchmarks/disk_write.py`` prints both) and releases the GIL. Its 128
bits catch any accidental change: a flipped bit, a torn, truncated or swapped file. It is not a defence against a
file forged on purpose; ``capture_config(checksum="sha256")`` writes sha256 for whoever needs that.
"""
from __future__ import annotations

import hashlib

ALGORITHMS = ("xxh3_128", "sha256")
DEFAULT = "xxh3_128"


def check_algorithm(algorithm: str) -> str:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"checksum {algorithm!r} unknown: use one of {', '.join(ALGORITHMS)}")
    return algorithm


def new(algorithm: str = DEFAULT):
    """A hasher with ``update(buffer)`` and ``hexdigest()``; both release the GIL on large buffers."""
    if check_algorithm(algorithm) == "sha256":
        return hashlib.sha256()
    import xxhash

    return xxhash.xxh3_128()


def field(algorithm: str, hexdigest: str) -> dict:
    """The entry's checksum field."""
    return {"checksum": f"{check_algorithm(algorithm)}:{hexdigest}"}


def of(entry: dict) -> tuple[str, str]:
    """(algorithm, hex digest) an entry names; KeyError when it names none."""
    if "checksum" in entry:
        algorithm, _, digest = str(entry["checksum"]).partition(":")
        return check_algorithm(algorithm), digest
    return "sha256", entry["sha256"]


def carry(entry: dict) -> dict:
    """The checksum field to copy from a marker into a manifest line (either form, as written)."""
    algorithm, digest = of(entry)
    return field(algorithm, digest)


def digest(data, algorithm: str = DEFAULT) -> str:
    h = new(algorithm)
    h.update(data)
    return h.hexdigest()


def matches(entry: dict, data) -> bool:
    """Whether ``data`` (the file's bytes) has the checksum ``entry`` names."""
    algorithm, want = of(entry)
    return digest(data, algorithm) == want
