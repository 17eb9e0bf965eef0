"""The extraction's settings are one typed object (``ExtractConfig``): the command line's options are made from it, notebook
03 builds it from its parameters, and the params check runs its checks before any step starts."""
import argparse
import ast
import json
from dataclasses import fields

import pytest

from eagle3kit import cli
from eagle3kit.extract_config import ExtractConfig
from eagle3kit.params import ParamsError
from eagle3kit.runner import declared_parameters, plan_run
from tests.conftest import ROOT


def _parser():
    p = argparse.ArgumentParser()
    ExtractConfig.add_arguments(p)
    return p


def test_every_setting_is_an_option_with_the_settings_default():
    """The options are the fields (``progress`` apart), and a command line with none given is the default object."""
    p = _parser()
    dests = {a.dest for a in p._actions if a.dest != "help"}
    assert dests == set(ExtractConfig.names()) - {"progress"}
    assert ExtractConfig.from_args(p.parse_args(["--out", "d"])) == ExtractConfig(out_dir="d")
    given = p.parse_args(["--out", "d", "--layers", "3", "9", "--max-samples", "7", "--storage", "fp8", "--regenerate",
                          "--regenerate-minutes", "2.5", "--engine", "sglang", "--urls", "http://a:1",
                          "--reference-batch-tokens", "0", "--server-args", "--tp", "2"])
    c = ExtractConfig.from_args(given)
    assert (c.aux_layer_ids, c.max_samples, c.storage, c.regenerate, c.regenerate_minutes, c.urls, c.server_args,
            c.reference_batch_tokens) == ([3, 9], 7, "fp8", True, 2.5, ["http://a:1"], ["--tp", "2"], 0)


@pytest.mark.parametrize("settings,words", [
    ({"storage": "fp16"}, "--storage fp16: choose bf16 or fp8"),
    ({"max_samples": "3"}, "max_samples='3': expected int | None"),
    ({"heldout": 5}, "unknown extraction settings ['heldout']"),
    ({"prefill_graph": True}, "--prefill-graph is a capture option of the sglang engine"),
    ({"engine": "sglang", "prefill_graph": True, "final_normed": True}, "--final-normed with --prefill-graph"),
    ({"heldout_percent": 100}, "--heldout-percent 100: a share in [0, 100)"),
    ({"rank": 2, "world_size": 2}, "--rank 2 --world-size 2"),
    ({"regenerate_servers": 2, "engine": "sglang", "urls": ["http://a:1"]}, "with --urls, give more --urls"),
    ({"max_tokens": 1}, "--max-tokens 1: a sample needs at least 2 tokens"),
    ({"engine": "vllm"}, "engine 'vllm': choose 'transformers' (CPU reference) or 'sglang'"),
    ({"reference_batch_tokens": -1}, "--reference-batch-tokens -1: give 0"),
    ({"regenerate_minutes": -1}, "--regenerate-minutes -1: give minutes >= 0"),
    ({"concurrency": 0}, "--concurrency 0 / --regenerate-max-new-tokens 256: give positive numbers"),
    ({"max_samples": 0}, "--max-samples 0: give a positive number"),
    ({"regenerate_servers": 0}, "--regenerate-servers 0: give a whole number >= 1"),
    ({"urls": "http://a:1"}, "urls='http://a:1': expected list"),
])
def test_a_bad_setting_is_refused_naming_it(settings, words):
    with pytest.raises(ValueError) as e:
        ExtractConfig.from_dict(settings)
    assert words in str(e.value), str(e.value)


def test_the_command_line_refuses_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "never"
    assert cli.main(["extract", "--out", str(out), "--heldout-percent", "150"]) == 2
    assert "--heldout-percent 150.0: a share in [0, 100)" in capsys.readouterr().err and not out.exists()


def test_notebook_03_builds_the_object_from_parameters_of_the_same_names():
    """Every parameter of 03 that is a setting keeps the setting's type; the notebook makes the object from them (no
    second list of keyword arguments to fall out of step)."""
    declared = declared_parameters(ROOT / "notebooks" / "03_extract.ipynb")
    shared = set(declared) & set(ExtractConfig.names())
    assert {"target", "data", "engine", "storage", "max_samples", "max_tokens", "regenerate", "prefill_graph",
            "heldout_percent", "seed"} <= shared
    types = {f.name: str(f.type) for f in fields(ExtractConfig)}
    for k in shared:
        default = ast.literal_eval(declared[k]["default"])
        ExtractConfig.from_dict({k: default})  # the notebook's default is a valid setting
        assert default is None or type(default).__name__ in types[k] or (types[k].startswith("float")
                                                                           and isinstance(default, int)), k
    src = "".join("".join(c["source"]) for c in json.loads((ROOT / "notebooks" / "03_extract.ipynb").read_text())["cells"])
    assert "ExtractConfig.from_dict(" in src and "run_extraction(cfg)" in src


def test_the_params_check_runs_the_steps_settings_check_before_any_step(tmp_path):
    """A value 03 would refuse stops the run at planning time, naming the file, the step and the setting; every params
    file of the repository passes."""
    params = tmp_path / "p.yaml"
    params.write_text("experiment: x\nsteps: [00_target, 03_extract]\nnotebooks:\n  03_extract:\n    storage: fp16\n")
    with pytest.raises(ParamsError, match=r"p.yaml: 03_extract: --storage fp16: choose bf16 or fp8"):
        plan_run(params, ROOT / "notebooks")
    with pytest.raises(ParamsError, match="--prefill-graph is a capture option of the sglang engine"):
        plan_run(ROOT / "params" / "demo.yaml", ROOT / "notebooks", overrides=["03_extract.prefill_graph=true"])
    for p in sorted((ROOT / "params").glob("*.yaml")):
        plan_run(p, ROOT / "notebooks")


def test_the_docs_table_is_the_objects_own():
    """docs/settings.md carries the table made from the fields: a setting added, renamed or re-described without the
    docs fails here."""
    from eagle3kit.extract_config import settings_table

    table = settings_table()
    assert table in (ROOT / "docs" / "settings.md").read_text()
    assert all(f"| `{name}` |" in table for name in ExtractConfig.names())
