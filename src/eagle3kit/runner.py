"""``eagle3kit run``: execute the pipeline's notebooks with papermill, one run folder per invocation.

outputs/<experiment>/<timestamp>/
  params.yaml            the resolved parameters of every step
  status.json            per step: pending / running (with the pid) / ok / failed (with the failing cell) /
                         interrupted (Ctrl-C or SIGTERM; later steps "not run (interrupted before)")
  metrics.json           all steps' metrics merged (flat)
  <step>/<step>.ipynb    the executed notebook (papermill's error banner included when a cell failed)
  <step>/metrics.json    what that notebook recorded through eagle3kit.record
"""
from __future__ import annotations

import ast
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import yaml

from eagle3kit.metrics import STEP_DIR_ENV
from eagle3kit.params import ParamsError, Plan, apply_overrides, load_yaml, parse_override, resolve

KERNEL_NAME = "eagle3kit"
log = logging.getLogger("eagle3kit.run")


class StepFailed(RuntimeError):
    pass


def declared_parameters(notebook: Path) -> dict:
    """Parameters a notebook declares in its ``parameters`` cell, with a type from the annotation or default."""
    import papermill as pm

    declared = pm.inspect_notebook(str(notebook))
    for p in declared.values():
        if p.get("inferred_type_name") in (None, "None", ""):
            try:
                default = ast.literal_eval(p["default"])
                p["inferred_type_name"] = None if default is None else type(default).__name__
            except (ValueError, SyntaxError):
                p["inferred_type_name"] = None
    return declared


def notebooks_in(folder: Path) -> dict[str, Path]:
    return {p.stem: p for p in sorted(Path(folder).glob("*.ipynb"))}


def ensure_kernel(root: Path, argv: list[str] | None = None) -> None:
    """A kernelspec named ``eagle3kit`` that runs *this* interpreter, put first on JUPYTER_PATH.

    Notebooks then execute with the same Python (and packages) as the runner, whatever kernels the machine has.
    ``argv``: another command for it (the warm kernels' launcher).
    """
    spec_dir = root / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True, exist_ok=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": argv or [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "eagle3kit", "language": "python"}))
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("JUPYTER_PATH")]))


@contextmanager
def private_kernel(cwd: Path | None = None):
    """The ``eagle3kit`` kernelspec in a temporary folder for the time of a run; JUPYTER_PATH restored after.

    With EAGLE3KIT_WARM_KERNEL=1 (the test suite's pipeline runs) its kernels come from a fork server started here,
    in the kernels' working folder ``cwd``, and stopped at the end (eagle3kit.warm_kernel)."""
    from eagle3kit import warm_kernel

    before = os.environ.get("JUPYTER_PATH")
    with tempfile.TemporaryDirectory(prefix="eagle3kit-kernel-") as root:
        server = None
        if warm_kernel.enabled():
            sock = str(Path(root) / "warm.sock")
            ensure_kernel(Path(root), warm_kernel.kernel_argv(sock))  # first: the server's environment has JUPYTER_PATH
            server = subprocess.Popen(warm_kernel.server_argv(sock),
                                      stdin=subprocess.PIPE, cwd=str(cwd or Path.cwd()), start_new_session=True)
            # it listens before it imports; a kernel started before that would be a plain one
            deadline = time.time() + 60
            while not os.path.exists(sock) and server.poll() is None and time.time() < deadline:
                time.sleep(0.05)
        else:
            ensure_kernel(Path(root))
        try:
            yield
        finally:
            if server is not None:
                server.stdin.close()  # the server exits at EOF, killing any kernel still running
                try:
                    server.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait()
            if before is None:
                os.environ.pop("JUPYTER_PATH", None)
            else:
                os.environ["JUPYTER_PATH"] = before


def plan_run(params_file: Path, notebooks_dir: Path, only=None, overrides=()) -> Plan:
    data = apply_overrides(load_yaml(params_file), list(overrides), str(params_file))
    available = notebooks_in(notebooks_dir)
    if not available:
        raise ParamsError(f"no notebooks in {notebooks_dir}: pass --notebooks DIR")
    declared = {name: declared_parameters(path) for name, path in available.items()}
    cli_common = {k for step, k, _ in map(parse_override, overrides) if step is None}
    return resolve(data, declared, only=only, source=str(params_file), cli_common=cli_common)


def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True, default=str))
    os.replace(tmp, path)


def execute(plan: Plan, notebooks_dir: Path, run_dir: Path | None = None, cwd: Path | None = None) -> Path:
    """Run every step of ``plan``; returns the run folder. Raises StepFailed naming the notebook and cell."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(run_dir or plan.output_root / plan.experiment / stamp).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    # a run folder continued step by step (--only) keeps what earlier invocations ran and recorded there
    old = yaml.safe_load((run_dir / "params.yaml").read_text()) if (run_dir / "params.yaml").exists() else {}
    old_status = json.loads((run_dir / "status.json").read_text()) if (run_dir / "status.json").exists() else {}
    (run_dir / "params.yaml").write_text(yaml.safe_dump(
        {"experiment": plan.experiment, "steps": list(dict.fromkeys([*(old or {}).get("steps", []), *plan.steps])),
         "notebooks": {**(old or {}).get("notebooks", {}), **plan.per_step}}, sort_keys=False))
    status = {**old_status, **{s: {"state": "pending"} for s in plan.steps}}
    _write_json(run_dir / "status.json", status)
    previous = _raise_on_sigterm()
    try:
        with private_kernel(cwd):
            _run_steps(plan, notebooks_dir, run_dir, cwd, status)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return run_dir


class Interrupted(KeyboardInterrupt):
    """SIGTERM during a run: unwinds like Ctrl-C, so status.json says which step was interrupted."""


def _raise_on_sigterm():
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        raise Interrupted(f"signal {signum}")
    return signal.signal(signal.SIGTERM, handler)


def _run_steps(plan: Plan, notebooks_dir: Path, run_dir: Path, cwd: Path | None, status: dict) -> None:
    import papermill as pm
    from papermill.exceptions import PapermillExecutionError

    for i, step in enumerate(plan.steps, 1):
        step_dir = run_dir / step
        step_dir.mkdir(exist_ok=True)
        out_nb = step_dir / f"{step}.ipynb"
        print(f"[{i}/{len(plan.steps)}] {step}: {plan.per_step[step] or 'notebook defaults'}", flush=True)
        status[step] = {"state": "running", "started": time.time(), "pid": os.getpid()}  # a SIGKILL leaves this
        _write_json(run_dir / "status.json", status)
        os.environ[STEP_DIR_ENV] = str(step_dir)
        t0 = time.time()
        try:
            pm.execute_notebook(str(notebooks_dir / f"{step}.ipynb"), str(out_nb), parameters=plan.per_step[step],
                                kernel_name=KERNEL_NAME, log_output=True, progress_bar=False,
                                cwd=str(cwd or Path.cwd()))
        except PapermillExecutionError as e:
            status[step] = {"state": "failed", "cell": e.exec_count, "cell_index": e.cell_index,
                            "error": f"{e.ename}: {e.evalue}", "seconds": round(time.time() - t0, 1)}
            _write_json(run_dir / "status.json", status)
            raise StepFailed(f"step {step} failed in cell {e.exec_count} (index {e.cell_index}): {e.ename}: "
                             f"{e.evalue}\n  executed notebook with the error: {out_nb}") from None
        except KeyboardInterrupt as e:  # Ctrl-C, and SIGTERM (Interrupted)
            status[step] = {"state": "interrupted", "by": f"{type(e).__name__} {e}".strip(),
                            "seconds": round(time.time() - t0, 1)}
            for later in plan.steps[i:]:
                status[later] = {"state": "not run (interrupted before)"}
            _write_json(run_dir / "status.json", status)
            raise
        finally:
            os.environ.pop(STEP_DIR_ENV, None)
        metrics_file = step_dir / "metrics.json"
        step_metrics = json.loads(metrics_file.read_text()) if metrics_file.exists() else {}
        status[step] = {"state": "ok", "seconds": round(time.time() - t0, 1), "metrics": len(step_metrics)}
        _write_json(run_dir / "status.json", status)
        _write_json(run_dir / "metrics.json", merged_metrics(run_dir, status))
        print(f"[{i}/{len(plan.steps)}] {step}: ok in {time.time() - t0:.0f} s, {len(step_metrics)} metrics", flush=True)


def merged_metrics(run_dir: Path, status: dict) -> dict:
    """Every step's metrics that ended ok in this run folder (this invocation's and earlier ones'), in step order."""
    merged: dict = {}
    for step in sorted(status):  # step names sort in pipeline order (00_..., 01_...)
        f = run_dir / step / "metrics.json"
        if status[step].get("state") == "ok" and f.exists():
            merged.update(json.loads(f.read_text()))
    return merged


class CellClock(logging.Filter):
    """papermill's "Executing Cell N" and "Ending Cell N" lines with the wall clock (UTC): where a step's time went,
    and which cell a time limit cut (gpu-drafter-pipeline-7 and -8: 03 cut twice in a cell its log could not date)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if msg.startswith(("Executing Cell", "Ending Cell")):
            record.msg = f"{time.strftime('%H:%M:%S', time.gmtime(record.created))} {msg}"
        return True


def run(params_file, notebooks_dir=None, only=None, overrides=(), run_dir=None) -> Path:
    params_file = Path(params_file)
    if notebooks_dir is None:
        guess = params_file.resolve().parent.parent / "notebooks"
        notebooks_dir = guess if guess.is_dir() else Path("notebooks")
    notebooks_dir = Path(notebooks_dir).resolve()
    plan = plan_run(params_file, notebooks_dir, only=only, overrides=overrides)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    pm_log = logging.getLogger("papermill")
    pm_log.setLevel(logging.INFO)
    if not any(isinstance(f, CellClock) for f in pm_log.filters):
        pm_log.addFilter(CellClock())
    return execute(plan, notebooks_dir, run_dir=run_dir, cwd=notebooks_dir.parent)
