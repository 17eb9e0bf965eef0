"""`eagle3kit verify --reference N` on real captured data: N random samples recomputed by the reference engine and
checked per token. It passes a good data set and fails one whose states are wrong while every checksum matches;
plain `verify` catches files captured at other layers than the data set's settings, and refuses a folder that is
not a data set."""
import json
import shutil

import pytest

from eagle3kit import cli


def _rewrite(src, dest, change, keep=1):
    """A copy of data set ``src`` whose first ``keep`` samples went through ``change(tensors, entry)`` and whose
    manifest carries the new files' checksums and only them: wrong states that no checksum can catch (the other
    samples left out, so ``--reference`` can only pick changed ones)."""
    from eagle3kit.capture.format import read_sample, write_sample
    from eagle3kit.store import MANIFEST, read_manifest

    shutil.copytree(src, dest)
    lines = []
    entries = sorted(read_manifest(dest).values(), key=lambda e: e["index"])
    for e in entries[keep:]:
        (dest / "samples" / e["file"]).unlink()
    for e in entries[:keep]:
        tensors, meta = read_sample(dest / "samples" / e["file"])
        change(tensors, e)
        m = write_sample(dest / "samples", e["key"], 0, tensors, meta, e.get("storage", "bf16"))
        lines.append(json.dumps({**e, "file": m["file"], "bytes": m["bytes"], "checksum": m["checksum"]}))
    (dest / MANIFEST).write_text("\n".join(lines) + "\n")
    return dest


def test_a_good_data_set_passes(small_dataset, capsys):
    assert cli.main(["verify", str(small_dataset), "--reference", "2"]) == 0
    assert "2 random samples recomputed by the reference engine, 0 failed" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("mistake", ["neighbouring layer", "token shifted by one"])
def test_wrong_states_with_good_checksums_fail(small_dataset, tmp_path, target_path, capsys, mistake):
    import torch

    from eagle3kit.capture.reference import ReferenceEngine
    from eagle3kit.spec import all_reference_states

    ref = ReferenceEngine(target_path, [2, 15, 27]) if mistake == "neighbouring layer" else None

    def change(t, e):  # one sample is enough to fail: the smallest data that still fails on the wrong states
        hs = t["hidden_states"].clone()
        if mistake == "neighbouring layer":  # slot 0 holds input_of_layer 3, not 2
            hs[:, 0] = all_reference_states(ref, t["token_ids"].tolist())["input_of_layer 3"].to(hs.dtype)
        else:
            hs = torch.cat([hs[1:], hs[-1:]])
        t["hidden_states"] = hs

    bad = _rewrite(small_dataset, tmp_path / "bad", change)
    assert cli.main(["verify", str(bad)]) == 0  # every checksum, shape and token id is fine
    capsys.readouterr()
    assert cli.main(["verify", str(bad), "--reference", "1"]) == 1
    assert "1 failed" in capsys.readouterr().out


@pytest.mark.slow
def test_a_post_norm_final_slot_is_checked_against_the_references_normed_state(small_dataset, tmp_path, capsys):
    """A data set recorded ``final_slot: post_norm`` (captured inside SGLang's prefill graph) passes when its last
    slot is the norm's output, and fails when it holds the pre-norm state under that record."""
    from eagle3kit.store import derive

    post = tmp_path / "post"
    derive(small_dataset, post, final_slot="post_norm")
    assert cli.main(["verify", str(post), "--reference", "1"]) == 0
    lying = tmp_path / "lying"
    shutil.copytree(small_dataset, lying)
    s = json.loads((lying / "extraction.json").read_text())
    (lying / "extraction.json").write_text(json.dumps({**s, "final_slot": "post_norm"}))
    capsys.readouterr()
    assert cli.main(["verify", str(lying), "--reference", "1"]) == 1
    assert "1 failed" in capsys.readouterr().out


def test_files_of_other_layers_than_the_settings_fail_plain_verify(small_dataset, tmp_path, capsys):
    bad = tmp_path / "relabelled"
    shutil.copytree(small_dataset, bad)
    s = json.loads((bad / "extraction.json").read_text())
    (bad / "extraction.json").write_text(json.dumps({**s, "layer_ids": [3, 16, 28, 30]}))
    assert cli.main(["verify", str(bad)]) == 1
    assert "captured at layers [2, 15, 27, 30], the data set's settings say [3, 16, 28, 30]" in capsys.readouterr().out


def test_a_folder_that_is_not_a_data_set_is_refused(tmp_path, capsys):
    assert cli.main(["verify", str(tmp_path)]) == 2
    assert "is not an eagle3kit data set" in capsys.readouterr().err
