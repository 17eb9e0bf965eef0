"""Sampling profiles of running processes with py-spy, for the benchmarks: where a server's threads spend a pass.

``Spy(pid, path, seconds).start()`` records py-spy's raw (collapsed) stacks of every thread, idle ones included,
without pausing the process (``--nonblocking``); ``summarize(path)`` turns them into a short text: per thread the
share of samples, the functions with the most samples of their own, and the share inside frames that match
``focus`` (eagle3kit's hooks, say), by the innermost such frame. py-spy absent, or not allowed to attach, the
error is written beside the profile and the benchmark goes on.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter, defaultdict
from pathlib import Path

_LINE = re.compile(r"^(?P<stack>.*) (?P<n>\d+)$")


def children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc)."""
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                parent[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def find(root: int, pattern: str) -> int | None:
    """The first descendant of ``root`` whose command line matches ``pattern`` (SGLang titles its scheduler
    ``sglang::scheduler``)."""
    for p in children(root):
        if re.search(pattern, cmdline(p)):
            return p
    return None


class Spy:
    def __init__(self, pid: int | None, path, seconds: float, rate: int = 200):
        self.pid, self.path, self.seconds, self.rate = pid, Path(path), seconds, rate
        self.proc = None

    def start(self) -> "Spy":
        exe = shutil.which("py-spy")
        err = self.path.with_suffix(".err")
        if exe is None or self.pid is None:
            err.write_text("py-spy not installed" if exe is None else "process not found")
            return self
        self._err = open(err, "w")
        self.proc = subprocess.Popen([exe, "record", "--pid", str(self.pid), "--duration", str(int(self.seconds)),
                                      "--rate", str(self.rate), "--format", "raw", "--threads", "--idle",
                                      "--nonblocking", "-o", str(self.path)],
                                     stdout=self._err, stderr=subprocess.STDOUT)
        return self

    def stop(self, focus: str = "eagle3kit") -> str:
        """Wait for the recording; write and return its summary ('' when there is none)."""
        if self.proc is None:
            return ""
        try:
            self.proc.wait(self.seconds + 60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._err.close()
        if not self.path.exists():
            return ""
        text = summarize(self.path.read_text(), focus)
        self.path.with_suffix(".summary.txt").write_text(text)
        return text


def summarize(raw: str, focus: str = "eagle3kit", top: int = 12) -> str:
    """Text summary of py-spy's raw output (``thread (tid): name;frame;...;frame count`` per line)."""
    per_thread: Counter = Counter()
    own: dict[str, Counter] = defaultdict(Counter)
    focused: Counter = Counter()
    focus_own: dict[str, Counter] = defaultdict(Counter)
    for line in raw.splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue
        frames = m["stack"].split(";")
        n = int(m["n"])
        thread = frames[0].split(": ", 1)[-1] if frames[0].startswith("thread") else frames[0]
        per_thread[thread] += n
        own[thread][frames[-1]] += n
        hit = next((f for f in reversed(frames[1:]) if focus in f), None)  # the innermost: which line of ours
        if hit is not None:
            focused[thread] += n
            focus_own[thread][hit] += n
    total = sum(per_thread.values())
    out = [f"samples {total}"]
    for thread, n in per_thread.most_common():
        out.append(f"\n== {thread}: {n} samples; inside '{focus}' frames: {focused[thread] / n:.1%}")
        for f, k in own[thread].most_common(top):
            out.append(f"  {k / n:6.1%}  {f}")
        for f, k in focus_own[thread].most_common(5):
            out.append(f"  in {focus}: {k / n:6.1%}  {f}")
    return "\n".join(out) + "\n"


if __name__ == "__main__":  # python benchmarks/pyspy.py RAW [FOCUS]: summarize a recorded profile
    import sys

    print(summarize(Path(sys.argv[1]).read_text(), *(sys.argv[2:3] or ["eagle3kit"])))
