"""The papermill runner: real execution of small notebooks, parameter validation, failing cells, metrics."""
import json
import logging
import os
import subprocess
import sys

import nbformat
import pytest

from eagle3kit.params import ParamsError
from eagle3kit.runner import plan_run, run
from tests.conftest import ROOT


def notebook(path, params_src, body_src):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "eagle3kit", "display_name": "eagle3kit", "language": "python"}
    p = nbformat.v4.new_code_cell(params_src)
    p.metadata["tags"] = ["parameters"]
    nb.cells = [nbformat.v4.new_markdown_cell("# test"), p, nbformat.v4.new_code_cell(body_src)]
    nbformat.write(nb, path)


@pytest.fixture
def project(tmp_path):
    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    notebook(nbs / "a_square.ipynb", "n = 3\nlabel = 'x'", "import eagle3kit\nassert n > 0\n"
             "eagle3kit.record(square=n * n, label=label)\nprint('squared', n)")
    notebook(nbs / "b_fail.ipynb", "limit = 1.5", "x = 1\nraise ValueError(f'boom at limit {limit}')")
    (tmp_path / "params").mkdir()
    return tmp_path


def write_params(project, text):
    p = project / "params" / "p.yaml"
    p.write_text(text)
    return p


def test_papermill_executes_and_records_metrics(project, monkeypatch, tmp_path_factory, caplog):
    import re

    caplog.set_level(logging.INFO, logger="papermill")
    p = write_params(project, "experiment: e\nsteps: [a_square]\nnotebooks:\n  a_square: {n: 7}\n")
    scratch = tmp_path_factory.mktemp("scratch")
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr("tempfile.tempdir", None)
    monkeypatch.delenv("JUPYTER_PATH", raising=False)
    out = run(p, run_dir=project / "out")
    assert not list(scratch.iterdir()) and "JUPYTER_PATH" not in os.environ  # the private kernelspec is gone
    assert json.loads((out / "a_square" / "metrics.json").read_text()) == {"square": 49, "label": "x"}
    assert json.loads((out / "metrics.json").read_text())["square"] == 49
    assert json.loads((out / "status.json").read_text())["a_square"]["state"] == "ok"
    executed = nbformat.read(out / "a_square" / "a_square.ipynb", as_version=4)
    assert any("squared 7" in o.get("text", "") for c in executed.cells if c.cell_type == "code" for o in c.outputs)
    assert "n: 7" in (out / "params.yaml").read_text()
    cells = [r.getMessage() for r in caplog.records if "Cell" in r.getMessage()]  # dated: where a step's time went
    assert cells and all(re.match(r"\d\d:\d\d:\d\d (Executing|Ending) Cell \d", c) for c in cells), cells


@pytest.mark.parametrize("text,match", [
    ("steps: [a_square]\nnotebooks:\n  a_square: {m: 7}\n", r"notebooks.a_square.m: notebook a_square declares no"),
    ("steps: [a_square]\nnotebooks:\n  a_square: {n: 'seven'}\n", r"a_square.n = 'seven' is a str.*declares n as int"),
    ("steps: [a_sqare]\n", r"step 'a_sqare' has no notebook.*Did you mean 'a_square'"),
    ("steps: [a_square]\ncommon: {lable: y}\n", r"common.lable.*Did you mean 'label'"),
    ("stepz: [a_square]\n", r"unknown top-level key 'stepz'"),
    ("steps: [a_square]\nnotebooks:\n  b_fail: {limit: true}\n", r"b_fail.limit = True is a bool"),
])
def test_bad_params_fail_before_anything_runs(project, text, match):
    p = write_params(project, text)
    with pytest.raises(ParamsError, match=match):
        plan_run(p, project / "notebooks")
    assert not (project / "outputs").exists()


def test_failing_cell_stops_the_run_with_its_location(project):
    p = write_params(project, "experiment: f\nsteps: [a_square, b_fail]\n")
    r = subprocess.run([sys.executable, "-m", "eagle3kit.cli", "run", str(p), "--run-dir", str(project / "o")],
                       capture_output=True, text=True, cwd=project, timeout=300)
    assert r.returncode == 1
    assert "step b_fail failed in cell 2" in r.stderr and "ValueError: boom at limit 1.5" in r.stderr
    status = json.loads((project / "o" / "status.json").read_text())
    assert status["a_square"]["state"] == "ok" and status["b_fail"]["state"] == "failed"
    kept = nbformat.read(project / "o" / "b_fail" / "b_fail.ipynb", as_version=4)
    assert any("papermill-error-cell" in json.dumps(c.metadata) or "An Exception was encountered" in c.source
               for c in kept.cells)


def test_only_and_set(project):
    p = write_params(project, "experiment: e\nsteps: [a_square, b_fail]\n")
    out = run(p, only=["a_square"], overrides=["a_square.n=5"], run_dir=project / "o2")
    assert json.loads((out / "metrics.json").read_text())["square"] == 25
    assert not (out / "b_fail").exists()


def test_a_run_folder_continued_with_only_keeps_earlier_steps(project):
    """gpu_record.sh runs one step per phase into one folder: the merged metrics, status and params must hold all."""
    notebook(project / "notebooks" / "c_cube.ipynb", "n = 2", "import eagle3kit\neagle3kit.record(cube=n ** 3)")
    p = write_params(project, "experiment: e\nsteps: [a_square, c_cube]\nnotebooks:\n  a_square: {n: 4}\n")
    out = run(p, only=["a_square"], run_dir=project / "o3")
    run(p, only=["c_cube"], run_dir=out)
    assert json.loads((out / "metrics.json").read_text()) == {"square": 16, "label": "x", "cube": 8}
    status = json.loads((out / "status.json").read_text())
    assert status["a_square"]["state"] == status["c_cube"]["state"] == "ok"
    text = (out / "params.yaml").read_text()
    assert "a_square" in text and "c_cube" in text and "n: 4" in text


def test_record_rejects_non_flat_values(tmp_path, monkeypatch):
    import eagle3kit

    monkeypatch.setenv("EAGLE3KIT_STEP_DIR", str(tmp_path))
    with pytest.raises(TypeError, match="flat metrics.json"):
        eagle3kit.record(table=[1, 2])
    with pytest.raises(ValueError, match="finite"):
        eagle3kit.record(x=float("nan"))


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_an_interrupted_run_says_so_in_status_json(project, sig):
    """A run stopped mid-step (SIGTERM from a scheduler, Ctrl-C) marks that step interrupted and the later ones not
    run, and exits 130 with one line."""
    import signal
    import time

    started = project / "cell-started"
    notebook(project / "notebooks" / "c_slow.ipynb", "seconds = 120",
             f"import pathlib, time\npathlib.Path({str(started)!r}).touch()\ntime.sleep(seconds)")
    p = write_params(project, "experiment: s\nsteps: [c_slow, a_square]\n")
    # SIGINT as a terminal delivers it: a suite started in the background by a non-interactive shell (`make test &`)
    # inherits SIGINT ignored, and so would the run (2026-12-05: the cell ran its 120 s, twice, only in such suites)
    proc = subprocess.Popen([sys.executable, "-m", "eagle3kit.cli", "run", str(p), "--run-dir", str(project / "o")],
                            cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    status_file = project / "o" / "status.json"
    deadline = time.time() + 120
    # signal once the kernel is executing the sleeping cell (it says so), not a fixed time after "running"
    while time.time() < deadline and not started.exists():
        time.sleep(0.2)
    time.sleep(0.5)
    assert status_file.exists() and json.loads(status_file.read_text())["c_slow"]["state"] == "running"
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=120)
    status = json.loads(status_file.read_text())
    assert status["c_slow"]["state"] == "interrupted", status
    assert status["a_square"]["state"].startswith("not run"), status
    assert proc.returncode == 130 and "eagle3kit run: interrupted" in err, err[-2000:]
    assert "eagle3kit/cli.py" not in err  # no traceback of ours (the kernel logs its own KeyboardInterrupt)


@pytest.mark.parametrize("params_file", sorted(p.name for p in (ROOT / "params").glob("*.yaml")))
def test_every_shipped_params_file_fits_the_notebooks(params_file):
    """Each params/*.yaml resolves against the notebooks it names (a GPU run of gpu-smollm2-drafter.yaml was refused
    on the machine, after its install, for a key its notebook did not declare)."""
    plan = plan_run(ROOT / "params" / params_file, ROOT / "notebooks")
    assert plan.steps


def test_a_key_no_notebook_declares_is_refused_in_a_shipped_file(tmp_path):
    text = (ROOT / "params" / "gpu-smollm2-drafter.yaml").read_text().replace("rows_per_batch:", "rows_per_batchx:")
    (tmp_path / "p.yaml").write_text(text)
    with pytest.raises(ParamsError, match="rows_per_batchx"):
        plan_run(tmp_path / "p.yaml", ROOT / "notebooks")


def test_only_one_step_of_a_shipped_file_keeps_its_common_keys():
    """`--only 06_compare` of the GPU params (06 over records brought back, after a serve phase failed) was refused:
    its common keys (target) are declared by the other steps of the file, not by 06; a misspelt one still fails."""
    plan = plan_run(ROOT / "params" / "gpu-smollm2-drafter.yaml", ROOT / "notebooks", only=["06_compare"])
    assert plan.steps == ["06_compare"] and "target" not in plan.per_step["06_compare"]
    with pytest.raises(ParamsError, match="common.tagret"):
        plan_run(ROOT / "params" / "gpu-smollm2-drafter.yaml", ROOT / "notebooks", only=["06_compare"],
                 overrides=["tagret=x"])
    # a common key set on the command line must reach a step run now: 06 has no 'target', so it would change nothing
    with pytest.raises(ParamsError, match=r"--set target=\.\.\.: no step run now \(06_compare\)"):
        plan_run(ROOT / "params" / "gpu-smollm2-drafter.yaml", ROOT / "notebooks", only=["06_compare"],
                 overrides=["target=embedded:smollm2"])
    plan_run(ROOT / "params" / "gpu-smollm2-drafter.yaml", ROOT / "notebooks", only=["05_acceptance"],
             overrides=["target=embedded:smollm2"])
