"""The training's settings are one typed object (``TrainConfig``): notebook 04 builds it from its parameters of the
same names, the params check runs its checks before any step starts, the command line's ``--set`` reads it, and
docs/settings.md lists it."""
import ast
import json
import re
from dataclasses import fields

import pytest

from eagle3kit import cli
from eagle3kit.drafter.train_config import TrainConfig, TrainError, from_notebook, train_settings_table
from eagle3kit.params import ParamsError
from eagle3kit.runner import declared_parameters, plan_run
from tests.conftest import ROOT

NB = ROOT / "notebooks" / "04_train.ipynb"


def test_notebook_04_builds_the_object_from_parameters_of_the_same_names():
    """Every parameter of 04 that is a setting keeps the setting's type and its default is a valid setting; the
    notebook makes the object from them (no second list of keyword arguments to fall out of step); its empty values
    read as the defaults."""
    declared = declared_parameters(NB)
    shared = set(declared) & set(TrainConfig.names())
    assert {"draft_vocab_size", "ttt_steps", "loss", "lr", "tokens_per_batch", "live", "drafter", "max_minutes",
            "fit_schedule", "serving_steps"} <= shared
    assert set(declared) - shared == {"learned_claims"}  # the notebook's own assertion switch, not a setting
    types = {f.name: str(f.type) for f in fields(TrainConfig)}
    defaults = {k: ast.literal_eval(declared[k]["default"]) for k in shared}
    for k, default in defaults.items():
        assert default is None or type(default).__name__ in types[k] or (types[k].startswith("float")
                                                                           and isinstance(default, int)), k
    cfg = from_notebook({**defaults, "learned_claims": True}, data="d", out_dir="o")
    assert cfg.target is None and cfg.live is None and cfg.data == "d" and cfg.lr == defaults["lr"]
    src = "".join("".join(c["source"]) for c in json.loads(NB.read_text())["cells"])
    assert "from_notebook(globals()" in src and "train(cfg)" in src and "TrainConfig(" not in src


@pytest.mark.parametrize("bad, words", [({"lr": -1}, "lr > 0"), ({"loss": "mse"}, "loss='mse'"),
                                        ({"ttt_steps": 2}, "ttt_steps=2 < serving_steps=3"),
                                        ({"live": {"stream_gb": 0}}, "stream_gb=0"),
                                        ({"fit_schedule": True}, "fit_schedule needs max_minutes"),
                                        ({"warmup_ratio": 1.5, "lr": 1.0e-3}, "warmup_ratio in [0, 1)")])
def test_the_params_check_runs_the_training_settings_check_before_any_step(tmp_path, bad, words):
    """A value 04 would refuse stops the run at planning time, naming the file, the step and the setting (before,
    00-03 ran first, for minutes to hours on a GPU, and 04 failed)."""
    params = tmp_path / "p.yaml"
    lines = "".join(f"    {k}: {json.dumps(v)}\n" for k, v in bad.items())
    params.write_text(f"experiment: x\nsteps: [00_target, 04_train]\nnotebooks:\n  04_train:\n{lines}")
    with pytest.raises(ParamsError, match=r"p.yaml: 04_train: .*" + re.escape(words)):
        plan_run(params, ROOT / "notebooks")
    params.write_text("experiment: x\nsteps: [00_target, 04_train]\nnotebooks:\n  04_train:\n    lr: 1.0e-3\n")
    plan_run(params, ROOT / "notebooks")  # a good value passes


def test_the_command_line_reads_the_same_object(tmp_path, capsys):
    out = tmp_path / "never"
    assert cli.main(["train", "--data", str(tmp_path), "--out", str(out), "--set", "loss=mse"]) != 0
    assert "loss='mse': choose one of" in capsys.readouterr().err and not out.exists()
    assert cli.main(["train", "--data", str(tmp_path), "--out", str(out), "--set", "val_max_samples=-1"]) != 0
    assert "val_max_samples=-1: give >= 0" in capsys.readouterr().err and not out.exists()
    with pytest.raises(TrainError, match="unknown train settings"):
        TrainConfig.from_dict({"data": "d", "out_dir": "o", "learned_claims": True})


def test_the_docs_table_is_the_objects_own():
    """docs/settings.md carries the table made from the fields: a setting added, renamed or re-described without the
    docs fails here."""
    table = train_settings_table()
    assert table in (ROOT / "docs" / "settings.md").read_text()
    assert all(f"| `{name}` |" in table for name in TrainConfig.names())
