"""Warm kernels for ``eagle3kit run`` under the test suite (``EAGLE3KIT_WARM_KERNEL=1``).

A fresh ipykernel spends seconds importing torch, transformers, eagle3kit and speculators before a notebook's first
cell does anything, and seconds more tearing the interpreter down after its last; a pipeline run starts one kernel per
notebook. Here the run starts one fork server that imports those modules once (imports only: torch starts no
thread pool of its own before the fork), and the kernelspec's command is a small launcher that asks it for a kernel:

* ``serve SOCKET``: the server, started by the run in the kernels' working folder. It listens first, then imports
  ``PRELOAD``, then forks one ipykernel per request; the child takes the launcher's stdin/stdout/stderr (passed over
  the socket), working directory, environment, sys.path and arguments, starts a session of its own (so signals reach
  it and its subprocesses as a group, as they reach a kernel that jupyter_client started), runs
  ``ipykernel.kernelapp.launch_new_instance`` and exits through ``os._exit`` after the atexit handlers (no module
  teardown). The server reports each child's exit to its launcher,
  kills a child's group when its launcher goes away (jupyter_client killed it), and exits, killing what is left, when
  the stdin pipe from the run closes.
* ``launch SOCKET ARGS...``: the kernel process jupyter_client sees. It stays alive while its kernel runs, forwards
  the signals jupyter_client sends (interrupt, terminate) to the kernel's group, and exits with the kernel's status.
  Where there is no server, or the server was started with another environment or sys.path than the launcher has (a
  module imported in the server would have read them), it execs the ordinary ``ipykernel_launcher`` instead.

Each notebook still runs in a kernel of its own, from an interpreter state no other notebook touched.
"""
from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import sys
from pathlib import Path

ENV = "EAGLE3KIT_WARM_KERNEL"
STEP_DIR_ENV = "EAGLE3KIT_STEP_DIR"  # eagle3kit.metrics.STEP_DIR_ENV (the launcher imports nothing of eagle3kit)
# modules the notebooks import, or build drafters with, before their work starts, in their order (eagle3kit before
# transformers). Left to the kernel: ipykernel (its app reads JPY_PARENT_PID when imported) and matplotlib (it reads
# its backend when imported, and the kernel sets the inline one).
PRELOAD = ("torch", "eagle3kit", "transformers", "eagle3kit.target", "eagle3kit.pipeline",
           "eagle3kit.capture.reference", "eagle3kit.tp_check", "eagle3kit.spec", "eagle3kit.drafter.train",
           "eagle3kit.drafter.model", "eagle3kit.acceptance.offline", "speculators.models.eagle3",
           "speculators.utils.loading")
# set per kernel by the run (the step's folder) and by jupyter_client; read at call time, never at import
PER_KERNEL_ENV = (STEP_DIR_ENV, "JPY_PARENT_PID", "JPY_SESSION_NAME")
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def _kernel_sys_path() -> list[str]:
    """sys.path as ``python -m ipykernel_launcher`` leaves it: without the first entry (there the working folder that
    -m put first, here this file's folder)."""
    return list(sys.path[1:])


def _identity(env: dict) -> dict:
    return {k: v for k, v in env.items() if k not in PER_KERNEL_ENV}


def _send(sock: socket.socket, obj, fds=()) -> None:
    data = json.dumps(obj).encode()
    msg = struct.pack("!I", len(data)) + data
    if fds:
        socket.send_fds(sock, [msg], list(fds))
    else:
        sock.sendall(msg)


def _recv(sock: socket.socket, with_fds=0):
    """One message (and up to ``with_fds`` descriptors); None at EOF."""
    fds: list[int] = []
    if with_fds:
        head, fds, _, _ = socket.recv_fds(sock, 4, with_fds)
    else:
        head = sock.recv(4)
    while head and len(head) < 4:
        more = sock.recv(4 - len(head))
        if not more:
            return None, fds
        head += more
    if not head:
        return None, fds
    n, = struct.unpack("!I", head)
    data = b""
    while len(data) < n:
        more = sock.recv(n - len(data))
        if not more:
            return None, fds
        data += more
    return json.loads(data), fds


# ---------------------------------------------------------------------------------------------------- the server

def serve(sock_path: str) -> None:
    sys.path[:] = _kernel_sys_path()
    identity = {"env": _identity(dict(os.environ)), "sys_path": list(sys.path)}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(16)  # launchers may connect now; they wait while the modules load
    # imported as in a kernel of the run, whose step folder is set: `import eagle3kit` then turns the progress bars of
    # transformers and huggingface_hub off (eagle3kit.metrics.quiet_batch_run) before either is imported
    before = dict(os.environ)
    os.environ.setdefault(STEP_DIR_ENV, os.devnull)
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    if STEP_DIR_ENV not in before:
        os.environ.pop(STEP_DIR_ENV, None)
    # what the imports did to the environment, done again in each kernel over its launcher's environment
    identity["env_changes"] = {k: os.environ.get(k) for k in before.keys() | os.environ.keys()
                               if before.get(k) != os.environ.get(k)}
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(sys.stdin, selectors.EVENT_READ, "stdin")  # the run's pipe: EOF when the run ends or dies
    children: dict[int, socket.socket] = {}  # pid -> its launcher's connection
    try:
        while True:
            for key, _ in sel.select(timeout=0.1):
                if key.data == "stdin":
                    if not os.read(sys.stdin.fileno(), 4096):
                        return
                elif key.data == "accept":
                    conn, _ = listener.accept()
                    pid = _start_kernel(conn, [listener, *children.values()], identity)
                    if pid is None:
                        conn.close()
                    else:
                        children[pid] = conn
                        sel.register(conn, selectors.EVENT_READ, pid)
                else:  # a launcher's connection readable: it sends nothing more, so this is EOF (it is gone)
                    pid = key.data
                    if not key.fileobj.recv(1):
                        sel.unregister(key.fileobj)
                        _kill_group(pid)
            while children:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                conn = children.pop(pid, None)
                if conn is not None:
                    try:
                        sel.unregister(conn)
                    except (KeyError, ValueError):
                        pass
                    try:
                        _send(conn, {"status": status})
                    except OSError:
                        pass
                    conn.close()
    finally:
        for pid in children:
            _kill_group(pid)


def _kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
            return
        except OSError:
            pass


def _start_kernel(conn: socket.socket, others: list, identity: dict) -> int | None:
    """Fork a kernel for the request on ``conn``; its pid, or None (refused: the launcher starts a plain kernel)."""
    try:
        req, fds = _recv(conn, with_fds=3)
    except OSError:
        return None
    if req is None or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        return None
    env = _identity(req["env"])
    differ = sorted(k for k in env.keys() | identity["env"].keys() if env.get(k) != identity["env"].get(k))
    if differ or req["sys_path"] != identity["sys_path"]:
        for fd in fds:
            os.close(fd)
        try:
            _send(conn, {"refused": f"environment ({', '.join(differ) or 'same'}) or sys.path "
                                    f"({'differs' if req['sys_path'] != identity['sys_path'] else 'same'}) differs "
                                    f"from the warm server's"})
        except OSError:
            pass
        return None
    pid = os.fork()
    if pid == 0:  # the kernel
        code = 1
        try:
            for other in (*others, conn):  # the listener and the other launchers' connections stay the server's
                other.close()
            os.setsid()
            for i, fd in enumerate(fds):
                os.dup2(fd, i)
                os.close(fd)
            for sig in FORWARDED + (signal.SIGCHLD,):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            os.chdir(req["cwd"])
            os.environ.clear()
            os.environ.update(req["env"])
            for k, v in identity["env_changes"].items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            sys.path[:] = req["sys_path"]
            sys.argv[:] = req["argv"]
            code = _run_kernel()
        finally:
            os._exit(code)
    for fd in fds:
        os.close(fd)
    try:
        _send(conn, {"pid": pid})
    except OSError:
        _kill_group(pid)
    return pid


def _run_kernel() -> int:
    import atexit

    from ipykernel import kernelapp
    code = 0
    try:
        kernelapp.launch_new_instance()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except Exception:
            pass
    return code


# -------------------------------------------------------------------------------------------------- the launcher

def launch(sock_path: str, args: list[str]) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(sock_path)
        _send(sock, {"argv": [sys.argv[0], *args], "env": dict(os.environ), "cwd": os.getcwd(),
                     "sys_path": _kernel_sys_path()}, fds=(0, 1, 2))
        reply, _ = _recv(sock)
    except OSError:
        reply = None
    if not reply or "pid" not in reply:
        sock.close()
        if reply and "refused" in reply:
            print(f"warm kernel: {reply['refused']}; starting a plain kernel", file=sys.stderr, flush=True)
        _plain_kernel(args)
    pid = reply["pid"]

    def forward(signum, frame):
        try:
            os.killpg(pid, signum)
        except OSError:
            pass
    for sig in FORWARDED:
        signal.signal(sig, forward)
    try:
        done, _ = _recv(sock)
    except OSError:
        done = None
    status = done["status"] if done else None
    if status is None:
        os._exit(1)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if not os.WIFSIGNALED(status) else 1)


def _plain_kernel(args: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, "-m", "ipykernel_launcher", *args])


# Both run as a script, not with -m: importing the eagle3kit package first would change the environment (its
# quiet_batch_run) that the server compares and the launcher sends.
def server_argv(sock_path: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "serve", sock_path]


def kernel_argv(sock_path: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "launch", sock_path, "-f", "{connection_file}"]


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2])
    elif sys.argv[1:2] == ["launch"]:
        launch(sys.argv[2], sys.argv[3:])
    else:
        sys.exit("usage: python warm_kernel.py serve SOCKET | launch SOCKET [ipykernel args]")
