"""A full disk during ``eagle3kit train`` (#45), on a small filesystem of the test's own (tmpfs): the run stops with
one line naming the folder and the fix, leaves no temp folder, never leaves the untrained drafter in best/, and the
same command resumes once space is freed. The trial's tiny data set (6 conversations, 64 tokens) keeps it seconds."""
import shutil
import threading
import time

from eagle3kit.cli import main
from eagle3kit.folders import MARK
from eagle3kit.trial import TINY_TRAIN
from tests.conftest import fill_disk, tmpfs

SLOW_TRAIN = [*TINY_TRAIN, "--set", "max_steps=6", "--set", "save_every=2"]


def test_a_full_disk_during_train_stops_cleanly_and_the_same_command_resumes(trial_inputs, tmp_path, capsys):
    ds = trial_inputs / "ds"
    with tmpfs(tmp_path / "fs", "256m") as fs:
        out, filler = fs / "t", fs / "filler"

        def fill_once_training_started():
            deadline = time.time() + 600
            while time.time() < deadline and not (out / "train_log.jsonl").exists():
                time.sleep(0.01)
            fill_disk(filler)

        t = threading.Thread(target=fill_once_training_started, daemon=True)
        t.start()
        capsys.readouterr()
        argv = ["train", "--data", str(ds), "--out", str(out), *SLOW_TRAIN]
        rc = main(argv)
        t.join(5)
        err = capsys.readouterr().err
        assert rc != 0 and "disk" in err and "full" in err and str(out) in err and "Traceback" not in err, err
        assert len([ln for ln in err.strip().splitlines() if ln.startswith("eagle3kit train:")]) == 1
        # no temp folder or file (dot-named or .tmp); the folder lock and the mark of an export that completed before
        # the disk filled (folders.MARK) are not temporary
        left = [p for p in fs.rglob("*") if p.name.startswith(".") and p.name not in (".lock", MARK) or p.suffix == ".tmp"]
        assert not left, left
        assert not (out / "best").exists() or '"step": 0' not in (out / "best" / "eagle3kit.json").read_text()
        filler.unlink()
        rc = main(argv)
        assert rc == 0, capsys.readouterr().err  # the same command goes on
        assert (out / "best" / "model.safetensors").exists() and (out / "final" / "model.safetensors").exists()
        assert shutil.disk_usage(fs).free > 0
