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


def _imports(path, name: str, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``path`` (module ``name``) imports anywhere: at its top and inside functions,
    ``from a import b`` counting ``a.b`` where that is a module, relative imports resolved."""
    import ast

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    named = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            named |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            named |= {base} | {f"{base}.{a.name}" for a in node.names}
    found = set()
    for m in named:
        while m and m not in modules:  # a name inside a module: the module
            m = m.rpartition(".")[0]
        if m and m != name:
            found.add(m)
    return found


def import_cycles(src) -> list[list[str]]:
    """Each set of modules under ``src`` that import one another round a circle (strongly connected, more than one)."""
    files = {}
    for f in sorted(src.rglob("*.py")):
        parts = f.relative_to(src).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {n: _imports(f, n, set(files)) for n, f in files.items()}
    order, low, stack, cycles, counter = {}, {}, [], [], [0]

    def visit(v):  # Tarjan's strongly connected components
        order[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        for w in graph[v]:
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in order:
            visit(v)
    return cycles


def test_no_import_circles_in_the_package():
    """Small modules, no import circles: function-local imports count too (they hide a circle, they do not break it)."""
    assert import_cycles(ROOT / "src") == []


def test_the_circle_finder_finds_a_circle_through_a_local_import(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "c.py").write_text("import os\n\ndef g():\n    from pkg.a import f\n")
    (pkg / "d.py").write_text("from pkg import a\n")  # imports into the circle, is not on it
    assert import_cycles(tmp_path) == [["pkg.a", "pkg.b", "pkg.c"]]
    (pkg / "c.py").write_text("import os\n")
    assert import_cycles(tmp_path) == []
