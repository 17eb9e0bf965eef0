"""Start and stop a capture-enabled SGLang server (the GPU side).

eagle3kit adds only what capture needs: the ``--forward-hooks`` JSON, CUDA graphs off (hooks do not fire inside a
captured graph, and the default piecewise prefill graph compiles the decoder layers; with ``prefill_graph`` they stay
on and ``graph_plugin`` captures through SGLang's aux-state path), 127.0.0.1, and for DeepSeek-
style models the FlashInfer all-reduce fusion off (it leaves per-rank partial sums in the layer outputs under TP).
Every other SGLang flag (TP, DP, multi-node, quantization, attention backend ...) passes through untouched.
"""
from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from eagle3kit.capture.hook import capture_config, dumps, forward_hooks
from eagle3kit.layers import DEEPSEEK_TYPES
from eagle3kit.target import TargetInfo


class ServerError(RuntimeError):
    pass


def _has(args: list[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in args for f in flags)


def server_command(model_path, port: int = 30000, host: str = "127.0.0.1", capture: dict | None = None,
                   extra_args=(), layer_module: str = "model.layers.{}", python: str = sys.executable,
                   hooks: list[dict] | None = None) -> list[str]:
    """``hooks``: more ``--forward-hooks`` specs beside the capture's (e.g. ``acceptance.drafthook``)."""
    extra = list(extra_args)
    for flag in ("--model-path", "--port", "--host", "--forward-hooks"):
        if _has(extra, flag):
            raise ServerError(f"extra_args sets {flag}: eagle3kit sets it; pass it through the matching parameter")
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(model_path), "--host", host, "--port", str(port)]
    specs = (forward_hooks(capture, layer_module) if capture is not None else []) + list(hooks or [])
    if specs:
        cmd += ["--forward-hooks", dumps(specs)]
    if capture is not None:
        graph_flags = ("--disable-cuda-graph", "--cuda-graph-backend-prefill", "--disable-piecewise-cuda-graph")
        if not capture.get("prefill_graph") and not _has(extra, *graph_flags):
            cmd += ["--disable-cuda-graph"]
        info = TargetInfo.read(Path(model_path))
        if info.model_type in DEEPSEEK_TYPES and not _has(extra, "--enforce-disable-flashinfer-allreduce-fusion"):
            cmd += ["--enforce-disable-flashinfer-allreduce-fusion"]
    return cmd + extra


class SGLangServer:
    """``with SGLangServer(model, capture=capture_config(...)) as s: ...`` starts, waits for health, stops."""

    def __init__(self, model_path, port: int = 30000, host: str = "127.0.0.1", capture: dict | None = None,
                 extra_args=(), log_path=None, layer_module: str = "model.layers.{}", env: dict | None = None,
                 startup_timeout: float = 600, hooks: list[dict] | None = None):
        self.cmd = server_command(model_path, port, host, capture, extra_args, layer_module, hooks=hooks)
        self.url = f"http://{host}:{port}"
        self.capture = capture
        self.log_path = Path(log_path or f"sglang-{port}.log")
        self.env = {**os.environ, **(env or {})}
        if capture is not None and capture.get("prefill_graph"):
            from eagle3kit.capture import graph_plugin

            problem = plugin_problem(self.env)
            if problem:
                raise ServerError(f"capture with prefill_graph needs eagle3kit's SGLang plugin: {problem}")
            self.env[graph_plugin.ENV] = graph_plugin.env_value(capture["aux_layer_ids"])
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None

    def start(self) -> "SGLangServer":
        host, port = self.url.rsplit("//", 1)[1].rsplit(":", 1)
        if answers(host, int(port)):  # its /health would pass for this server's while this one is still importing
            raise ServerError(f"{host}:{port} already answers: another process holds the port (a server a cut run "
                              f"left running?), and it, not the server started here, would be measured. Fix: stop it "
                              f"(ps -ef | grep 'port {port}'), or choose another port")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.capture is not None:
            Path(self.capture["capture_dir"]).mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self._log.write("# " + shlex.join(self.cmd) + "\n")
        self._log.flush()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        self.started = time.time()
        return self

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def wait_healthy(self, timeout: float | None = None) -> float:
        deadline = time.time() + (timeout or self.startup_timeout)
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"SGLang exited with code {self.proc.returncode} while starting; log "
                                  f"{self.log_path}:\n{self.log_tail()}")
            if healthy(self.url):
                return time.time() - self.started
            time.sleep(1)
        self.stop()
        raise ServerError(f"SGLang not healthy after {timeout or self.startup_timeout:.0f} s; log {self.log_path}:\n"
                          f"{self.log_tail()}")

    def stop(self, grace: float = 20) -> None:
        stop_all([self], grace)

    def __enter__(self):
        self.start()
        self.wait_healthy()
        ranks = self.capture.get("ranks", "0") if self.capture is not None else None
        if ranks in ("0", "all") or (isinstance(ranks, list) and 0 in ranks):  # rank 0 writes: probe it
            try:
                probe_capture(self.url, self.capture["capture_dir"])
            except BaseException:
                self.stop()
                raise
        return self

    def __exit__(self, *exc):
        self.stop()


def answers(host: str, port: int) -> bool:
    """Whether something listens on host:port."""
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def healthy(url: str, timeout: float = 5.0) -> bool:
    """Whether the SGLang server at ``url`` answers its /health with 200 within ``timeout`` seconds."""
    import requests

    try:
        return requests.get(url.rstrip("/") + "/health", timeout=timeout).status_code == 200
    except requests.RequestException:
        return False


def plugin_problem(env: dict | None = None) -> str | None:
    """Why SGLang, started from this Python with ``env``, would not load eagle3kit's plugin (``graph_plugin``); None
    when it would."""
    from importlib.metadata import entry_points

    from eagle3kit.capture import graph_plugin

    if not any(ep.name == graph_plugin.ENTRY_POINT for ep in entry_points(group="sglang.srt.plugins")):
        return (f"no entry point '{graph_plugin.ENTRY_POINT}' in group sglang.srt.plugins. Fix: install eagle3kit into "
                f"this Python (pip install -e . from the repository; pyproject.toml declares it)")
    allowed = [a.strip() for a in (env or os.environ).get("SGLANG_PLUGINS", "").split(",") if a.strip()]
    if allowed and graph_plugin.ENTRY_POINT not in allowed:
        return f"SGLANG_PLUGINS={','.join(allowed)} leaves it out. Fix: add '{graph_plugin.ENTRY_POINT}' to it, or unset it"
    return None


WRAPPED_LAYERS = {  # architectures whose language model SGLang builds under another attribute (SGLang 0.5.14)
    "KimiK25ForConditionalGeneration": "language_model.model.layers.{}",  # models/kimi_k25.py: language_model
}


def decoder_layer_template(model_path) -> str:
    """The module name of decoder layer i in the model SGLang builds for ``model_path`` (its config's architecture)."""
    import json

    arch = (json.loads((Path(model_path) / "config.json").read_text()).get("architectures") or [""])[0]
    return WRAPPED_LAYERS.get(arch, "model.layers.{}")


PROBE_KEY = "e3k_probe"


def probe_capture(url: str, capture_dir, timeout: float = 120) -> None:
    """One 8-token capture right after start: a server whose hooks fire on no decoder layer (module names other than
    the template) is refused here, with the fix, before any request of the user's waits on it."""
    from eagle3kit.capture.client import CaptureClient

    client = CaptureClient(url, capture_dir, timeout=timeout)
    try:
        m = client.capture(PROBE_KEY, [1, 2, 3, 4, 5, 6, 7, 8])
    except Exception as e:  # noqa: BLE001 - no marker, an HTTP error: the same refusal
        m = {"status": "error", "reason": f"{type(e).__name__}: {e}"}
    finally:
        time.sleep(0.5)  # other ranks' files of the probe, written just after rank 0's
        for f in Path(capture_dir).glob(f"{PROBE_KEY}.rank*"):
            f.unlink(missing_ok=True)
    if m.get("status") != "ok":
        try:  # what the writers said (a capture refused at setup, e.g. under DP attention, says why there)
            said = "; ".join(f"{w}: {s['last_error']}" for w, s in client.status().items() if s.get("last_error"))
        except Exception:  # noqa: BLE001 - no status to add
            said = ""
        raise ServerError(f"the capture server at {url} did not capture a probe request ({m.get('reason', m)})"
                          + (f"; the capture writers report: {said[:600]}" if said else "") + ". "
                          "If its decoder layers are not named like the hooks' template, pass layer_module= "
                          "(see capture.server.WRAPPED_LAYERS); the server log says which modules exist")


def capture_server(model_path, capture_dir, aux_layer_ids, port=30000, final_normed=False, ranks="0",
                   storage="bf16", extra_args=(), log_path=None, fail_keys_once=(), prefill_graph=False,
                   capture_settings: dict | None = None, **kw) -> SGLangServer:
    """``fail_keys_once``: fault injection for the fault tests (``hook.capture_config``). ``prefill_graph``: keep
    SGLang's prefill CUDA graph on and capture through its aux-state path (``graph_plugin``; the last slot is then
    the final norm's output). ``capture_settings``: more ``capture_config`` arguments (``io_threads``, ``checksum``)."""
    info = TargetInfo.read(Path(model_path))
    cfg = capture_config(capture_dir, aux_layer_ids, info.num_layers, final_normed=final_normed, ranks=ranks,
                         storage=storage, model=str(model_path), fail_keys_once=fail_keys_once,
                         prefill_graph=prefill_graph, **(capture_settings or {}))
    kw.setdefault("layer_module", decoder_layer_template(model_path))
    return SGLangServer(model_path, port=port, capture=cfg, extra_args=extra_args, log_path=log_path, **kw)


def running_capture_config(url: str, timeout: float = 10.0) -> dict | None:
    """The capture config a running server's hooks were started with, read from SGLang's ``/server_info``
    (its ``forward_hooks`` argument); None when that SGLang does not report it. Raises ``ServerError`` naming the
    URL and the fix when nothing answers there or the server has no eagle3kit hooks."""
    import json

    import requests

    try:
        r = requests.get(url.rstrip("/") + "/server_info", timeout=timeout)
        r.raise_for_status()
        info = r.json()
    except (requests.RequestException, ValueError) as e:
        raise ServerError(f"capture server {url} does not answer /server_info ({type(e).__name__}: {e}). Fix: start "
                          f"it (eagle3kit.capture.server.capture_server, or SGLang with eagle3kit's --forward-hooks) "
                          f"or correct the URL (--urls)") from None
    if "forward_hooks" not in info:
        return None
    hooks = info["forward_hooks"] or []
    if isinstance(hooks, str):
        hooks = json.loads(hooks)
    for h in hooks:
        if isinstance(h, dict) and h.get("name") == "eagle3kit_end":
            return h.get("config") or {}
    raise ServerError(f"{url} is an SGLang server without eagle3kit's capture hooks (--forward-hooks), so nothing "
                      f"would be written. Fix: start it with eagle3kit.capture.server.capture_server(...)")


def check_capture_server(url: str, expect: dict, timeout: float = 10.0) -> None:
    """Refuse a server whose hooks would write elsewhere or something else than this extraction expects: every
    request would otherwise wait for a capture that never comes. ``expect``: capture_dir, aux_layer_ids,
    num_layers, final_normed, storage (any subset)."""
    cfg = running_capture_config(url, timeout)
    if cfg is None:  # an SGLang that does not report its arguments: nothing to compare
        return
    problems = []
    if "capture_dir" in expect:
        theirs, ours = Path(cfg.get("capture_dir", "")), Path(expect["capture_dir"])
        same = (theirs.exists() and ours.exists() and os.path.samefile(theirs, ours)) or theirs.resolve() == ours.resolve()
        if not same:
            problems.append(f"it writes captures to {theirs}, this extraction reads {ours}")
    for k in ("aux_layer_ids", "num_layers", "final_normed", "storage", "prefill_graph"):
        if k in expect and cfg.get(k, False if k == "prefill_graph" else None) != expect[k]:
            problems.append(f"its {k} is {cfg.get(k)!r}, this extraction asks for {expect[k]!r}")
    if problems:
        raise ServerError(f"capture server {url} does not match this extraction: {'; '.join(problems)}. Fix: start "
                          f"the server with the extraction's settings (capture_dir=<out>/samples, the same layers, "
                          f"storage and final_normed), or change the extraction's to the server's")


def stop_all(servers, grace: float = 20) -> None:
    """Stop servers at once: SIGTERM to every process group, then one shared ``grace`` for all of them, then SIGKILL
    to what is left. Stopped one after another, ten servers that each outlived their 20 s of grace took the rest of
    a benchmark's time limit after its last round (gpu-breakeven-1: exit 124 in the stops, its figures complete).
    A group whose launcher already exited (crashed, or a server that failed to start) is stopped too: its scheduler
    processes would otherwise keep the GPU's memory."""
    servers = list(servers)
    for s in servers:
        if not isinstance(s, SGLangServer):  # anything else with a stop() of its own
            s.stop()
    started = [s for s in servers if isinstance(s, SGLangServer) and s.proc is not None]
    for s in started:
        s.proc.poll()  # a launcher that exited is reaped: its group is then only the children it left
        _signal_group(s.proc.pid, signal.SIGTERM)
    deadline = time.time() + grace
    for s in started:
        while time.time() < deadline and _group_alive(s.proc.pid):
            if s.proc.poll() is not None:  # the launcher gone, its children not yet
                time.sleep(0.05)
                continue
            try:
                s.proc.wait(min(0.1, max(0.0, deadline - time.time())))
            except subprocess.TimeoutExpired:
                pass
    for s in started:
        if _group_alive(s.proc.pid):
            _signal_group(s.proc.pid, signal.SIGKILL)
        try:
            s.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
    for s in servers:
        if isinstance(s, SGLangServer) and getattr(s, "_log", None) is not None:
            s._log.close()


def _signal_group(pgid: int, sig) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group ``pgid`` (a server's, started in a session of its own) is still there."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

