"""Capture with SGLang's prefill CUDA graph on (``capture.graph_plugin``), its pure logic on the CPU: the end hook
fed what SGLang's logits processor gets after a graph replay (the graph's static batch without rids, rows padded to
the graph's bucket, the aux states and the final norm's output), with real reference states. What SGLang itself
does with the plugin is checked on the GPU (tests/test_gpu.py::test_prefill_graph_capture_matches_reference)."""
import json
import tomllib
from enum import Enum
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eagle3kit.capture import graph_plugin
from eagle3kit.capture.format import read_sample
from eagle3kit.capture.hook import CaptureSession, capture_config, forward_hooks
from eagle3kit.capture.rid import make_rid

ROOT = Path(__file__).resolve().parents[1]


class Mode(Enum):  # stands in for sglang's ForwardMode inside these unit tests
    EXTEND = 1
    DECODE = 2


def batch(rids, lens, ids, mode=Mode.EXTEND):
    return SimpleNamespace(forward_mode=mode, rids=rids, extend_seq_lens_cpu=lens, extend_prefix_lens_cpu=[0] * len(lens),
                           input_ids=ids)


@pytest.fixture
def states(reference, tokenizer):
    """Two prompts' reference states: input_of_layer 0..L (L: before the norm) and the final norm's output."""
    L = reference.info.num_layers
    out = {}
    for k, text in {"a": "The target verifies drafted tokens in one pass.",
                    "b": "A graph replay pads the batch to its bucket; the hook keeps only the real rows."}.items():
        ids = tokenizer(text).input_ids
        with torch.no_grad():
            o = reference.model(torch.tensor([ids]), output_hidden_states=True)
        out[k] = {"ids": ids, "layers": [h[0] for h in o.hidden_states[:L]], "post": o.hidden_states[L][0]}
    return out


@pytest.fixture(autouse=True)
def clean_state():
    graph_plugin.STATE.update(registered=True, layers_to_capture=[2, 15, 27], error=None, batch=None)
    yield
    graph_plugin.STATE.update(registered=False, layers_to_capture=None, error=None, batch=None)


def replay(session, real, aux_layers, st, bucket: int):
    """What the logits processor gets after a graph replay: static batch (rids None), rows padded to ``bucket``."""
    keys = ("a", "b")
    n = sum(len(st[k]["ids"]) for k in keys)

    def pad(x):
        return torch.cat([x, torch.full((bucket - n, *x.shape[1:]), 7, dtype=x.dtype)])
    ids = pad(torch.tensor(st["a"]["ids"] + st["b"]["ids"]))
    aux = [pad(torch.cat([st[k]["layers"][layer] for k in keys])) for layer in aux_layers]
    post = pad(torch.cat([st[k]["post"] for k in keys]))
    static = batch(None, real.extend_seq_lens_cpu, ids)
    graph_plugin.remember_batch(SimpleNamespace(is_draft_worker=False), real)
    session.on_end((ids, post, None, static, aux))


def test_the_end_hook_writes_aux_states_and_the_normed_final_state_of_the_real_rows(tmp_path, reference, states):
    L = reference.info.num_layers
    cfg = capture_config(tmp_path, [2, 15, 27], L, prefill_graph=True)
    assert [h["name"] for h in forward_hooks(cfg)] == ["eagle3kit_end"]  # no decoder-layer hooks under the graph
    session = CaptureSession(cfg, extend_mode=Mode.EXTEND)
    rids = [make_rid(k, len(states[k]["ids"])) for k in ("a", "b")]
    real = batch(rids, [len(states[k]["ids"]) for k in ("a", "b")], None)
    replay(session, real, [2, 15, 27], states, bucket=64)
    st = session.writer.flush()
    assert st["counts"]["written"] == 2 and st["counts"].get("errors", 0) == 0, st
    for k in ("a", "b"):
        t, meta = read_sample(tmp_path / f"{k}.rank0.safetensors")
        assert meta["final_slot"] == "post_norm" and meta["layer_ids"] == [2, 15, 27, L]
        assert t["token_ids"].tolist() == states[k]["ids"]  # the padding's rows are not in the file
        want = torch.stack([states[k]["layers"][j] for j in (2, 15, 27)] + [states[k]["post"]], 1).to(torch.bfloat16)
        assert torch.equal(t["hidden_states"], want), k


def test_without_the_plugins_states_or_batch_nothing_is_written_and_the_reason_is_said(tmp_path, reference, states):
    from eagle3kit.capture.hook import _guarded

    cfg = capture_config(tmp_path, [2, 15, 27], reference.info.num_layers, prefill_graph=True)
    session = CaptureSession(cfg, extend_mode=Mode.EXTEND)
    rids = [make_rid(k, len(states[k]["ids"])) for k in ("a", "b")]
    real = batch(rids, [len(states[k]["ids"]) for k in ("a", "b")], None)
    ids = torch.tensor(states["a"]["ids"] + states["b"]["ids"])
    post, aux = torch.zeros(len(ids), 576), [torch.zeros(len(ids), 576)] * 3
    static = batch(None, real.extend_seq_lens_cpu, ids)

    def end(*args):
        _guarded(session, "end", session.on_end, args)
        return session.writer.last_error

    graph_plugin.STATE.update(registered=False)  # SGLang did not load the plugin: no aux states reach the hook
    graph_plugin.remember_batch(None, real)
    assert "0 aux states" in end(ids, post, None, static) and "pip install -e ." in session.writer.last_error
    markers = [json.loads(p.read_text()) for p in tmp_path.glob("[ab].rank0.json")]  # its requests fail now
    assert len(markers) == 2 and all(m["status"] == "error" and "pip install" in m["reason"] for m in markers)
    graph_plugin.STATE.update(registered=True)
    # a remembered batch that is not the replayed one (other lengths): refused, not split at the wrong offsets
    graph_plugin.remember_batch(None, batch(rids, [3, len(ids) - 3], None))
    assert "not the one the logits processor sees" in end(ids, post, None, static, aux)
    graph_plugin.STATE.update(batch=None)  # ModelRunner.forward never went through the plugin
    assert "no batch remembered from ModelRunner.forward" in end(ids, post, None, static, aux)
    st = session.writer.flush()
    assert st["counts"]["errors"] == 3 and st["counts"].get("written", 0) == 0
    assert not list(tmp_path.glob("*.safetensors"))


def test_the_plugin_remembers_the_batch_however_it_is_passed_and_not_a_drafts():
    target, draft = SimpleNamespace(is_draft_worker=False), SimpleNamespace(is_draft_worker=True)
    a, b = object(), object()
    graph_plugin.remember_batch(target, a)
    graph_plugin.remember_batch(draft, b)  # a draft worker's forward is not the target's batch
    assert graph_plugin.STATE["batch"] is a
    graph_plugin.remember_batch(target, forward_batch=b)
    assert graph_plugin.STATE["batch"] is b


def test_plugin_switches_the_aux_states_on_at_eagle3kits_layers_for_llama_and_a_wrapper():
    class Llama:  # SGLang 0.5.14's LlamaForCausalLM.set_eagle3_layers_to_capture (its +1 rule)
        def __init__(self):
            self.model, self.capture_aux_hidden_states = SimpleNamespace(layers_to_capture=[]), False

        def set_eagle3_layers_to_capture(self, ids=None):
            self.capture_aux_hidden_states = True
            self.model.layers_to_capture = [2, 15, 27] if ids is None else [v + 1 for v in ids]

    assert graph_plugin.enable_aux_states(Llama(), [3, 16, 29]) == [3, 16, 29]  # input-of-layer ids, past the rule
    inner = Llama()
    wrapper = SimpleNamespace(language_model=inner, set_eagle3_layers_to_capture=inner.set_eagle3_layers_to_capture)
    assert graph_plugin.enable_aux_states(wrapper, [1, 4, 5]) == [1, 4, 5] and inner.capture_aux_hidden_states
    with pytest.raises(RuntimeError, match="no EAGLE-3 aux-state path"):
        graph_plugin.enable_aux_states(SimpleNamespace(model=SimpleNamespace()), [2])
    graph_plugin.STATE.update(registered=False)
    assert "pip install -e ." in graph_plugin.missing_reason()


def test_the_plugin_is_inert_without_its_setting_and_declared_where_sglang_looks(monkeypatch):
    monkeypatch.delenv(graph_plugin.ENV, raising=False)
    graph_plugin.STATE.update(registered=False)
    graph_plugin.register()  # no setting: registers nothing (SGLang loads every installed plugin in every process)
    assert graph_plugin.STATE["registered"] is False and graph_plugin.STATE["error"] is None
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["sglang.srt.plugins"]
    assert eps[graph_plugin.ENTRY_POINT] == "eagle3kit.capture.graph_plugin:register"
    assert json.loads(graph_plugin.env_value([2, 15, 27])) == {"aux_layer_ids": [2, 15, 27]}


def test_capture_server_keeps_the_graphs_and_refuses_without_the_plugin(tmp_path, target_path, monkeypatch):
    from eagle3kit.capture import server

    cfg = capture_config(tmp_path, [2, 15, 27], 30, prefill_graph=True)
    cmd = server.server_command(target_path, capture=cfg)
    assert "--disable-cuda-graph" not in cmd
    assert "--disable-cuda-graph" in server.server_command(target_path, capture=capture_config(tmp_path, [2, 15, 27], 30))
    monkeypatch.setattr(server, "plugin_problem", lambda env=None: "no entry point 'eagle3kit'")
    with pytest.raises(server.ServerError, match="needs eagle3kit's SGLang plugin: no entry point"):
        server.SGLangServer(target_path, capture=cfg)
    monkeypatch.setattr(server, "plugin_problem", lambda env=None: None)
    s = server.SGLangServer(target_path, capture=cfg)
    assert json.loads(s.env[graph_plugin.ENV]) == {"aux_layer_ids": [2, 15, 27]}
    with pytest.raises(ValueError, match="already is the final norm's output"):
        capture_config(tmp_path, [2, 15, 27], 30, prefill_graph=True, final_normed=True)


def test_plugin_problem_names_a_missing_entry_point_and_a_whitelist_that_leaves_it_out(monkeypatch):
    import importlib.metadata

    from eagle3kit.capture.server import plugin_problem

    assert plugin_problem({}) is None  # the setup installs eagle3kit (pip install -e .): SGLang would find it
    assert "SGLANG_PLUGINS=other leaves it out" in plugin_problem({"SGLANG_PLUGINS": "other"})
    assert plugin_problem({"SGLANG_PLUGINS": "other,eagle3kit"}) is None
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [])  # a Python without eagle3kit installed
    assert "no entry point 'eagle3kit'" in plugin_problem({})


def test_the_extraction_reports_what_sglang_ran_on_its_prefill_graph(tmp_path):
    """``pipeline.prefill_graph_report`` on SGLang 0.5.14's own log lines: the batches on the graph and eager, and a
    note only when none ran on the graph (Kimi-K2.5's wrapper: SGLang turns the graph off for multimodal models)."""
    from eagle3kit.pipeline import prefill_graph_report

    line = ("[2026-12-03 19:25:11] Prefill batch, #new-seq: 6, #new-token: 8192, #cached-token: 0, token usage: 0.00, "
            "#running-req: 1, #queue-req: 32, #pending-token: 49483, cuda graph: {}, input throughput (token/s): 1.0\n")
    decode = "[2026-12-03 19:25:12] Decode batch, #running-req: 1, #token: 77, cuda graph: True, gen throughput: 9.9\n"
    log = tmp_path / "sglang.log"
    log.write_text(line.format("True") * 9 + line.format("False") + decode * 3)
    assert prefill_graph_report(log) == {"prefill_batches_graphed": 9, "prefill_batches_eager": 1}
    log.write_text(line.format("False") * 10 + decode)
    r = prefill_graph_report(log)
    assert (r["prefill_batches_graphed"], r["prefill_batches_eager"]) == (0, 10)
    assert "all 10 prefill batches eagerly" in r["prefill_graph_note"]
    assert prefill_graph_report(tmp_path / "missing.log") == {"prefill_batches_graphed": 0, "prefill_batches_eager": 0}
