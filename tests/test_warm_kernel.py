"""The warm kernels of the test suite's pipeline runs (eagle3kit.warm_kernel): each notebook still runs in a kernel
of its own, with the step's environment and folder, and fails as in a plain kernel; nothing is left running after."""
import json
import os
import subprocess
import sys

from eagle3kit.warm_kernel import ENV as WARM_KERNEL
from tests.test_runner import notebook, write_params

PROBE = """import os, sys
preloaded = "torch" in sys.modules  # before this cell imports anything
import eagle3kit
from transformers.utils import logging as hf_logging
seen = dict(preloaded=preloaded, pid=os.getpid(), step_dir=os.environ["EAGLE3KIT_STEP_DIR"], cwd=os.getcwd(),
            bars=hf_logging.is_progress_bar_enabled(), hub_bars=os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", ""), n=n)
eagle3kit.record(**{name + "_" + k: v for k, v in seen.items()})"""


def test_warm_kernels_run_each_notebook_in_a_fresh_kernel_of_its_step(tmp_path):
    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    (tmp_path / "params").mkdir()
    for name, n in (("a_probe", 1), ("b_probe", 2)):
        notebook(nbs / f"{name}.ipynb", f"n = {n}\nname = {name!r}", PROBE)
    notebook(nbs / "c_fail.ipynb", "limit = 1.5", "x = 1\nraise ValueError(f'boom at limit {limit}')")
    p = write_params(tmp_path, "experiment: w\nsteps: [a_probe, b_probe, c_fail]\n")
    r = subprocess.run([sys.executable, "-m", "eagle3kit.cli", "run", str(p), "--run-dir", str(tmp_path / "o")],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300, env={**os.environ, WARM_KERNEL: "1"})
    assert r.returncode == 1 and "warm kernel:" not in r.stderr, r.stderr[-3000:]
    assert "step c_fail failed in cell 2" in r.stderr and "ValueError: boom at limit 1.5" in r.stderr
    m = json.loads((tmp_path / "o" / "metrics.json").read_text())
    for step, n in (("a_probe", 1), ("b_probe", 2)):
        assert m[f"{step}_preloaded"] is True and m[f"{step}_n"] == n  # forked from the server, its own parameters
        assert m[f"{step}_step_dir"] == str(tmp_path / "o" / step) and m[f"{step}_cwd"] == str(tmp_path)
        # the progress bars off, as `import eagle3kit` turns them off in a plain kernel of a run
        assert m[f"{step}_bars"] is False and m[f"{step}_hub_bars"] == "1"
    assert m["a_probe_pid"] != m["b_probe_pid"]
    status = json.loads((tmp_path / "o" / "status.json").read_text())
    assert status["a_probe"]["state"] == status["b_probe"]["state"] == "ok" and status["c_fail"]["state"] == "failed"
    for pid in (m["a_probe_pid"], m["b_probe_pid"]):  # the kernels are gone (and reaped: no zombie answers kill 0)
        try:
            os.kill(pid, 0)
            alive = True
        except ProcessLookupError:
            alive = False
        assert not alive, pid


def test_a_launcher_whose_environment_differs_is_refused_and_gets_a_plain_kernel():
    """A module the server imported read its environment and sys.path: a launcher that brings others is refused
    (it then starts a plain ipykernel), its descriptors closed; nothing is forked for it."""
    import socket

    from eagle3kit import warm_kernel as wk

    identity = {"env": {"A": "1"}, "sys_path": ["/x"], "env_changes": {}}
    for env, path, what in (({"A": "2"}, ["/x"], "environment (A)"), ({"A": "1"}, ["/y"], "sys.path (differs)")):
        server, launcher = socket.socketpair()
        r, w = os.pipe()
        wk._send(launcher, {"argv": ["k"], "env": env, "cwd": "/", "sys_path": path}, fds=(r, w, w))
        assert wk._start_kernel(server, [], identity) is None
        reply, _ = wk._recv(launcher)
        assert what in reply["refused"]
        os.close(r), os.close(w)
        server.close(), launcher.close()
    server, launcher = socket.socketpair()
    launcher.close()  # a launcher gone before its request: refused, nothing forked
    assert wk._start_kernel(server, [], identity) is None

