"""benchmarks/pyspy.py: the summary of py-spy's raw stacks (pure logic) and finding a process among descendants."""
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import pyspy  # noqa: E402

RAW = """thread (11): MainThread;run (scheduler.py:10);forward (model.py:5);hook (hook.py:200);_copy (hook.py:150) 30
thread (11): MainThread;run (scheduler.py:10);forward (model.py:5) 60
thread (11): MainThread;run (scheduler.py:10);recv (zmq.py:3) 10
thread (12): e3k-dispatch;_dispatch (writer_process.py:190);synchronize (cuda.py:1) 50
garbage line
"""


def test_summary_shares_per_thread_and_focus():
    text = pyspy.summarize(RAW, focus="hook.py")
    assert "samples 150" in text
    main = text.split("== MainThread")[1].split("==")[0]
    assert "100 samples; inside 'hook.py' frames: 30.0%" in main
    assert "60.0%  forward (model.py:5)" in main
    assert "in hook.py:  30.0%  _copy (hook.py:150)" in main  # the innermost frame of ours
    assert "inside 'hook.py' frames: 0.0%" in text.split("== e3k-dispatch")[1]


def test_find_locates_a_descendant_by_command_line():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "marker-xyz"])
    try:
        import os
        assert pyspy.find(os.getpid(), "marker-xyz") == child.pid
        assert pyspy.find(os.getpid(), "no-such-process-name") is None
    finally:
        child.kill()
        child.wait()
