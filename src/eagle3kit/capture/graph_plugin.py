"""Capture with SGLang's prefill CUDA graph on: an SGLang plugin (entry point group ``sglang.srt.plugins``).

Why: ``--forward-hooks`` are registered after SGLang captures its CUDA graphs, and a replayed graph runs no Python
hooks, so the decoder-layer hooks of ``hook.py`` need the graphs off (``--disable-cuda-graph``). SGLang's defaults
prefill through a piecewise CUDA graph (``tc_piecewise``, of ``model.model`` only), and that graph is the whole gap
between capture and plain SGLang (DESIGN.md, "The gap to SGLang's defaults").

How: SGLang already makes its model hand per-token residual states to the logits processor for EAGLE-3 targets
(``capture_aux_hidden_states``; the model's ``layers_to_capture``: at the start of decoder layer i, when i is in it,
``hidden_states + residual`` is appended, i.e. eagle3kit's "input of layer i"). Switched on *before* the graphs are
captured, those states are part of the graph, and the logits processor, which runs eagerly after each replay, receives
them: ``logits_processor(input_ids, hidden_states, lm_head, forward_batch, aux_hidden_states)``. The capture's end
hook (``hook.CaptureSession.on_end``) takes them there, with the final norm's output as the last slot (the model
keeps no pre-norm final state: the data set records ``final_slot: post_norm``, and the trainer's teacher then skips
the norm). This plugin does the two things that cannot be done from ``--forward-hooks``:

* ``ModelRunner.init_cuda_graphs`` (BEFORE): switch the aux states on with eagle3kit's layers, in every scheduler
  process (every TP rank), before any graph is traced. Changing them later would re-trace during serving, which
  SGLang 0.5.14 refuses.
* ``ModelRunner.forward`` (BEFORE): remember the batch being run. Under a graph replay the logits processor sees the
  graph's static batch, whose ``rids`` are None (SGLang does not copy them); the remembered one has them.

It is inert unless ``EAGLE3KIT_PREFILL_GRAPH`` is set (SGLang loads every installed plugin in every process): the
capture server sets it (``server.server_command``). Failures are logged and kept in ``STATE``: SGLang only logs a
plugin's exceptions, so the end hook checks each forward's aux states and refuses the capture, with this reason, if
they are missing.
"""
from __future__ import annotations

import json
import logging
import os

log = logging.getLogger("eagle3kit.capture")
ENV = "EAGLE3KIT_PREFILL_GRAPH"
ENTRY_POINT = "eagle3kit"  # its name in group sglang.srt.plugins (pyproject.toml)
RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
STATE: dict = {"registered": False, "layers_to_capture": None, "error": None, "batch": None}


def env_value(aux_layer_ids) -> str:
    """The plugin's setting for a capture server's environment: the aux layers (input-of-layer ids)."""
    return json.dumps({"aux_layer_ids": [int(k) for k in aux_layer_ids]})


def register() -> None:
    """Called by SGLang's plugin loader in every process; registers nothing unless ``EAGLE3KIT_PREFILL_GRAPH`` is set."""
    spec = os.environ.get(ENV)
    if not spec or STATE["registered"]:
        return
    try:
        aux = [int(k) for k in json.loads(spec)["aux_layer_ids"]]
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(f"{RUNNER}.init_cuda_graphs", lambda runner, *a, **kw: before_graphs(runner, aux),
                              HookType.BEFORE)
        HookRegistry.register(f"{RUNNER}.forward", remember_batch, HookType.BEFORE)
        STATE["registered"] = True
    except Exception as e:  # noqa: BLE001 - SGLang would only log it; the end hook reports it per forward
        STATE["error"] = f"registering the prefill-graph plugin failed: {type(e).__name__}: {e}"
        log.exception("eagle3kit prefill-graph plugin")


def before_graphs(runner, aux: list[int]) -> None:
    """Switch SGLang's EAGLE-3 aux states on for ``aux`` (input-of-layer ids) before the graphs are captured."""
    if getattr(runner, "is_draft_worker", False):
        return None
    try:
        STATE["layers_to_capture"] = enable_aux_states(runner.model, aux)
        log.info("eagle3kit: SGLang's aux states on at layers %s, before the CUDA graphs", aux)
    except Exception as e:  # noqa: BLE001 - never raise into SGLang's start; the end hook refuses the capture
        STATE["error"] = f"switching the aux states on failed: {type(e).__name__}: {e}"
        log.exception("eagle3kit prefill-graph plugin")
    return None


def enable_aux_states(model, aux: list[int]) -> list[int]:
    """``model``: SGLang's model object. Its own switch (``set_eagle3_layers_to_capture``: sets
    ``capture_aux_hidden_states`` where that model reads it, through a wrapper such as Kimi-K2.5's), then the layer
    list set directly in input-of-layer ids, which is what the decoder loop compares (Llama's and DeepSeek's
    ``set_eagle3_layers_to_capture`` each rewrite ids by their own rule: the list is set past them)."""
    lm = getattr(model, "language_model", model)  # Kimi-K2.5: the DeepSeek-V3 model inside the wrapper
    inner = getattr(lm, "model", None)
    if not hasattr(model, "set_eagle3_layers_to_capture") or inner is None or not hasattr(inner, "layers_to_capture"):
        raise RuntimeError(f"{type(model).__name__} has no EAGLE-3 aux-state path (set_eagle3_layers_to_capture and "
                           f"model.layers_to_capture) to capture through; capture it with the graphs off (the default "
                           f"capture, without prefill_graph)")
    model.set_eagle3_layers_to_capture(None)
    inner.layers_to_capture = list(aux)
    if not getattr(lm, "capture_aux_hidden_states", False):
        raise RuntimeError(f"{type(lm).__name__}.capture_aux_hidden_states stayed off after set_eagle3_layers_to_capture")
    return list(inner.layers_to_capture)


def remember_batch(*args, **kwargs) -> None:
    """BEFORE hook of ``ModelRunner.forward(self, forward_batch, ...)``: the batch of the forward about to run."""
    runner = args[0] if args else None
    if runner is not None and getattr(runner, "is_draft_worker", False):
        return None
    STATE["batch"] = args[1] if len(args) > 1 else kwargs.get("forward_batch")
    return None


def missing_reason() -> str:
    """Why a forward reached the logits processor without eagle3kit's aux states."""
    if STATE["error"]:
        return STATE["error"]
    if not STATE["registered"]:
        return (f"the eagle3kit plugin was not loaded in this SGLang process: install eagle3kit into SGLang's Python "
                f"(pip install -e . registers its sglang.srt.plugins entry point '{ENTRY_POINT}'), and leave "
                f"SGLANG_PLUGINS unset or name '{ENTRY_POINT}' in it")
    if STATE["layers_to_capture"] is None:
        return "the plugin was loaded but ModelRunner.init_cuda_graphs never ran through it"
    return f"SGLang passed no aux states although layers {STATE['layers_to_capture']} were set"
