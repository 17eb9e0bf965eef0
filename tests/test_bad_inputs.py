"""Bad input is never data: each mistake a user can make with `eagle3kit extract` is refused with a message that
names the input and the fix (exit 2, no traceback, nothing written), or counted and reported; a run that would
capture nothing fails."""
import json
import os
import subprocess
import sys
import time

import pytest

from eagle3kit import cli

GOOD = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Hello number {i}, how are you?"},
                                     {"role": "assistant", "content": "I am fine, thank you."}]} for i in range(4)]


def _files(tmp_path):
    text = json.dumps(GOOD)
    files = {"good.json": text, "empty.jsonl": "", "broken.json": text[: len(text) // 2 + 7],
             "noassist.jsonl": "\n".join(json.dumps({"id": f"n{i}", "messages": [{"role": "user", "content": "hi"}]})
                                         for i in range(3)),
             "dup.json": json.dumps([GOOD[0], {**GOOD[1], "id": "c0"}, GOOD[2]]),
             "badline.jsonl": json.dumps(GOOD[0]) + "\n{not json\n",
             "notobjects.json": "[1, 2, 3]"}
    for name, t in files.items():
        (tmp_path / name).write_text(t)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    return tmp_path


CASES = [  # (extra args, words the message must hold)
    (["--data", "empty.jsonl"], ["empty.jsonl", "nothing to capture", "0 records"]),
    (["--data", "broken.json"], ["broken.json", "breaks at byte", "JSONL"]),
    (["--data", "noassist.jsonl"], ["noassist.jsonl", "nothing to capture", "3 no user/assistant exchange"]),
    (["--data", "badline.jsonl"], ["badline.jsonl:2", "not valid JSON"]),
    (["--data", "notobjects.json"], ["notobjects.json", "record 0 is a int"]),
    (["--data", "adir"], ["--data", "adir is a folder"]),
    (["--data", "missing.jsonl"], ["missing.jsonl", "does not exist"]),
    (["--data", "good.json", "--max-tokens", "0"], ["--max-tokens 0", "at least 2 tokens"]),
    (["--data", "good.json", "--max-tokens", "-5"], ["--max-tokens -5"]),
    (["--data", "good.json", "--max-samples", "0"], ["--max-samples 0"]),
    (["--data", "good.json", "--layers", "15", "2", "27"], ["--layers 15 2 27", "fix: --layers 2 15 27"]),
    (["--data", "good.json", "--layers", "2", "2", "27"], ["--layers 2 2 27", "distinct"]),
    (["--data", "good.json", "--layers", "2", "15", "40"], ["--layers 2 15 40", "from 1 to 29"]),
    (["--data", "good.json", "--heldout-percent", "150"], ["--heldout-percent 150", "[0, 100)"]),
    (["--data", "good.json", "--heldout-percent", "-1"], ["--heldout-percent -1"]),
    (["--data", "good.json", "--rank", "2", "--world-size", "2"], ["--rank 2 --world-size 2"]),
    (["--data", "good.json", "--regenerate", "--regenerate-minutes", "-1"], ["--regenerate-minutes -1", ">= 0"]),
    (["--data", "good.json", "--regenerate", "--regenerate-servers", "0"], ["--regenerate-servers 0", ">= 1"]),
    (["--data", "good.json", "--regenerate", "--regenerate-servers", "2"], ["--regenerate-servers 2", "--engine sglang"]),
    (["--data", "good.json", "--out", "afile"], ["--out", "afile is a file"]),
    (["--data", "good.json", "--reference-batch-tokens", "-1"], ["--reference-batch-tokens -1", "0 (one prompt"]),
]


@pytest.mark.parametrize("args,words", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_refused_with_the_input_and_the_fix_named(args, words, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(_files(tmp_path))
    argv = ["extract", "--out", "out", "--max-tokens", "128", *args]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and all(w in err for w in words), err
    assert not (tmp_path / "out").exists()  # a refused run leaves nothing, so it locks no settings


def test_duplicate_ids_are_counted_and_the_first_kept(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(_files(tmp_path))
    assert cli.main(["extract", "--out", "out", "--max-tokens", "128", "--data", "dup.json"]) == 0
    m = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert m["samples"] == 2 and m["data_skipped_total"] == 1 and m["dataset_samples"] == 2
    assert "duplicate id" in capsys.readouterr().out


def test_a_torn_last_regenerated_line_is_regenerated_and_a_bad_middle_line_refused(tmp_path):
    from eagle3kit.data.conversations import DataError
    from eagle3kit.extract import _read_regenerated

    f = tmp_path / "regenerated.jsonl"
    f.write_text(json.dumps(GOOD[0]) + "\n" + json.dumps(GOOD[1])[:20])
    assert list(_read_regenerated(f)) == ["c0"]
    f.write_text(json.dumps(GOOD[0]) + "\n{torn\n" + json.dumps(GOOD[1]) + "\n")
    with pytest.raises(DataError, match="regenerated.jsonl:2"):
        _read_regenerated(f)


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["extract", "--help"])
    out = capsys.readouterr().out
    assert "(default: 2048)" in out and "(default: embedded:smollm2)" in out


def test_a_resume_with_another_split_is_refused(tmp_path, monkeypatch, capsys):
    """The split is part of the data set: a resume with another --seed or --heldout-percent would put new samples
    in other splits than the old ones' rule. Refused, nothing changed; the same settings resume."""
    monkeypatch.chdir(_files(tmp_path))
    base = ["extract", "--out", "out", "--max-tokens", "128", "--data", "good.json", "--max-samples", "2"]
    assert cli.main(base) == 0
    before = (tmp_path / "out" / "manifest.jsonl").read_text()
    for extra in (["--seed", "1"], ["--heldout-percent", "10"]):
        assert cli.main([*base, "--max-samples", "4", *extra]) == 2
        err = capsys.readouterr().err
        assert "other settings" in err and "'split'" in err and "Traceback" not in err, err
        assert (tmp_path / "out" / "manifest.jsonl").read_text() == before
    assert cli.main([*base, "--max-samples", "4"]) == 0


def test_two_extractions_into_one_folder_exclude_each_other(tmp_path, monkeypatch, capsys):
    """While an extraction holds a folder, a second one into it is refused at once, naming the holder; once it
    is done, the folder is free (and carries no lock file)."""
    from eagle3kit.pipeline import exclusive

    monkeypatch.chdir(_files(tmp_path))
    argv = ["extract", "--out", "out", "--max-tokens", "128", "--data", "good.json", "--max-samples", "2"]
    with exclusive(tmp_path / "out"):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "another extraction is writing there (pid" in err and "Traceback" not in err, err
        assert not (tmp_path / "out" / "manifest.jsonl").exists()
    assert cli.main(argv) == 0
    assert (tmp_path / "out" / "manifest.jsonl").exists() and not (tmp_path / "out" / ".lock").exists()


def test_a_killed_holders_forked_children_are_waited_for_not_reported_as_another_run(tmp_path):
    """A run killed with SIGKILL leaves its forked children (loader workers) holding the flock while they exit: the
    next run into the folder waits for them when the holder named in the lock file is gone, and refuses at once
    when it is alive."""
    import fcntl
    import socket

    from eagle3kit.pipeline import exclusive

    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    holder = f"pid {dead.pid} on {socket.gethostname()}"
    (out / ".lock").write_text(holder)
    # a child that holds the lock for 1.5 s, as a killed trainer's exiting loader worker would
    child = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
                              "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(1.5)",
                              str(out / ".lock")], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    t0 = time.monotonic()
    with exclusive(out, "training", orphan_wait_s=20):
        assert time.monotonic() - t0 >= 0.5  # it waited for the child, not took the lock beside it
        assert (out / ".lock").read_text() == f"pid {os.getpid()} on {socket.gethostname()}"
    child.wait()
    # a holder that is alive (this process) is refused at once, and so is a dead one whose children never let go
    with open(out / ".lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(f"pid {os.getpid()} on {socket.gethostname()}")
        f.flush()
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=r"another training is writing there \(pid"):
            with exclusive(out, "training", orphan_wait_s=20):
                pass
        assert time.monotonic() - t0 < 1
        f.seek(0), f.truncate(), f.write(holder), f.flush()
        with pytest.raises(ValueError, match="processes it started still hold the lock after 0.5 s"):
            with exclusive(out, "training", orphan_wait_s=0.5):
                pass


@pytest.mark.parametrize("args,words", [
    (["--capture-layers", "2", "15", "99", "--drafter-config", "ok.json"], ["--capture-layers 2 15 99", "[99]",
                                                                          "from 1 to 29"]),
    (["--capture-layers", "2", "15", "27", "--drafter-config", "notjson.json"], ["notjson.json", "not a readable JSON"]),
    (["--capture-layers", "2", "15", "27", "--drafter-config", "missing.json"], ["missing.json", "not a readable"]),
    (["--capture-layers", "2", "15", "27"], ["--drafter-config and --capture-layers"]),
])
def test_doctor_refuses_bad_input_with_the_fix(args, words, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ok.json").write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}))
    (tmp_path / "notjson.json").write_text("{not json")
    assert cli.main(["doctor", *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and all(w in err for w in words), err


def test_data_that_is_not_text_and_an_out_that_is_not_writable_are_refused(tmp_path, monkeypatch, capsys):
    import os

    monkeypatch.chdir(_files(tmp_path))
    (tmp_path / "binary.jsonl").write_bytes(b'{"id": "a"}\n\xff\xfe\x00')
    assert cli.main(["extract", "--out", "out", "--data", "binary.jsonl"]) == 2
    assert "binary.jsonl: not UTF-8 text at byte 12" in capsys.readouterr().err
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == "ro" else real(p, mode))  # root writes anywhere
    (tmp_path / "ro").mkdir()
    assert cli.main(["extract", "--out", "ro/out", "--data", "good.json"]) == 2
    assert "--out ro/out: ro is not writable" in capsys.readouterr().err
