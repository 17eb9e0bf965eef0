"""Trust, second round (#45), on the trial's own small inputs (a 6-conversation data set captured at 64 tokens, a
drafter trained for 2 steps: seconds): nothing a user owns is deleted, the doctor fails a broken drafter naming the
tensor, a refused run does not block its own fix, numbers are taken as users write them."""
import json
import shutil

import pytest

from eagle3kit.cli import main
from eagle3kit.trial import SMALL, TINY_TRAIN


def run(argv, capsys):
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.fixture
def inputs(trial_inputs):
    return trial_inputs


def _user_folder(path):
    path.mkdir(parents=True)
    (path / "thesis.txt").write_text("mine")
    return path / "thesis.txt"


# --- nothing a user owns is deleted -----------------------------------------------------------------------------

def test_trial_refuses_a_folder_holding_the_users_files(tmp_path, capsys):
    mine = _user_folder(tmp_path / "t")
    rc, out = run(["trial", "--folder", tmp_path / "t", "--only", "verify"], capsys)
    assert rc != 0 and mine.read_text() == "mine" and sorted(p.name for p in (tmp_path / "t").iterdir()) == \
        ["thesis.txt"], out
    assert "thesis.txt" in out and "--force" in out and "Traceback" not in out


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_a_drafter_export_refuses_a_dest_holding_the_users_files(inputs, tmp_path, capsys, fmt):
    dest = tmp_path / "x"
    mine = _user_folder(dest)
    rc, out = run(["export", fmt, inputs / "tr", dest], capsys)
    assert rc != 0 and mine.read_text() == "mine" and "thesis.txt" in out and "--force" in out, out
    assert not [p for p in tmp_path.iterdir() if p.name != "x"]  # no temp folder left
    mine.unlink()
    assert run(["export", fmt, inputs / "tr", dest], capsys)[0] == 0  # empty: written
    assert run(["export", fmt, inputs / "tr", dest], capsys)[0] == 0  # its own earlier output: replaced
    (dest / "notes.md").write_text("mine")  # a user's file beside an export makes the folder the user's again
    rc, out = run(["export", fmt, inputs / "tr", dest], capsys)
    assert rc != 0 and (dest / "notes.md").read_text() == "mine" and "notes.md" in out
    assert run(["export", fmt, inputs / "tr", dest, "--force"], capsys)[0] == 0
    assert not (dest / "notes.md").exists()


@pytest.mark.parametrize("argv", [["export", "speculators", "{ds}", "{dest}"],
                                  ["derive", "{ds}", "{dest}", "--storage", "fp8"],
                                  ["compare", "{tr}", "--out", "{dest}"]])
def test_every_command_writing_a_named_folder_refuses_the_users_files(inputs, tmp_path, capsys, argv):
    dest = tmp_path / "d"
    mine = _user_folder(dest)
    argv = [a.format(ds=inputs / "ds", tr=inputs / "tr", dest=dest) for a in argv]
    rc, out = run(argv, capsys)
    assert rc != 0 and mine.read_text() == "mine" and "thesis.txt" in out and "--force" in out, out
    mine.unlink()
    assert run(argv, capsys)[0] == 0 and run(argv, capsys)[0] == 0, "an empty folder, then its own output"


# --- the doctor fails a broken drafter, naming what -------------------------------------------------------------

def _drafter(inputs, tmp_path):
    d = tmp_path / "drafter"
    shutil.copytree(inputs / "tr" / "best", d)
    return d


def test_the_doctor_passes_a_whole_drafter(inputs, tmp_path, capsys):
    rc, out = run(["doctor", "--drafter", _drafter(inputs, tmp_path)], capsys)
    assert rc == 0 and "every tensor" in out and "serve it with SGLang" in out, out


def _edit(d, **kw):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(kw)
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("breakage, words", [
    ("hidden_size", ["hidden_size=640", "layers.0.self_attn.q_proj.weight", "fc.weight"]),
    ("draft_vocab_size", ["draft_vocab_size=128", "lm_head.weight", "d2t"]),
    ("cut", ["model.safetensors", "cut short"]),
    ("extra tensor", ["embed_tokens.weight", "dropped"]),
    ("bf16 -> f32", ["norm.weight", "F32"]),
])
def test_the_doctor_fails_a_broken_drafter_naming_the_tensor(inputs, tmp_path, capsys, breakage, words):
    import torch
    from safetensors.torch import load_file, save_file

    d = _drafter(inputs, tmp_path)
    w = d / "model.safetensors"
    if breakage == "hidden_size":
        _edit(d, hidden_size=640)
    elif breakage == "draft_vocab_size":
        _edit(d, draft_vocab_size=128)
    elif breakage == "cut":
        w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    else:
        t = load_file(str(w))
        if breakage == "extra tensor":
            t["embed_tokens.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
        else:
            t["norm.weight"] = t["norm.weight"].float()
        save_file(t, str(w))
    rc, out = run(["doctor", "--drafter", d], capsys)
    assert rc != 0 and "serve it with" not in out and "Traceback" not in out, out
    assert all(x in out for x in words), (words, out)


def test_a_drafter_config_that_is_a_list_is_refused(inputs, tmp_path, capsys):
    d = _drafter(inputs, tmp_path)
    (d / "config.json").write_text("[1, 2]")
    rc, out = run(["doctor", "--drafter", d], capsys)
    assert rc != 0 and "config.json" in out and "list" in out and "Traceback" not in out, out


# --- a refused run does not block its own fix; numbers as users write them ---------------------------------------

def test_an_invalid_setting_is_refused_before_anything_is_written_and_the_fix_then_runs(inputs, tmp_path, capsys):
    out = tmp_path / "t"
    rc, msg = run(["train", "--data", inputs / "ds", "--out", out, *TINY_TRAIN, "--set", "weight_decay=-0.1"], capsys)
    assert rc != 0 and "weight_decay=-0.1" in msg and "Traceback" not in msg and not out.exists(), msg
    rc, msg = run(["train", "--data", inputs / "ds", "--out", out, *TINY_TRAIN, "--set", "weight_decay=0.1",
                   "--set", "lr=3e-4"], capsys)  # the corrected command, lr as users (and the defaults) write it
    assert rc == 0, msg
    assert json.loads((out / "train.json").read_text())["lr"] == 3e-4


def test_a_check_after_setup_leaves_no_settings_behind(inputs, tmp_path, capsys):
    """A refusal that only the data can tell (too few samples for one step) writes no train.json: the corrected
    command is not refused as a run with other settings."""
    out = tmp_path / "t"
    rc, msg = run(["train", "--data", inputs / "ds", "--out", out, *TINY_TRAIN, "--set", "grad_accum=64"], capsys)
    assert rc != 0 and "grad_accum" in msg and not (out / "train.json").exists(), msg
    assert run(["train", "--data", inputs / "ds", "--out", out, *TINY_TRAIN], capsys)[0] == 0


@pytest.mark.parametrize("setting, words", [("max_minutes=-5", ["max_minutes=-5", ">= 0"]),
                                            ("workers=-1", ["workers=-1"]), ("eval_steps=-2", ["eval_steps=-2"]),
                                            ("lr=.nan", ["lr=nan", "finite"]),
                                            ("device=cuda:0", ["device=cuda:0", "device=cpu"])])
def test_negative_budgets_and_counts_are_refused(inputs, tmp_path, capsys, setting, words):
    import torch

    if setting.startswith("device") and torch.cuda.is_available():
        pytest.skip("a machine with CUDA has the device asked for")
    rc, msg = run(["train", "--data", inputs / "ds", "--out", tmp_path / "t", "--set", setting], capsys)
    assert rc != 0 and all(w in msg for w in words) and not (tmp_path / "t").exists(), msg


def test_trial_only_with_no_matching_case_runs_nothing(tmp_path, capsys):
    rc, msg = run(["trial", "--folder", tmp_path / "t", "--only", "nosuchword"], capsys)
    assert rc != 0 and "nosuchword" in msg and "nothing was run" in msg and not (tmp_path / "t").exists(), msg


# --- one-line errors naming the input ----------------------------------------------------------------------------

def test_verify_without_a_manifest_says_so_and_lists_the_unlisted_samples(inputs, tmp_path, capsys):
    ds = tmp_path / "ds"
    shutil.copytree(inputs / "ds", ds)
    (ds / "manifest.jsonl").unlink()
    rc, msg = run(["verify", ds], capsys)
    assert rc != 0 and "manifest.jsonl: missing" in msg and "s0000000.rank0.safetensors" in msg, msg


@pytest.mark.parametrize("record, words", [({"id": "a", "messages": None}, ["'messages' is null"]),
                                           ({"id": "a", "messages": ["hi", "there"]}, ["list holding strs"])])
def test_messages_that_are_not_turns_are_refused(tmp_path, capsys, record, words):
    (tmp_path / "d.jsonl").write_text(json.dumps(record) + "\n")
    rc, msg = run(["extract", "--data", tmp_path / "d.jsonl", "--out", tmp_path / "o", *SMALL], capsys)
    assert rc != 0 and "d.jsonl" in msg and all(w in msg for w in words) and "Traceback" not in msg, msg


@pytest.mark.parametrize("text, words", [("experiment: x\nnotebooks: [03_extract]\n", ["notebooks: a list"]),
                                         ("experiment: x\ncommon: [a]\n", ["common: a list"]),
                                         ("experiment: x\nnotebooks:\n  03_extract: [1]\n", ["notebooks.03_extract"])])
def test_params_sections_that_are_not_mappings_are_refused(tmp_path, capsys, text, words):
    from eagle3kit.trial import NB

    (tmp_path / "p.yaml").write_text(text)
    for extra in ([], ["--set", "x=1"]):
        rc, msg = run(["run", tmp_path / "p.yaml", *NB, *extra], capsys)
        assert rc != 0 and "p.yaml" in msg and all(w in msg for w in words) and "Traceback" not in msg, msg


def test_a_cut_target_and_a_cut_sample(inputs, target_path, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(target_path, model, symlinks=True)
    w = model / "model.safetensors"
    blob = w.read_bytes()
    w.unlink()
    w.write_bytes(blob[: len(blob) // 3])
    rc, msg = run(["extract", "--target", model, "--data", inputs / "good.json", "--out", tmp_path / "o", *SMALL],
                  capsys)
    assert rc != 0 and "model.safetensors: cut short" in msg and "Traceback" not in msg, msg
    ds = tmp_path / "ds"
    shutil.copytree(inputs / "ds", ds)
    s = ds / "samples" / "s0000000.rank0.safetensors"
    s.write_bytes(s.read_bytes()[:300])
    rc, msg = run(["train", "--data", ds, "--out", tmp_path / "t", *TINY_TRAIN], capsys)
    assert rc == 0 and "skipped sample" in msg and "s0000000" in msg and "Traceback" not in msg, msg
