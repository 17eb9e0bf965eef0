"""Security (#12): files eagle3kit reads back are never unpickled into code, names from the data never leave the
output folder, servers listen on the loopback interface unless told otherwise."""
import os
import subprocess
import sys

import pytest
import torch

from eagle3kit.capture.rid import RidError, check_key, make_rid
from eagle3kit.capture.server import server_command
from eagle3kit.drafter.checkpoint import CheckpointError, load_checkpoint
from eagle3kit.drafter.train import TrainConfig, train


class Payload:
    """What a planted pickle would run on load (here: it leaves a file behind)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_planted_checkpoint_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "payload-ran"
    ckpt = tmp_path / "last.pt"
    torch.save({"model": {}, "state": Payload(str(marker))}, ckpt)
    with pytest.raises(CheckpointError, match="not a checkpoint eagle3kit wrote.*Fix: remove it"):
        load_checkpoint(ckpt)
    assert not marker.exists()
    ok = tmp_path / "ok.pt"  # what train() saves: tensors, numbers, containers, RNG states
    import random

    torch.save({"model": {"w": torch.ones(2)}, "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
                "state": {"step": 3, "best": {}, "stopped_early": False}}, ok)
    assert load_checkpoint(ok)["state"]["step"] == 3


def test_train_refuses_a_planted_checkpoint_in_its_out_dir(small_dataset, tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    marker = tmp_path / "payload-ran"
    torch.save({"model": {}, "state": Payload(str(marker))}, out / "checkpoints" / "last.pt")
    cfg = TrainConfig(data=str(small_dataset), out_dir=str(out), draft_vocab_size=256, ttt_steps=1, serving_steps=1,
                      tokens_per_batch=128, workers=0, progress=False, max_steps=1)
    with pytest.raises(CheckpointError, match="last.pt: not a checkpoint"):
        train(cfg)
    assert not marker.exists()


@pytest.mark.parametrize("key", ["../evil", "a/../../b", "/etc/passwd", "a\\b", "..", ".hidden", "", "x" * 201])
def test_capture_keys_cannot_name_a_path_outside_the_folder(key):
    with pytest.raises(RidError, match="names files"):
        check_key(key)
    with pytest.raises(RidError):
        make_rid(key, 3)


def test_sample_files_are_named_by_index_not_by_conversation_id(tmp_path, target_path):
    """A conversation id that is a path stays data: the sample is s<index>, inside --out."""
    data = tmp_path / "convs.jsonl"
    data.write_text('{"id": "../../escaped", "messages": [{"role": "user", "content": "Hi there"}, '
                    '{"role": "assistant", "content": "Hello! How can I help?"}]}\n')
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "eagle3kit.cli", "extract", "--target", str(target_path), "--data",
                        str(data), "--out", str(out), "--max-tokens", "64"], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(p.name for p in (out / "samples").glob("*.safetensors")) == ["s0000000.rank0.safetensors"]
    assert not (tmp_path / "escaped").exists() and not any(tmp_path.parent.glob("escaped*"))


def test_servers_listen_on_the_loopback_interface_by_default(tmp_path):
    cmd = server_command(tmp_path, 30000)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    cmd = server_command(tmp_path, 30000, host="0.0.0.0")  # only when asked
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
