"""Notebooks in git carry no outputs and declare their parameters; environment.yml matches pyproject.toml."""
import json
import re
import tomllib

import pytest

from tests.conftest import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_pipeline_notebooks():
    assert [p.stem for p in NOTEBOOKS] == ["00_target", "01_tp_check", "02_capture_spec", "03_extract",
                                             "04_train", "05_acceptance", "06_compare"]


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_clean_and_parameterized(nb):
    data = json.loads(nb.read_text())
    code = [c for c in data["cells"] if c["cell_type"] == "code"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), f"{nb.name} has outputs"
    params = [c for c in code if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(params) == 1, f"{nb.name} needs exactly one cell tagged 'parameters'"
    assert data["metadata"]["kernelspec"]["name"] == "eagle3kit"
    assert data["cells"][0]["cell_type"] == "markdown"  # each notebook states what it checks


def _name(req: str) -> str:
    return re.split(r"[<>=!\[; ]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_environment_yml_matches_pyproject():
    import yaml

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {_name(r) for r in project["dependencies"]} | {_name(r) for r in project["optional-dependencies"]["dev"]}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_list = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    conda = {_name(d) for d in env["dependencies"] if isinstance(d, str)}
    have = {_name(r) for r in pip_list if not r.startswith("-")} | ({"torch"} if "pytorch-cpu" in conda else set())
    assert wanted <= have, f"environment.yml lacks {sorted(wanted - have)}"
    extra = have - wanted
    assert not extra, f"environment.yml has {sorted(extra)} that pyproject.toml does not"


def test_parameter_lines_parse_in_papermill():
    """papermill skips a parameter line with a second '=' (in its comment too): such a parameter loses its help
    and type in `papermill --help-notebook` and a warning clutters every run."""
    for nb in NOTEBOOKS:
        cell = next(c for c in json.loads(nb.read_text())["cells"] if "parameters" in c["metadata"].get("tags", []))
        bad = [ln for ln in "".join(cell["source"]).splitlines() if ln.count("=") > 1]
        assert not bad, (nb.name, bad)


def test_readme_points_to_no_file_outside_the_repository():
    """A user's checkout has only the repository: every path the README names must be inside it."""
    import re

    text = (ROOT / "README.md").read_text()
    outside = re.findall(r"\.\./[\w./-]+", text)
    assert not outside, outside
