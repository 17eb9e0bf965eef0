"""The sample files' checksum (eagle3kit.checksum): xxh3-128 by default, sha256 on request, and manifests written
before the change (their lines hold "sha256") still verify. Each check is shown failing on a changed file."""
import hashlib

import pytest
import torch

from eagle3kit import checksum
from eagle3kit.capture.format import write_sample
from eagle3kit.store import StoreError, read_checked


def _sample(out, key="k0", algorithm=checksum.DEFAULT):
    g = torch.Generator().manual_seed(1)
    tensors = {"hidden_states": torch.randn(9, 3, 16, generator=g).bfloat16(), "token_ids": torch.arange(9)}
    (out / "samples").mkdir(exist_ok=True)
    return write_sample(out / "samples", key, 0, tensors, {"engine": "test"}, "bf16", checksum=algorithm)


def _flip(path, at=-5):
    blob = bytearray(path.read_bytes())
    blob[at] ^= 0x01
    path.write_bytes(bytes(blob))


@pytest.mark.parametrize("algorithm", checksum.ALGORITHMS)
def test_the_marker_names_the_files_checksum_and_a_flipped_bit_fails_it(tmp_path, algorithm):
    m = _sample(tmp_path, algorithm=algorithm)
    path = tmp_path / "samples" / m["file"]
    raw = path.read_bytes()
    assert m["checksum"].startswith(f"{algorithm}:") and "sha256" not in m
    if algorithm == "sha256":
        assert m["checksum"] == "sha256:" + hashlib.sha256(raw).hexdigest()
    assert checksum.matches(m, raw)
    t, _ = read_checked(tmp_path, m)
    assert t["hidden_states"].shape == (9, 3, 16)
    _flip(path)
    assert not checksum.matches(m, path.read_bytes())
    with pytest.raises(StoreError, match="checksum differs"):
        read_checked(tmp_path, m)


def test_the_default_is_xxh3_128():
    import xxhash

    assert checksum.DEFAULT == "xxh3_128"
    assert checksum.digest(b"abc") == xxhash.xxh3_128(b"abc").hexdigest()
    assert checksum.digest(b"abc") != checksum.digest(b"abd")


def test_a_manifest_line_from_before_holds_sha256_and_still_verifies(tmp_path):
    m = _sample(tmp_path, algorithm="sha256")
    legacy = {k: v for k, v in m.items() if k != "checksum"} | {"sha256": m["checksum"].split(":", 1)[1]}
    assert checksum.of(legacy) == ("sha256", legacy["sha256"])
    assert checksum.carry(legacy) == {"checksum": m["checksum"]}
    read_checked(tmp_path, legacy)
    wrong = {**legacy, "sha256": hashlib.sha256(b"another file").hexdigest()}
    with pytest.raises(StoreError, match="checksum differs"):
        read_checked(tmp_path, wrong)


def test_a_line_with_no_usable_checksum_is_refused_by_name(tmp_path):
    m = _sample(tmp_path)
    for bad in ({k: v for k, v in m.items() if k != "checksum"}, {**m, "checksum": "md5:" + "0" * 32}):
        with pytest.raises(StoreError, match=f"{m['file']} names no usable checksum.*capture it again"):
            read_checked(tmp_path, bad)


def test_an_unknown_algorithm_is_refused_where_it_is_configured():
    from eagle3kit.capture.hook import capture_config

    with pytest.raises(ValueError, match="checksum 'md5' unknown: use one of xxh3_128, sha256"):
        capture_config("/tmp/x", [1, 2], 4, checksum="md5")
    assert capture_config("/tmp/x", [1, 2], 4)["checksum"] == "xxh3_128"
    assert capture_config("/tmp/x", [1, 2], 4, checksum="sha256")["checksum"] == "sha256"
