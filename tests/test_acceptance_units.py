"""Unit tests of the acceptance tooling without SGLang: the draft hook on fake SGLang objects (real torch modules,
real safetensors files), the load proof on a real eagle3kit export of the embedded SmolLM2 target, the export's own
checks, ``compare`` and the pure parts of ``online``."""
import json
import shutil
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3kit.acceptance import compare, drafthook, online, outputs_match, proof

P = drafthook.RID_PREFIX


# ---------------------------------------------------------------------------------------------------- split_rows
def test_split_rows_keeps_only_prefixed_rids_with_their_offsets():
    rids = [f"{P}a", "3f2b8c1e9d7a4b6c8e0f1a2b3c4d5e6f", "HEALTH_CHECK_1717", f"{P}b", None, f"{P}c"]
    lens = torch.tensor([3, 2, 1, 4, 2, 1])
    assert drafthook.split_rows(rids, lens, P) == [(f"{P}a", 0, 0, 3), (f"{P}b", 3, 6, 10), (f"{P}c", 5, 12, 13)]
    assert drafthook.split_rows(rids, [3, 2, 1, 4, 2, 1], "HEALTH") == [("HEALTH_CHECK_1717", 2, 5, 6)]
    assert drafthook.split_rows(["x", "y"], [5, 5], P) == []
    assert drafthook.split_rows([], [], P) == []


def test_draft_hooks_name_sglang_modules_and_this_factory():
    specs = drafthook.draft_hooks("/tmp/somewhere")
    assert [s["target_modules"] for s in specs] == [["model"], ["logits_processor"]]
    for s, fn in zip(specs, ("model_hook", "logits_hook")):
        mod, name = s["hook_factory"].split(":")
        assert mod == "eagle3kit.acceptance.drafthook" and name == fn and callable(getattr(drafthook, name))
        assert s["config"] == {"out_dir": "/tmp/somewhere", "rid_prefix": P}


# ------------------------------------------------------------------------------- drafthook on fake SGLang objects
H_AUX, H, VOCAB = 12, 4, 7


class FakeDraftModel(torch.nn.Module):
    """Like SGLang's LlamaForCausalLMEagle3.model: has ``fc``; called (input_ids, positions, forward_batch) and
    returns (normed hidden [T, H], [aux])."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(H_AUX, H, bias=False)
        self.norm = torch.nn.LayerNorm(H)

    def forward(self, input_ids, positions, forward_batch, input_embeds=None):
        aux = forward_batch.spec_info.hidden_states
        return self.norm(self.fc(aux)), [aux]


class FakeTargetModel(torch.nn.Module):
    """The target's LlamaModel: same call, no ``fc``."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, H)

    def forward(self, input_ids, positions, forward_batch, input_embeds=None):
        h = self.embed(input_ids)
        return h, [h]


class FakeLogitsProcessor(torch.nn.Module):
    """SGLang's LogitsProcessor: (input_ids, hidden_states, lm_head, logits_metadata) -> an output whose
    next_token_logits is the last row of each request, in the batch's order."""

    def forward(self, input_ids, hidden_states, lm_head, logits_metadata):
        last = torch.tensor(logits_metadata.extend_seq_lens_cpu).cumsum(0) - 1
        return SimpleNamespace(next_token_logits=hidden_states[last] @ lm_head.weight.T)


def _batch(rids, lens, mode="EXTEND", spec=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    fb = SimpleNamespace(forward_mode=SimpleNamespace(name=mode), rids=list(rids), extend_seq_lens_cpu=list(lens))
    if spec:
        fb.spec_info = SimpleNamespace(hidden_states=torch.randn(t, H_AUX, generator=g))
    input_ids = torch.randint(0, VOCAB, (t,), generator=g)
    positions = torch.cat([torch.arange(n) + 3 for n in lens])
    return input_ids, positions, fb


class Rig:
    """The draft's model and logits processor with the hooks registered, as SGLang's hook manager does."""

    def __init__(self, out_dir, model=None):
        torch.manual_seed(0)
        cfg = {"out_dir": str(out_dir), "rid_prefix": P}
        self.out = Path(out_dir)
        self.model = model if model is not None else FakeDraftModel()
        self.lp = FakeLogitsProcessor()
        self.target_lp = FakeLogitsProcessor()
        self.lm_head = torch.nn.Linear(H, VOCAB, bias=False)
        self.model.register_forward_hook(drafthook.model_hook(cfg))
        self.lp.register_forward_hook(drafthook.logits_hook(cfg))
        self.target_lp.register_forward_hook(drafthook.logits_hook(cfg))

    def forward(self, rids, lens, **kw):
        input_ids, positions, fb = _batch(rids, lens, **kw)
        normed, _ = self.model(input_ids, positions, fb)
        out = self.lp(input_ids, normed, self.lm_head, fb)
        return input_ids, positions, fb, normed, out

    def files(self):
        return sorted(p.name for p in self.out.iterdir())


def test_hooks_write_records_of_prefixed_requests_and_the_draft_params(tmp_path):
    rig = Rig(tmp_path / "hooks")
    rids, lens = [f"{P}a", f"{P}b", "HEALTH_CHECK_99", "9c1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f"], [3, 5, 1, 2]
    input_ids, positions, fb, normed, _ = rig.forward(rids, lens)
    assert rig.files() == ["draft_params.safetensors", f"{P}a.safetensors", f"{P}b.safetensors"]
    aux = fb.spec_info.hidden_states
    for rid, a, b in ((f"{P}a", 0, 3), (f"{P}b", 3, 8)):
        r = load_file(str(rig.out / f"{rid}.safetensors"))
        assert set(r) == {"aux", "input_ids", "positions", "normed", "last_logits"}
        assert torch.equal(r["aux"], aux[a:b]) and torch.equal(r["input_ids"], input_ids[a:b])
        assert torch.equal(r["positions"], positions[a:b]) and torch.equal(r["normed"], normed[a:b].detach())
        assert r["last_logits"].dtype == torch.float32 and r["last_logits"].shape == (VOCAB,)
        assert torch.allclose(r["last_logits"], normed[b - 1].detach() @ rig.lm_head.weight.detach().T)
    params = load_file(str(rig.out / "draft_params.safetensors"))
    want = dict(rig.model.named_parameters())
    assert set(params) == {"fc.weight", "norm.weight", "norm.bias", "lm_head.weight"}
    for k, v in want.items():
        assert torch.equal(params[k], v.detach())
    assert torch.equal(params["lm_head.weight"], rig.lm_head.weight.detach())
    assert not (rig.out / "errors.txt").exists()
    # the params are written once, as SGLang first held them; later requests add records only
    before = params["fc.weight"].clone()
    with torch.no_grad():
        rig.model.fc.weight.add_(1.0)
    rig.forward([f"{P}c"], [2], seed=1)
    assert (rig.out / f"{P}c.safetensors").exists()
    assert torch.equal(load_file(str(rig.out / "draft_params.safetensors"))["fc.weight"], before)


def test_last_logits_belong_to_the_request_when_others_come_first(tmp_path):
    rig = Rig(tmp_path / "hooks")
    _, _, _, normed, out = rig.forward(["9c1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f", f"{P}a"], [2, 3])
    r = load_file(str(rig.out / f"{P}a.safetensors"))
    assert torch.allclose(r["last_logits"], out.next_token_logits[1].detach())


def test_target_model_without_fc_records_nothing(tmp_path):
    rig = Rig(tmp_path / "hooks", model=FakeTargetModel())
    input_ids, positions, fb = _batch([f"{P}a"], [3])
    h, _ = rig.model(input_ids, positions, fb)
    rig.lp(input_ids, h, rig.lm_head, fb)
    assert rig.files() == []


def test_decode_forward_records_nothing(tmp_path):
    rig = Rig(tmp_path / "hooks")
    for mode in ("DECODE", "DRAFT_EXTEND_V2", "TARGET_VERIFY"):
        rig.forward([f"{P}a"], [1], mode=mode)
    assert rig.files() == []
    rig.forward([f"{P}a"], [3])  # a prefill extend afterwards is recorded
    assert rig.files() == ["draft_params.safetensors", f"{P}a.safetensors"]


def test_target_logits_processor_consumes_nothing(tmp_path):
    rig = Rig(tmp_path / "hooks")
    input_ids, positions, fb = _batch([f"{P}a"], [4])
    normed, _ = rig.model(input_ids, positions, fb)
    rig.target_lp(input_ids, normed.clone(), rig.lm_head, fb)  # the target's hidden state: another tensor
    assert rig.files() == []
    rig.lp(input_ids, normed, rig.lm_head, fb)  # the draft's own: the pending records are still there
    assert rig.files() == ["draft_params.safetensors", f"{P}a.safetensors"]
    r = load_file(str(rig.out / f"{P}a.safetensors"))
    assert torch.equal(r["normed"], normed.detach())
    rig.lp(input_ids, normed, rig.lm_head, fb)  # consumed once: a second call writes nothing new
    assert rig.files() == ["draft_params.safetensors", f"{P}a.safetensors"]


def test_errors_never_propagate_and_are_written(tmp_path):
    rig = Rig(tmp_path / "hooks")
    input_ids, positions, fb = _batch([f"{P}a"], [3], spec=False)
    # no spec_info: the model hook fails inside
    rig.model.forward = lambda *a, **k: (torch.zeros(3, H), [])
    rig.model(input_ids, positions, fb)  # must not raise
    err = (rig.out / "errors.txt").read_text()
    assert err.startswith("model_hook:") and "AttributeError" in err
    assert [f for f in rig.files() if f.endswith(".safetensors")] == []
    # the logits hook: an lm_head without .weight
    rig2 = Rig(tmp_path / "hooks2")
    input_ids, positions, fb = _batch([f"{P}a"], [3])
    normed, _ = rig2.model(input_ids, positions, fb)
    hook = drafthook.logits_hook({"out_dir": str(rig2.out), "rid_prefix": P})
    hook(rig2.lp, (input_ids, normed, object(), fb), SimpleNamespace(next_token_logits=torch.zeros(1, VOCAB)))
    assert "logits_hook:" in (rig2.out / "errors.txt").read_text()
    assert [f for f in rig2.files() if f.endswith(".safetensors")] == []


# ----------------------------------------------------------------------------------------------- export and proof
LAYERS = [2, 15, 27]


@pytest.fixture(scope="module")
def export_dir(target_path, tmp_path_factory):
    from eagle3kit.drafter import export, model, vocab

    g = torch.Generator().manual_seed(0)
    freq = torch.zeros(49152, dtype=torch.int64)
    freq[torch.randint(0, 49152, (3000,), generator=g)] = torch.randint(1, 100, (3000,), generator=g)
    v = vocab.build(freq, 512)
    m = model.build(target_path, LAYERS, v)
    with torch.no_grad():  # make every exported tensor distinct from its initialisation
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-2)
    dest = export.to_sglang(m, v, tmp_path_factory.mktemp("export") / "exp", target_path, LAYERS)
    return SimpleNamespace(path=dest, vocab=v, model=m)


@pytest.fixture(scope="module")
def target_embed(target_path):
    return load_file(str(Path(target_path) / "model.safetensors"))["model.embed_tokens.weight"]


def _sglang_params(export_path, embed) -> dict:
    """What SGLang's LlamaForCausalLMEagle3 holds after loading the export (its loader stacks q/k/v and gate/up)."""
    t = load_file(str(Path(export_path) / "model.safetensors"))
    L = "layers.0."
    out = {"embed_tokens.weight": embed.clone(), "fc.weight": t["fc.weight"], "norm.weight": t["norm.weight"],
           "lm_head.weight": t["lm_head.weight"],
           L + "self_attn.qkv_proj.weight": torch.cat([t[L + f"self_attn.{x}_proj.weight"] for x in "qkv"]),
           L + "self_attn.o_proj.weight": t[L + "self_attn.o_proj.weight"],
           L + "mlp.gate_up_proj.weight": torch.cat([t[L + "mlp.gate_proj.weight"], t[L + "mlp.up_proj.weight"]]),
           L + "mlp.down_proj.weight": t[L + "mlp.down_proj.weight"]}
    for n in ("input_layernorm", "post_attention_layernorm", "hidden_norm"):
        out[f"{L}{n}.weight"] = t[f"{L}{n}.weight"]
    return {k: v.clone() for k, v in out.items()}


def test_export_config_and_tensor_names(export_dir):
    from eagle3kit.drafter import export

    cfg = json.loads((export_dir.path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["tie_word_embeddings"] is False
    assert cfg["draft_vocab_size"] == 512 and cfg["vocab_size"] == 49152
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]  # SGLang Llama adds 1
    assert cfg["num_hidden_layers"] == 1
    t = load_file(str(export_dir.path / "model.safetensors"))
    assert sorted(t) == sorted(export.sglang_names(3, False))
    assert not any("embed_tokens" in k for k in t)
    assert t["d2t"].dtype == torch.int64 and torch.equal(t["d2t"], export_dir.vocab.d2t)
    assert t["lm_head.weight"].shape == (512, 576) and t["fc.weight"].shape == (576, 3 * 576)
    meta = json.loads((export_dir.path / "eagle3kit.json").read_text())
    assert meta["capture_layer_ids"] == [2, 15, 27, 30] and meta["draft_vocab_size"] == 512


def test_expected_params_stacks_like_sglang(export_dir):
    exp = proof.expected_params(export_dir.path)
    t = load_file(str(export_dir.path / "model.safetensors"))
    L = "layers.0."
    assert len(exp) == 10 and "d2t" not in exp and "embed_tokens.weight" not in exp
    qkv = exp[L + "self_attn.qkv_proj.weight"]
    assert qkv.shape == (576 + 192 + 192, 1152)
    assert torch.equal(qkv[576:768], t[L + "self_attn.k_proj.weight"])
    assert torch.equal(exp[L + "mlp.gate_up_proj.weight"][1536:], t[L + "mlp.up_proj.weight"])


def test_compare_params_all_loaded(export_dir, target_path, target_embed):
    r = proof.compare_params(_sglang_params(export_dir.path, target_embed), export_dir.path, target_path)
    assert r == {"export_params_checked": 11, "export_params_unloaded": 0, "export_params_unloaded_names": [],
                 "export_tensors_not_held": []}
    # SGLang may hold them in another dtype: equal after casting the export's tensor
    as_f32 = {k: v.float() for k, v in _sglang_params(export_dir.path, target_embed).items()}
    assert proof.compare_params(as_f32, export_dir.path, target_path)["export_params_unloaded"] == 0


@pytest.mark.parametrize("name", ["layers.0.self_attn.qkv_proj.weight", "layers.0.mlp.gate_up_proj.weight",
                                  "lm_head.weight", "layers.0.hidden_norm.weight", "embed_tokens.weight"])
def test_compare_params_counts_one_changed_element(export_dir, target_path, target_embed, name):
    params = _sglang_params(export_dir.path, target_embed)
    flat = params[name].view(-1)
    i = flat.numel() // 2 + 1
    flat[i] = flat[i] + 1.0
    r = proof.compare_params(params, export_dir.path, target_path)
    assert r["export_params_unloaded"] == 1 and r["export_params_unloaded_names"] == [name]
    assert r["export_params_checked"] == 10


def test_compare_params_counts_wrong_stacking_order(export_dir, target_path, target_embed):
    params = _sglang_params(export_dir.path, target_embed)
    q, k, v = params["layers.0.self_attn.qkv_proj.weight"].split([576, 192, 192])
    params["layers.0.self_attn.qkv_proj.weight"] = torch.cat([q, v, k])  # same shape, wrong order
    assert proof.compare_params(params, export_dir.path, target_path)["export_params_unloaded_names"] == \
        ["layers.0.self_attn.qkv_proj.weight"]


def test_compare_params_counts_a_param_the_export_does_not_give(export_dir, target_path, target_embed, monkeypatch):
    real = proof.expected_params
    monkeypatch.setattr(proof, "expected_params", lambda d: {k: v for k, v in real(d).items() if k != "lm_head.weight"})
    r = proof.compare_params(_sglang_params(export_dir.path, target_embed), export_dir.path, target_path)
    assert r["export_params_unloaded_names"] == ["lm_head.weight"] and r["export_params_checked"] == 10
    monkeypatch.undo()
    params = _sglang_params(export_dir.path, target_embed)
    params["layers.0.mlp.extra.weight"] = torch.zeros(3)  # held by SGLang, given by nothing
    del params["norm.weight"]  # given by the export, held by nothing
    r = proof.compare_params(params, export_dir.path, target_path)
    assert r["export_params_unloaded_names"] == ["layers.0.mlp.extra.weight"]
    assert r["export_tensors_not_held"] == ["norm.weight"]


def test_compare_params_counts_a_wrong_shape(export_dir, target_path, target_embed):
    params = _sglang_params(export_dir.path, target_embed)
    params["fc.weight"] = params["fc.weight"][:, :576].clone()  # fc over one aux slot
    assert proof.compare_params(params, export_dir.path, target_path)["export_params_unloaded_names"] == ["fc.weight"]


def _copy_export(src, dest, edit):
    shutil.copytree(src, dest)
    t = load_file(str(dest / "model.safetensors"))
    edit(t)
    save_file(t, str(dest / "model.safetensors"))
    return dest


def test_load_sglang_export_refuses_an_extra_tensor(export_dir, tmp_path):
    from eagle3kit.drafter.export import ExportError, load_sglang_export

    d = _copy_export(export_dir.path, tmp_path / "extra",
                     lambda t: t.__setitem__("embed_tokens.weight", torch.zeros(4, 576, dtype=torch.bfloat16)))
    with pytest.raises(ExportError, match="drop \\['embed_tokens.weight'\\]"):
        load_sglang_export(d)
    d = _copy_export(export_dir.path, tmp_path / "extra2",
                     lambda t: t.__setitem__("layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(32)))
    with pytest.raises(ExportError, match="inv_freq"):
        load_sglang_export(d)


def test_load_sglang_export_refuses_a_missing_tensor(export_dir, tmp_path):
    from eagle3kit.drafter.export import ExportError, load_sglang_export

    d = _copy_export(export_dir.path, tmp_path / "missing", lambda t: t.pop("layers.0.hidden_norm.weight"))
    with pytest.raises(ExportError, match="uninitialised"):
        load_sglang_export(d)


def test_load_sglang_export_round_trip(export_dir, target_path):
    from eagle3kit.drafter.export import load_sglang_export

    m, cfg, meta = load_sglang_export(export_dir.path, target_path)
    t = load_file(str(export_dir.path / "model.safetensors"))
    sd = m.state_dict()
    for k, v in t.items():
        if k != "d2t":
            assert torch.equal(sd[k], v.float()), k
    assert torch.equal(m.d2t, export_dir.vocab.d2t)
    assert torch.equal(m.t2d, export_dir.vocab.t2d)
    assert cfg["draft_vocab_size"] == 512 and meta["capture_layer_ids"][:-1] == LAYERS


# -------------------------------------------------------------------------------------------------- attach_prompts
def _record(prompt, generated=9):
    return {"input_ids": torch.tensor(prompt[1:] + [generated], dtype=torch.int32),
            "positions": torch.arange(len(prompt))}


def test_attach_prompts_checks_the_shift():
    prompt = [1, 5, 8, 13, 21]
    recs = {f"{P}0": _record(prompt), f"{P}1": _record([4, 4, 4])}
    out = proof.attach_prompts(recs, {f"{P}0": prompt})
    assert out is recs and out[f"{P}0"]["prompt_ids"].tolist() == prompt
    assert out[f"{P}0"]["prompt_ids"].dtype == torch.int64 and "prompt_ids" not in out[f"{P}1"]


@pytest.mark.parametrize("rec", [
    {"input_ids": torch.tensor([1, 5, 8, 13, 21]), "positions": torch.arange(5)},  # not shifted
    {"input_ids": torch.tensor([8, 13, 21, 9, 9]), "positions": torch.arange(5)},  # shifted by two
    {"input_ids": torch.tensor([13, 21, 9]), "positions": torch.arange(2, 5)},  # a cached prefix: fewer rows
], ids=["unshifted", "shifted_by_two", "cached_prefix"])
def test_attach_prompts_rejects_a_record_that_is_not_the_prompt_shifted_by_one(rec):
    with pytest.raises(ValueError, match="not the prompt shifted by one"):
        proof.attach_prompts({f"{P}0": rec}, {f"{P}0": [1, 5, 8, 13, 21]})


# --------------------------------------------------------------------------------------------------------- compare
def _write(path: Path, d):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(d if isinstance(d, str) else json.dumps(d))


def test_collect_merges_metrics_under_a_folder_and_skips_runs_without_figures(tmp_path):
    _write(tmp_path / "run1" / "metrics.json", {"train_acc_pos0": 0.61, "layer_ids": [2, 15, 27], "shared": "run"})
    _write(tmp_path / "run1" / "train" / "metrics.json", {"train_loss": "kl", "shared": "step", "offline_tau": 2.3})
    _write(tmp_path / "run1" / "online" / "deep" / "metrics.json", {"online_accept_length": 2.1, "shared": "deep"})
    _write(tmp_path / "run1" / "broken" / "metrics.json", "{not json")
    _write(tmp_path / "run2" / "metrics.json", {"extract_engine": "sglang"})  # no acceptance/training figure
    _write(tmp_path / "run3" / "metrics.json", {"online_accept_length": 1.7})
    _write(tmp_path / "run1" / "list" / "metrics.json", [1, 2])  # not a flat object: told, not merged
    skipped = []
    rows = compare.collect([tmp_path / "run1", tmp_path / "run2", tmp_path / "missing",
                            tmp_path / "run3" / "metrics.json"], skipped=skipped)
    assert [r["run"] for r in rows] == ["run1", "run3"]
    # nothing is dropped without a word: the broken file, the run without figures, the missing path
    assert len(skipped) == 4 and "broken/metrics.json: unreadable" in skipped[0], skipped
    assert "list/metrics.json: not a flat metrics object (list)" in skipped[1], skipped
    assert "run2: none of offline_tau" in skipped[2] and "missing: no such file or folder" in skipped[3], skipped
    r = rows[0]
    assert r["_path"] == str(tmp_path / "run1")
    assert r["train_acc_pos0"] == 0.61 and r["offline_tau"] == 2.3 and r["online_accept_length"] == 2.1
    assert r["train_loss"] == "kl" and r["shared"] == "run"  # the run's own summary wins over deeper files
    assert rows[1] == {"run": "run3", "_path": str(tmp_path / "run3" / "metrics.json"), "online_accept_length": 1.7}
    # records of several sessions end in the same folder name: named by as many folders above as tell them apart
    for rec in ("gpu-12", "gpu-13"):
        _write(tmp_path / "records" / rec / "serve" / "metrics.json", {"online_accept_length": 2.5})
    rows = compare.collect([tmp_path / "records" / "gpu-12" / "serve" / "metrics.json",
                            tmp_path / "records" / "gpu-13" / "serve", tmp_path / "run3"])
    assert [r["run"] for r in rows] == ["gpu-12/serve", "gpu-13/serve", "run3"]
    _write(tmp_path / "records" / "gpu-13" / "serve" / "again.json", {"online_accept_length": 2.6})
    rows = compare.collect([tmp_path / "records" / "gpu-13" / "serve" / "metrics.json",
                            tmp_path / "records" / "gpu-13" / "serve" / "again.json"])
    assert [r["run"] for r in rows] == ["serve", "again"]  # two files of one folder


def test_sweep_points():
    row = {"steps3_accept_length": 2.2, "steps1_accept_length": 1.5, "steps2_accept_length": 1.9,
           "steps4_accept_length": None, "xsteps5_accept_length": 3.0, "steps2_accept_length_server": 9.0,
           "steps2_speedup": 1.1, "steps10_speedup": 0.8, "offline_tau_steps3": 2.5, "offline_tau_steps1": 1.6,
           "offline_walk_accept_length_2": 2.0, "offline_walk_accept_length": 2.4, "offline_walk_accept_length_1": 1.5}
    assert compare.sweep(row, "accept") == [(1, 1.5), (2, 1.9), (3, 2.2)]
    assert compare.sweep(row, "speedup") == [(2, 1.1), (10, 0.8)]
    assert compare.sweep(row, "offline") == [(1, 1.6), (3, 2.5)]
    assert compare.sweep(row, "walk") == [(1, 1.5), (2, 2.0)]  # the unsuffixed summary key is not a point
    with pytest.raises(KeyError):
        compare.sweep(row, "nonsense")


def test_table_renders_present_columns_in_order():
    rows = [{"run": "a", "online_accept_length": 2.12345, "train_loss": "kl", "unrelated": 1},
            {"run": "bb", "offline_tau": 1.5}]
    text = compare.table(rows)
    lines = text.splitlines()
    assert lines[0].split() == ["run", "train_loss", "offline_tau", "online_accept_length"]
    assert set(lines[1]) == {"-"}
    assert lines[2].split() == ["a", "kl", "2.123"]
    assert lines[3].split() == ["bb", "1.500"]
    assert "unrelated" not in text
    assert compare.table([]) == "(empty)"


# ---------------------------------------------------------------------------------------------------------- online
def test_serving_args_plain_and_eagle3():
    plain = online.Serving("plain", extra_args=["--cuda-graph-max-bs", "4"])
    assert plain.args() == ["--cuda-graph-max-bs", "4"] and plain.label() == "plain"
    assert not any(a.startswith("--speculative") for a in online.Serving("p").args())
    s = online.Serving("main", drafter=Path("/d/x"), steps=5, topk=2, draft_tokens=8, extra_args=["--foo"])
    a = s.args()
    assert a[-1] == "--foo"
    kv = dict(zip(a[:-1:2], a[1:-1:2]))
    assert kv == {"--speculative-algorithm": "EAGLE3", "--speculative-draft-model-path": "/d/x",
                  "--speculative-num-steps": "5", "--speculative-eagle-topk": "2",
                  "--speculative-num-draft-tokens": "8"}  # SGLang's own log interval, as plain has it
    assert all(isinstance(x, str) for x in a)
    assert s.label() == "main (5,2,8)"


def _measured(tps, accepts=None):
    """A measure_server-shaped result at concurrency 1."""
    rounds = []
    for i, t in enumerate(tps):
        r = {"output_tokens_per_s": t, "requests": 4}
        if accepts is not None and accepts[i] is not None:
            r["accept_length"] = accepts[i]
        rounds.append(r)
    return {1: {"rounds": rounds, "output_tokens_per_s_median": statistics.median(tps),
                "output_tokens_per_s_min": min(tps), "output_tokens_per_s_max": max(tps)}}


def _per_request(*rounds):
    """A concurrency's measurement from per-request (verifies, correct drafts), one list per round."""
    return {"rounds": [{"per_request": [list(x) for x in r]} for r in rounds]}


def test_the_accept_length_interval_is_as_wide_as_the_prompts_differ():
    """The bootstrap interval over prompts: none wide when every prompt accepts alike, around the pooled figure when
    they differ (the gpu-drafter-pipeline-8 main server's own 16 prompts: 2.34 in about [2.02, 2.68]), narrower with
    more prompts of the same kind, the rounds summed per prompt; None without per-request counts."""
    same = _per_request([(10, 20)] * 16)
    assert online.accept_interval(same) == pytest.approx((3.0, 3.0))
    main8 = [(68, 187), (24, 53), (116, 139), (52, 60), (32, 35), (114, 143), (36, 24), (9, 8), (49, 22), (18, 9),
             (43, 27), (149, 109), (110, 120), (89, 167), (83, 174), (87, 169)]
    lo, hi = online.accept_interval(_per_request(main8))
    pooled = 1 + sum(c for _, c in main8) / sum(v for v, _ in main8)
    assert lo < pooled < hi and 1.9 < lo < 2.15 and 2.55 < hi < 2.8, (lo, pooled, hi)
    lo4, hi4 = online.accept_interval(_per_request(main8 * 4))
    assert hi4 - lo4 < 0.6 * (hi - lo)  # four times the prompts: about half the width
    assert online.accept_interval(_per_request(main8[:8], main8[:8])) == online.accept_interval(
        _per_request([(2 * v, 2 * c) for v, c in main8[:8]]))  # two rounds are summed per prompt
    assert online.accept_interval({"rounds": [{"accept_length": 2.0}]}) is None


def test_the_paired_cost_interval_tells_a_real_cost_from_the_prompts_spread():
    """main - control on the same prompts, resampled together: a control that accepts one draft fewer on every
    prompt costs about that much with an interval clear of 0, while a control that differs from main only by
    shuffling which prompts do well straddles 0; the unpaired intervals of both overlap main's."""
    base = [(40, 40 + 10 * i) for i in range(16)]  # per-prompt accept lengths 2.0 to 4.75
    main = _per_request(base)
    worse = _per_request([(v, c - 8) for v, c in base])  # 8 correct drafts fewer of every 40 verifies: -0.2
    lo, hi = online.accept_difference_interval(main, worse)
    assert 0.19 < lo <= hi < 0.21, (lo, hi)
    shuffled = _per_request(base[::-1])
    lo, hi = online.accept_difference_interval(main, shuffled)
    assert lo < 0 < hi
    m_lo, m_hi = online.accept_interval(main)
    w_lo, w_hi = online.accept_interval(worse)
    assert w_hi > m_lo  # alone, the two intervals overlap: only pairing shows the cost
    assert online.accept_difference_interval(main, {"rounds": []}) is None


def test_experiment_summary_reports_the_intervals(tmp_path):
    """The summary carries main's interval at batch 1, each setting's, and each control's paired cost against main
    (not for the sweep and the trees: other settings, not mistakes)."""
    from eagle3kit.acceptance import experiment

    plan = experiment.OnlinePlan(target="embedded:smollm2", drafter="d", controls={"engine": "e"}, sweep_steps=(3, 5),
                                 trees=(), concurrencies=(1,), proof=False)
    base = [(40, 40 + 10 * i) for i in range(16)]

    def srv(tps, rows):
        d = _measured([tps], [1 + sum(c for _, c in rows) / sum(v for v, _ in rows)])
        d[1]["rounds"][0]["per_request"] = [list(x) for x in rows]
        return {"by_concurrency": d}
    servers = {"plain": {"by_concurrency": _measured([100.0])}, "main": srv(120.0, base),
               "steps5": srv(110.0, [(v, c + 4) for v, c in base]), "engine": srv(90.0, [(v, c - 8) for v, c in base]),
               "offbyone": srv(95.0, [(v, c - 4) for v, c in base])}
    m = experiment.summarize(plan, {"servers": servers}, {}, {})
    assert m["online_accept_length_ci95_low"] < m["online_accept_length"] < m["online_accept_length_ci95_high"]
    assert m["engine_accept_cost_ci95_low"] == pytest.approx(0.2, abs=0.01)
    assert 0.09 < m["negative_control_accept_cost_ci95_low"] <= m["negative_control_accept_cost_ci95_high"] < 0.11
    assert "steps5_accept_length_ci95_low" in m and "steps5_accept_cost_ci95_low" not in m


def test_servers_are_warmed_then_timed_in_interleaved_rounds(monkeypatch):
    """Each server's concurrencies get one untimed pass first (an EAGLE server's first batch of a new size is slow:
    records gpu-drafter-pipeline-3 and -6, 37-38 %), then each round flushes every server, times batch 1 of all of
    them prompt by prompt (the first server rotating with the prompt), reads each server's own accept length (which
    the next flush resets), then the other concurrencies one server at a time; forward on even rounds, backward on odd
    ones. Warm speeds are not among the rounds; after each round the results so far are handed on. After batch 1's
    pass and the reads, the caches flushed again (else a prefix-cache hit), the same prompts for one token each,
    interleaved alike: the prefill path's probe, kept apart from the timed requests."""
    calls, seen = [], []

    def fake_measure(url, prompts, conc, max_new_tokens=256):
        calls.append((url, conc, len(prompts), max_new_tokens))
        return {"output_tokens_per_s": float(len(calls))}

    def fake_generate(session, url, ids, max_new_tokens, timeout=600):
        calls.append((url, 1, ids, max_new_tokens))
        return {"completion_tokens": max_new_tokens and 10, "verify_ct": None, "correct_drafts": None,
                "sglang_accept_length": None, "seconds": float(len(calls)), "server_seconds": 0.5, "output_ids": [ids]}

    monkeypatch.setattr(online, "measure", fake_measure)
    monkeypatch.setattr(online, "generate", fake_generate)
    monkeypatch.setattr(online, "flush", lambda url: calls.append(("flush", url)))
    monkeypatch.setattr(online, "server_accept_length", lambda url: calls.append(("read", url)) or 2.5)
    servers = {"plain": ("P", {1: [0, 1], 8: list(range(32))}), "main": ("M", {1: [0, 1]}), "tree": ("T", {1: [0, 1]})}
    out = online.measure_servers(servers, 256, rounds=3, after_round=lambda done: seen.append(
        {n: len(m[1]["rounds"]) for n, m in done.items()}))
    w = online.WARM_TOKENS
    assert calls[:4] == [("P", 1, 1, w), ("P", 8, 8, w), ("M", 1, 1, w), ("T", 1, 1, w)]

    def show(c):
        if c[0] in ("flush", "read"):
            return f"{c[0]} {c[1]}"
        if c[1] == 1 and c[3] == 1:
            return f"{c[0]}{c[2]}'"  # the one-token probe
        assert c[3] == 256  # no warm pass among the rounds
        return f"{c[0]}{c[2]}" if c[1] == 1 else f"{c[0]}x{c[1]}"
    forward = ["flush P", "flush M", "flush T", "P0", "M0", "T0", "M1", "T1", "P1", "read P", "read M", "read T",
               "flush P", "flush M", "flush T", "P0'", "M0'", "T0'", "M1'", "T1'", "P1'", "flush P", "Px8", "read P"]
    backward = ["flush T", "flush M", "flush P", "T0", "M0", "P0", "M1", "P1", "T1", "read T", "read M", "read P",
                "flush T", "flush M", "flush P", "T0'", "M0'", "P0'", "M1'", "P1'", "T1'", "flush P", "Px8", "read P"]
    assert [show(c) for c in calls[4:]] == forward + backward + forward
    # a batch-1 round's time: the sum of its requests' (calls 9 and 11 for main in round 0), the probe's apart
    assert out["main"][1]["rounds"][0]["seconds"] == 9.0 + 11.0
    assert out["main"][1]["rounds"][0]["per_request_time"] == [[10, 9.0], [10, 11.0]]
    assert out["main"][1]["rounds"][0]["first_token"] == {"seconds": [21.0, 23.0], "server_seconds": [0.5, 0.5]}
    assert online.first_token_ms(out["main"][1]) == {"first_token_ms": pytest.approx(1000 * 46.0),
                                                     "first_token_server_ms": 500.0}
    assert sum(len(r["first_token"]["seconds"]) for r in out["main"][1]["rounds"]) == 6  # 2 prompts x 3 rounds
    assert online.first_token_ms(out["plain"][8]) is None  # no probe there (nor in records from before it)
    assert all(r["server_accept_length"] == 2.5 for m in out.values() for c in m.values() for r in c["rounds"])
    assert out["plain"][8]["output_tokens_per_s_median"] == 51.0 and out["plain"][8]["warm_seconds"] >= 0
    assert seen == [{"plain": 1, "main": 1, "tree": 1}, {"plain": 2, "main": 2, "tree": 2},
                    {"plain": 3, "main": 3, "tree": 3}]


def test_replies_of_several_lengths_are_asked_prompt_by_prompt_in_turn(monkeypatch):
    """``measure_interleaved``'s list of max_new_tokens: prompt i asks for lengths[i % len] on every server, so each
    server gets replies of every length (what ``request_fit`` needs) and each prompt the same length everywhere (its
    times stay paired); ``measure_servers`` passes the list through and its probe asks for one token."""
    asked = []

    def fake_generate(session, url, ids, max_new_tokens, timeout=600):
        asked.append((url, ids[0], max_new_tokens))
        return {"completion_tokens": max_new_tokens, "verify_ct": None, "correct_drafts": None,
                "sglang_accept_length": None, "seconds": 0.01, "output_ids": [ids]}

    monkeypatch.setattr(online, "generate", fake_generate)
    prompts = [[i] for i in range(5)]
    online.measure_interleaved({"p": "P", "m": "M"}, {"p": prompts, "m": prompts}, [64, 256])
    assert sorted(asked) == sorted((u, i, [64, 256][i % 2]) for u in "PM" for i in range(5))
    asked.clear()
    monkeypatch.setattr(online, "flush", lambda url: None)
    monkeypatch.setattr(online, "server_accept_length", lambda url: None)
    monkeypatch.setattr(online, "measure", lambda *a, **k: {"output_tokens_per_s": 1.0})  # the warm pass
    out = online.measure_servers({"p": ("P", {1: prompts}), "m": ("M", {1: prompts})}, [64, 256], rounds=1)
    timed = [(u, i, n) for u, i, n in asked if n != 1]
    assert sorted(timed) == sorted((u, i, [64, 256][i % 2]) for u in "PM" for i in range(5))
    assert sorted(x for x in asked if x[2] == 1) == sorted((u, i, 1) for u in "PM" for i in range(5))
    assert [n for n, _ in out["m"][1]["rounds"][0]["per_request_time"]] == [64, 256, 64, 256, 64]

    def refused_one_token(session, url, ids, max_new_tokens, timeout=600):  # a server that fails the probe's requests
        if max_new_tokens == 1:
            raise RuntimeError("500 Server Error")
        return fake_generate(session, url, ids, max_new_tokens)
    monkeypatch.setattr(online, "generate", refused_one_token)
    out = online.measure_servers({"p": ("P", {1: prompts}), "m": ("M", {1: prompts})}, [64, 256], rounds=2)
    assert [len(out[n][1]["rounds"]) for n in "pm"] == [2, 2]  # the timed rounds are all there
    assert out["m"][1]["rounds"][1]["first_token"] == {"error": "prompt 0: RuntimeError: 500 Server Error"}
    assert online.first_token_ms(out["m"][1]) == {"first_token_error": "prompt 0: RuntimeError: 500 Server Error"}


def test_a_server_lost_during_the_rounds_costs_its_own_figures_not_the_run(monkeypatch, tmp_path):
    """A server that dies (or whose request outlives its timeout) during the timed rounds is timed no more: its whole
    rounds so far are kept, the reason is handed back, the other servers' rounds go on (an audit's case: a tree server
    dying in round 2 of 3 ended the run with nothing summarised). 05 counts it as failed, with the reason."""
    rounds_started = []

    def flaky(session, url, ids, max_new_tokens, timeout=600):
        if url == "T" and len(rounds_started) >= 2 and max_new_tokens != 1:
            raise TimeoutError("read timed out after 600 s")
        return {"completion_tokens": 10, "verify_ct": None, "correct_drafts": None, "sglang_accept_length": None,
                "seconds": 0.1, "output_ids": [ids]}

    def measure8(url, prompts, conc, max_new_tokens=256):
        if url == "M8" and max_new_tokens != online.WARM_TOKENS and len(rounds_started) >= 3:
            raise ConnectionError("server gone")
        return {"output_tokens_per_s": 100.0}

    monkeypatch.setattr(online, "generate", flaky)
    monkeypatch.setattr(online, "measure", measure8)
    monkeypatch.setattr(online, "flush", lambda url: rounds_started.append(url) if url == "P" else None)
    monkeypatch.setattr(online, "server_accept_length", lambda url: None)
    prompts = [[i] for i in range(4)]
    lost = {}
    out = online.measure_servers({"p": ("P", {1: prompts}), "t": ("T", {1: prompts}), "m": ("M8", {8: prompts * 8})},
                                 256, rounds=3, lost=lost)
    assert [len(out["p"][1]["rounds"]), len(out["t"][1]["rounds"])] == [3, 1]  # t: its one whole round
    assert lost["t"] == "round 1, batch 1, prompt 0: TimeoutError: read timed out after 600 s"
    assert len(out["m"][8]["rounds"]) == 1 and lost["m"] == "round 1, concurrency 8: ConnectionError: server gone"
    assert len(rounds_started) == 6  # every round ran for the others (a flush of plain's for batch 1 and the probe)


def test_interleaved_batch_1_cancels_a_drift_of_the_host(monkeypatch):
    """The host's speed halves halfway through (gpu-drafter-pipeline-12: plain's rounds 558 to 834 tokens/s, one
    server's 348 to 733). Two servers of equal speed, timed prompt by prompt: each round's ratio is 1 and so is the
    interval over the prompts (timed one server after the other, as until -12, the first would look 2x faster: the
    order test above pins the interleaving)."""
    clock = {"n": 0}

    def drifting_generate(session, url, ids, max_new_tokens, timeout=600):
        clock["n"] += 1
        slow = 2.0 if clock["n"] > 8 else 1.0  # the host halves its speed after 8 requests
        return {"completion_tokens": 100, "verify_ct": None, "correct_drafts": None, "sglang_accept_length": None,
                "seconds": 0.1 * slow * (1 + ids[0] / 10), "output_ids": [ids]}

    monkeypatch.setattr(online, "generate", drifting_generate)
    monkeypatch.setattr(online, "flush", lambda url: None)
    monkeypatch.setattr(online, "server_accept_length", lambda url: None)
    prompts = [[i] for i in range(8)]
    out = online.measure_servers({"plain": ("P", {1: prompts}), "main": ("M", {1: prompts})}, 256, rounds=1)
    assert online.paired_speedups(out["plain"][1], out["main"][1]) == pytest.approx([1.0])
    assert online.speedup_interval(out["plain"][1], out["main"][1]) == pytest.approx((1.0, 1.0))
    assert online.pooled_speedup(out["plain"][1], out["main"][1]) == pytest.approx(1.0)


def test_the_speedup_interval_over_prompts_tells_a_real_speedup_from_none():
    """Per prompt (output tokens, seconds), summed over the rounds; the interval is of spec's tokens/s over plain's,
    the same prompts resampled for both. A draft 1.2x faster on every prompt (prompts of very different speeds) is
    told from 1; one that takes 30 % less time on some prompts and 30 % more on others is not."""
    def rounds(per):  # per prompt (tokens, seconds), two rounds alike
        return {"rounds": [{"per_request_time": [list(x) for x in per]} for _ in range(2)]}

    speeds = [50, 400, 120, 900, 300, 700, 80, 600, 250, 1000, 150, 500]  # plain tokens/s of 12 prompts
    plain = rounds([(200, 200 / v) for v in speeds])
    fast = rounds([(200, 200 / (1.2 * v)) for v in speeds])
    lo, hi = online.speedup_interval(plain, fast)
    assert 1.0 < lo <= 1.2 <= hi < 1.4
    plain2 = rounds([(200, 200 / v) for v in speeds for _ in (0, 1)])  # each prompt twice: 30 % faster, 30 % slower
    mixed = rounds([(200, 200 / v * f) for v in speeds for f in (0.7, 1.3)])
    lo, hi = online.speedup_interval(plain2, mixed)
    assert lo < 1.0 < hi
    assert online.speedup_interval(plain, {"rounds": [{}]}) is None  # no per-request times: no interval


def test_accept_length_at_another_concurrency_on_the_prompts_batch_1_used(monkeypatch):
    """measure keeps (verifies, correct drafts) per request in prompt order; the summary gives a concurrency's accept
    length over batch 1's prompts beside its own, to tell the prompts' effect from the concurrency's (-6: 2.38 at
    batch 1 on 8 prompts, 1.97 at 8 on 32). Prompt i yields i correct drafts in 10 verifies."""
    from eagle3kit.acceptance import experiment

    def fake_generate(session, url, ids, max_new_tokens, timeout=600):
        i = ids[0]
        return {"completion_tokens": 10 + i, "verify_ct": 10, "correct_drafts": i, "sglang_accept_length": None,
                "seconds": 0.0, "output_ids": [i]}

    monkeypatch.setattr(online, "generate", fake_generate)
    prompts = [[i] for i in (6, 4, 0, 0)]
    r8 = online.measure("http://x", prompts, 4)
    assert r8["per_request"] == [[10, 6], [10, 4], [10, 0], [10, 0]] and r8["accept_length"] == pytest.approx(1.25)
    r1 = online.measure("http://x", prompts[:2], 1)

    def no_correct_count(session, url, ids, max_new_tokens, timeout=600):  # verifies counted, correct drafts not
        return {**fake_generate(session, url, ids, max_new_tokens), "correct_drafts": None if ids[0] else 0}
    monkeypatch.setattr(online, "generate", no_correct_count)
    r = online.measure("http://x", prompts, 4)  # no accept length of 1.0 (nothing accepted), no crash: the reason
    assert "accept_length" not in r and "per_request" not in r
    assert r["accept_length_error"].endswith("spec_num_correct_drafts on 2 of 4 requests")
    m = experiment.summarize(experiment.OnlinePlan(target="embedded:smollm2", drafter="d", concurrencies=(1,)),
                             {"servers": {"main": {"by_concurrency": {1: {"rounds": [r]}}}}}, {}, {})
    assert m["online_accept_length_error"] == r["accept_length_error"]  # 05's metrics say why there is no figure
    monkeypatch.setattr(online, "generate", fake_generate)
    plan = experiment.OnlinePlan(target="embedded:smollm2", drafter="d", sweep_steps=(3,), trees=(),
                                 concurrencies=(1, 8), prompts_per_conc={1: 2, 8: 4})

    def at(r):
        return {"rounds": [r], "output_tokens_per_s_median": 1.0, "output_tokens_per_s_min": 1.0,
                "output_tokens_per_s_max": 1.0}
    results = {"servers": {"plain": {"by_concurrency": {1: at({"output_tokens_per_s": 1.0}),
                                                        8: at({"output_tokens_per_s": 1.0})}},
                           "main": {"by_concurrency": {1: at(r1), 8: at(r8)}}}}
    m = experiment.summarize(plan, results, {}, {})
    assert m["online_accept_length"] == pytest.approx(1.5) and m["online_accept_length_c8"] == pytest.approx(1.25)
    assert m["online_accept_length_c8_on_batch1_prompts"] == pytest.approx(1.5)  # the prompts, not the concurrency
    assert "online_accept_length_on_batch1_prompts" not in m


def test_every_timed_request_asks_plain_and_speculative_servers_for_the_same_work(monkeypatch):
    """Equal work: the request payloads of plain and of the speculative server carry the same max_new_tokens and
    ignore_eos (true) for every prompt, in the timed rounds at every concurrency, the warm passes and the one-token
    probe alike, so tokens/s compare the same number of generated tokens per prompt whatever text each produced."""
    import requests

    sent = []

    class Reply:
        def __init__(self, n):
            self.n = n

        def raise_for_status(self):
            pass

        def json(self):
            return {"output_ids": [5] * self.n, "meta_info": {"completion_tokens": self.n, "e2e_latency": 0.01}}

    class Session:
        def post(self, url, timeout=None, json=None):
            sent.append((url.split("/")[0], tuple(json["input_ids"]), tuple(sorted(json["sampling_params"].items()))))
            return Reply(json["sampling_params"]["max_new_tokens"])

        def close(self):
            pass

    monkeypatch.setattr(requests, "Session", Session)
    monkeypatch.setattr(online, "flush", lambda url: None)
    monkeypatch.setattr(online, "server_accept_length", lambda url: None)
    prompts = {1: [[1, 2], [3], [4, 5, 6]], 8: [[7], [8, 9]]}
    online.measure_servers({"plain": ("P", prompts), "main": ("M", prompts)}, [16, 64], rounds=2)
    by = {u: sorted(x[1:] for x in sent if x[0] == u) for u in ("P", "M")}
    assert by["P"] == by["M"] and len(by["P"]) == 2 * (3 + 3 + 2) + 2 + 1  # rounds x (batch 1, probe, 8) + warm
    assert all(dict(params)["ignore_eos"] is True for _, params in by["P"]), by["P"]
    assert {dict(params)["max_new_tokens"] for _, params in by["P"]} == {16, 64, 1, online.WARM_TOKENS}
    assert online.reply_end([4, 2, 9, 2], {2}) == [4] and online.reply_end([4, 9], {2}) == [4, 9]


def test_the_end_of_sequence_ids_are_the_targets_configs_and_tokenizers(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert online.eos_token_ids(tmp_path) == {2, 7}
    assert online.eos_token_ids(tmp_path, type("Tok", (), {"eos_token_id": 9})()) == {2, 7, 9}
    assert online.eos_token_ids(tmp_path / "none") == set()


def test_summarize_speedup_and_breakeven():
    plain = _measured([90.0, 100.0, 130.0])
    spec = _measured([140.0, 150.0, 400.0], accepts=[2.0, 2.6, None])
    s = online.summarize(plain, spec, 1)
    assert s["speedup"] == pytest.approx(140 / 90)  # the median of the rounds' ratios (1.56, 1.5, 3.08), not means
    assert s["accept_length"] == pytest.approx(2.3)
    assert s["breakeven_accept_length"] == pytest.approx(2.3 / (140 / 90))
    assert s["plain_tokens_per_s"] == 100.0 and s["spec_tokens_per_s"] == 150.0


def test_the_speedup_is_the_median_of_the_paired_rounds_not_the_ratio_of_medians():
    """Rounds run back to back, each server's round i at the same moment: the speedup is the median of round i's
    spec / plain, with each round's ratio and their range beside it. Here the medians' ratio (150 / 200 = 0.75)
    pairs plain's second round with spec's second round only by chance of order; the paired median is 0.83."""
    from eagle3kit.acceptance import experiment

    plain, spec = _measured([100.0, 200.0, 300.0]), _measured([150.0, 150.0, 250.0], accepts=[2.0, 2.0, 2.0])
    assert online.paired_speedups(plain[1], spec[1]) == pytest.approx([1.5, 0.75, 250 / 300])
    assert online.paired_speedup(plain[1], spec[1]) == pytest.approx(250 / 300)
    assert online.summarize(plain, spec, 1)["speedup"] == pytest.approx(250 / 300)
    assert online.paired_speedup(plain[1], {"rounds": []}) is None  # no round measured by both: no figure
    plan = experiment.OnlinePlan(target="embedded:smollm2", drafter="d", sweep_steps=(3, 5), trees=(),
                                 concurrencies=(1,), offbyone=False, proof=False)
    srv = {"plain": plain, "main": spec, "steps5": _measured([90.0, 260.0, 330.0], accepts=[3.0] * 3)}
    results = {"servers": {k: {"by_concurrency": v} for k, v in srv.items()}}
    results["servers"]["steps5"]["setting"] = [5, 1, 6]
    m = experiment.summarize(plan, results, {}, {})
    assert m["online_speedup"] == pytest.approx(250 / 300) == m["steps3_speedup"]
    assert [m[f"online_speedup_round{i}"] for i in range(3)] == pytest.approx([1.5, 0.75, 250 / 300])
    assert (m["online_speedup_rounds_min"], m["online_speedup_rounds_max"]) == pytest.approx((0.75, 1.5))
    assert m["online_speedup_medians_ratio"] == pytest.approx(0.75)  # the old figure, kept beside it
    assert m["steps5_speedup"] == pytest.approx(1.1) and m["steps5_speedup_medians_ratio"] == pytest.approx(1.3)
    assert m["steps3_speedup_round1"] == m["online_speedup_round1"]  # main is the sweep's point at its setting
    assert m["online_best_setting"] == "steps5 (5,1,6)" and m["online_best_speedup"] == pytest.approx(1.1)


def test_summarize_without_accept_or_plain_speed():
    s = online.summarize(_measured([100.0]), _measured([80.0]), 1)
    assert s["speedup"] == pytest.approx(0.8) and s["accept_length"] is None and "breakeven_accept_length" not in s
    s = online.summarize(_measured([0.0]), _measured([80.0], accepts=[2.0]), 1)
    assert s["speedup"] == 0.0 and s["breakeven_accept_length"] is None


def test_experiment_summary_per_variant_and_controls(tmp_path):
    """Each variant's speedup (another attention backend here) is against the plain server of the same variant; the controls' figures are against the
    plain default; a failed optional server is counted apart from the required ones."""
    from eagle3kit.acceptance import experiment

    plan = experiment.OnlinePlan(target="embedded:smollm2", drafter="d", controls={"engine": "e"}, sweep_steps=(1, 3),
                                 trees=(), variants={"flashinfer": ["--attention-backend", "flashinfer"]},
                                 concurrencies=(1,))
    names = [s.name for s in experiment.servings(plan, tmp_path)]
    assert names == ["plain", "main", "steps1", "engine", "offbyone", "plain-flashinfer", "main-flashinfer", "proof"]
    srv = {"plain": _measured([100.0]), "main": _measured([150.0], [2.4]), "engine": _measured([90.0], [1.3]),
           "offbyone": _measured([80.0], [1.1]), "plain-flashinfer": _measured([120.0]),
           "main-flashinfer": _measured([240.0], [2.4])}
    results = {"servers": {k: {"by_concurrency": v} for k, v in srv.items()}, "failed": {"steps1": "oom"},
               "outputs_match_plain": {n: {"identical": 0.5, "common_prefix": 0.7} for n in srv if n != "plain"}}
    m = experiment.summarize(plan, results, {}, {"main": {"offline_tau_3": 2.5, "offline_walk_accept_length_3": 2.2},
                                                 "main_first_replies": {"offline_walk_accept_length_3": 2.52},
                                                 "engine": {"offline_tau_3": 1.4}})
    assert m["online_speedup"] == pytest.approx(1.5) and m["online_accept_length"] == pytest.approx(2.4)
    assert m["online_serving"] == "3,1,4"  # the setting the unsuffixed figures are of
    assert m["flashinfer_speedup"] == pytest.approx(2.0) and m["flashinfer_breakeven_accept_length"] == pytest.approx(1.2)
    assert m["breakeven_accept_length"] == pytest.approx(1.6)
    # the break-even's parts: plain 10 ms a token, main's cycle 16 ms for its 2.4 tokens (each setting's own cycle)
    assert m["plain_ms_per_token"] == pytest.approx(10.0) and m["online_cycle_ms"] == pytest.approx(16.0)
    assert m["engine_cycle_ms"] == pytest.approx(1000 * 1.3 / 90) and m["flashinfer_cycle_ms"] == pytest.approx(10.0)
    assert m["online_cycle_ms"] / m["plain_ms_per_token"] == pytest.approx(m["breakeven_accept_length"])
    assert m["steps3_cycle_ms"] == m["online_cycle_ms"]  # the serving setting in the sweep, as its speedup is
    assert m["flashinfer_plain_ms_per_token"] == pytest.approx(1000 / 120)  # against its own plain
    assert m["flashinfer_cycle_ms"] / m["flashinfer_plain_ms_per_token"] == pytest.approx(
        m["flashinfer_breakeven_accept_length"])
    assert m["engine_control_accept_length"] == pytest.approx(1.3) and m["engine_speedup"] == pytest.approx(0.9)
    assert m["engine_breakeven_accept_length"] == pytest.approx(1.3 / 0.9)
    assert m["negative_control_accept_length"] == pytest.approx(1.1) and m["engine_offline_tau"] == 1.4
    assert m["engine_offline_rel_diff"] == pytest.approx(1.4 / 2.5 - 1)  # against main's offline tau, same steps
    assert m["offline_online_rel_gap"] == pytest.approx(0.1 / 2.4)
    assert m["offline_walk_accept_length"] == 2.2 and m["offline_walk_online_rel_gap"] == pytest.approx(0.2 / 2.4)
    # the walk over the very replies batch 1 decoded (their conversations' first replies), beside the online figure
    assert m["offline_walk_same_replies"] == 2.52
    assert m["offline_walk_same_replies_online_rel_gap"] == pytest.approx(0.12 / 2.4)
    assert not any(k.startswith(("plain-", "main-")) for k in m)
    assert all(k.isidentifier() for k in m), [k for k in m if not k.isidentifier()]  # every server's figures
    assert m["flashinfer_plain_outputs_identical_to_plain"] == 0.5 and m["engine_common_prefix_with_plain"] == 0.7
    assert m["online_servers_failed"] == 1 and m["online_required_servers_failed"] == 0
    assert m["doctor_verified_families"] == "" and m["doctor_target_model_type"] == "llama"  # no proof ran
    assert m["doctor_target_architecture"] == "LlamaForCausalLM"  # the served class (a wrapper names its own)


def test_the_untrained_drafter_beside_main_measures_what_an_accepted_token_adds_to_the_cycle(tmp_path):
    """gpu-breakeven-1 (untrained, accept length 1) against gpu-drafter-pipeline-13 (trained, 2.6-3.0): the trained
    cycles were 11-27 % longer at the same settings, across runs. The untrained server at main's setting measures it
    in one run: plain 10 ms a token; main's cycle 16 ms for 2.4 tokens; untrained's 12.5 ms for 1.0: 2.5 ms (a
    quarter of a plain step) a token accepted beyond the first."""
    from eagle3kit.acceptance import experiment

    plan = experiment.OnlinePlan(target="embedded:smollm2", drafter="d", sweep_steps=(3,), trees=(), offbyone=False,
                                 untrained=True, concurrencies=(1,))
    specs = {s.name: s for s in experiment.servings(plan, tmp_path)}
    assert list(specs) == ["plain", "main", "untrained", "proof"]
    assert specs["untrained"].drafter == str(tmp_path / "untrained")
    assert (specs["untrained"].steps, specs["untrained"].topk, specs["untrained"].draft_tokens) == (3, 1, 4)
    srv = {"plain": _measured([100.0]), "main": _measured([150.0], [2.4]), "untrained": _measured([80.0], [1.0])}
    m = experiment.summarize(plan, {"servers": {k: {"by_concurrency": v} for k, v in srv.items()}, "failed": {}}, {}, {})
    assert m["untrained_cycle_ms"] == pytest.approx(12.5) and m["online_cycle_ms"] == pytest.approx(16.0)
    assert m["untrained_breakeven_accept_length"] == pytest.approx(1.25) and m["breakeven_accept_length"] == pytest.approx(1.6)
    assert m["cycle_ms_per_accepted_token"] == pytest.approx(2.5)
    assert m["cycle_steps_per_accepted_token"] == pytest.approx(0.25)
    assert "untrained" not in m.get("online_best_setting", "")  # not a setting to serve with
    # no figure from accept lengths too close to divide by, or without the untrained server
    assert experiment.accepting_cost({**m, "untrained_accept_length": 2.35}) == {}
    assert experiment.accepting_cost({k: v for k, v in m.items() if not k.startswith("untrained")}) == {}
    with pytest.raises(ValueError, match="taken by another server"):
        experiment.OnlinePlan(target="t", drafter="d", controls={"untrained": "x"})


def _timed(fixed_ms, cycle_ms, lengths, accept=None):
    """Batch-1 requests that cost ``fixed_ms`` + ``cycle_ms`` a cycle, one round; ``accept``: tokens a verify cycle
    (a speculative server; None: plain, one token a decode step after the prefill's)."""
    times, per = [], []
    for n in lengths:
        cycles = round((n - 1) / (accept - 1)) if accept and accept > 1 else n - 1  # verify cycles (tokens - 1 plain)
        times.append([n, (fixed_ms + cycle_ms * cycles) / 1000])
        per.append([cycles, n - 1 - cycles] if accept else [0, 0])
    toks, secs = sum(n for n in lengths), sum(t for _, t in times)
    r = {"output_tokens_per_s": toks / secs, "per_request_time": times}
    if accept is not None:
        r.update(per_request=per, accept_length=sum(c + w for c, w in per) / sum(c for c, _ in per))
    return {1: {"rounds": [r], "output_tokens_per_s_median": toks / secs, "output_tokens_per_s_min": toks / secs,
                "output_tokens_per_s_max": toks / secs}}


def test_a_requests_fixed_cost_is_told_from_its_cycles():
    """gpu-drafter-pipeline-13: the speculative requests cost 35-54 ms whatever their length (plain 20), and the
    cycle over whole requests (accept length / tokens a second) came to 4.1 ms at (3,1,4) where a cycle more cost
    3.55: fewer cycles carry the fixed cost, which looked like accepted tokens costing time."""
    from eagle3kit.acceptance import online

    lengths = [16, 64, 128, 256, 200, 90]
    plain = online.request_fit(_timed(20.0, 1.25, lengths)[1])
    spec = online.request_fit(_timed(35.0, 3.5, lengths, accept=3.0)[1])
    assert plain["request_fixed_ms"] == pytest.approx(20.0) and plain["cycle_marginal_ms"] == pytest.approx(1.25)
    assert spec["request_fixed_ms"] == pytest.approx(35.0) and spec["cycle_marginal_ms"] == pytest.approx(3.5)
    assert spec["cycle_marginal_ms_se"] == pytest.approx(0.0, abs=1e-9) and spec["fit_requests"] == 6
    m = _timed(35.0, 3.5, lengths, accept=3.0)[1]["rounds"][0]
    assert online.cycle_ms(m["accept_length"], m["output_tokens_per_s"]) > 3.5 * 1.05  # whole requests: inflated
    # a fit needs replies of several lengths (the break-even benchmark's untrained replies were all 256 tokens)
    assert online.request_fit(_timed(20.0, 1.25, [256, 256, 256])[1]) is None
    assert online.request_fit(_timed(20.0, 1.25, [16, 256])[1]) is None  # and 3 requests
    # replies all of one length, whose cycles differ only by the drafts accepted (253-255 for 256 tokens): no fit
    same = _timed(40.0, 3.3, [256] * 16, accept=1.0)
    same[1]["rounds"][0]["per_request"] = [[253 + i % 3, 0] for i in range(16)]
    assert online.request_fit(same[1]) is None
    assert online.request_fit(_timed(40.0, 3.3, [192, 256, 256], accept=1.0)[1])  # a quarter apart: a fit
    # a trained drafter's replies all 256 tokens long: cycles 67-170 as prompts accept 1.5-3.8 tokens, a cost per
    # accepted token (0.1 ms) that such a fit would take for fixed cost (21 ms true, 46.5 fitted): no fit either
    cycles = [67, 170, 102, 85, 128, 150]  # 255 tokens after the prefill's, at 3.8 to 1.5 a cycle
    one_length = {"rounds": [{"per_request_time": [[256, (21.0 + 3.4 * c + 0.1 * (255 - c)) / 1000] for c in cycles],
                              "per_request": [[c, 255 - c] for c in cycles]}]}
    assert max(cycles) - min(cycles) > 0.25 * max(cycles) and online.request_fit(one_length) is None


def test_the_summary_gives_each_setting_its_marginal_cycle_and_the_speedup_long_replies_tend_to(tmp_path):
    from eagle3kit.acceptance import experiment

    plan = experiment.OnlinePlan(target="embedded:smollm2", drafter="d", sweep_steps=(3, 7), trees=(), offbyone=False,
                                 untrained=True, concurrencies=(1,))
    lengths = [16, 64, 128, 256, 200, 90]
    srv = {"plain": _timed(20.0, 1.25, lengths), "main": _timed(35.0, 3.5, lengths, accept=2.5),
           "steps7": _timed(37.0, 3.5, lengths, accept=3.0), "untrained": _timed(30.0, 3.4, lengths, accept=1.0)}
    m = experiment.summarize(plan, {"servers": {k: {"by_concurrency": v} for k, v in srv.items()}, "failed": {}}, {}, {})
    assert m["plain_request_fixed_ms"] == pytest.approx(20.0) and m["plain_step_marginal_ms"] == pytest.approx(1.25)
    assert m["online_cycle_marginal_ms"] == pytest.approx(3.5) and m["online_request_fixed_ms"] == pytest.approx(35.0)
    assert m["breakeven_marginal_accept_length"] == pytest.approx(3.5 / 1.25)
    assert m["online_speedup_marginal"] == pytest.approx(m["online_accept_length"] * 1.25 / 3.5)
    assert m["steps7_speedup_marginal"] == pytest.approx(m["steps7_accept_length"] * 1.25 / 3.5)
    assert m["steps7_speedup_marginal"] > m["steps7_speedup"]  # the fixed costs weigh on whole requests
    assert m["untrained_cycle_marginal_ms"] == pytest.approx(3.4, rel=1e-3)
    # what an accepted token adds, with and without the fixed costs: only the latter is the cycle's
    assert m["cycle_marginal_ms_per_accepted_token"] == pytest.approx((3.5 - 3.4) / (m["online_accept_length"] - 1),
                                                                      rel=1e-2)
    assert m["cycle_ms_per_accepted_token"] > 2 * m["cycle_marginal_ms_per_accepted_token"]
    assert not any("first_token" in k for k in m)  # measured without the probe: no figure made up
    for who, ms in (("plain", 18.0), ("main", 31.0)):  # with it: each server's prefill path beside its fixed cost
        srv[who][1]["rounds"][0]["first_token"] = {"seconds": [ms / 1000, ms / 1000 + 0.01, ms / 1000 - 0.001],
                                                   "server_seconds": None}
    m = experiment.summarize(plan, {"servers": {k: {"by_concurrency": v} for k, v in srv.items()}, "failed": {}}, {}, {})
    assert m["plain_first_token_ms"] == pytest.approx(18.0) and m["online_first_token_ms"] == pytest.approx(31.0)
    from eagle3kit.acceptance import compare

    head = compare.table([{"run": "r", **m}]).splitlines()[0].split()  # 06's table shows the fit and the probe
    assert {"online_first_token_ms", "plain_first_token_ms", "online_speedup_marginal", "online_request_fixed_ms"} <= set(head)
    assert "steps7_first_token_ms" not in m and "online_first_token_server_ms" not in m


def test_a_variant_of_speculative_flags_only_is_held_against_plain_itself(tmp_path):
    """A variant that changes only speculative flags (the draft attention backend) gets no plain server of its own:
    without speculation it would serve exactly as plain, so its speedup is against plain; a flag of any other kind
    (even beside a speculative one) keeps the variant's own plain server."""
    from eagle3kit.acceptance import experiment

    assert experiment.speculative_only(["--speculative-attention-mode", "decode"])
    assert not experiment.speculative_only(["--speculative-attention-mode", "decode", "--attention-backend", "fa3"])
    assert not experiment.speculative_only([]) and not experiment.speculative_only(["decode"])
    plan = experiment.OnlinePlan(target="embedded:smollm2", drafter="d", sweep_steps=(3,), trees=(), offbyone=False,
                                 proof=False, concurrencies=(1,),
                                 variants={"verifydecode": ["--speculative-attention-mode", "decode"],
                                           "mixed": ["--speculative-attention-mode", "decode", "--attention-backend",
                                                     "flashinfer"]})
    assert [s.name for s in experiment.servings(plan, tmp_path)] == ["plain", "main", "main-verifydecode",
                                                                       "plain-mixed", "main-mixed"]
    srv = {"plain": _measured([100.0]), "main": _measured([150.0], [2.4]), "main-verifydecode": _measured([180.0], [2.4]),
           "plain-mixed": _measured([50.0]), "main-mixed": _measured([100.0], [2.4])}
    m = experiment.summarize(plan, {"servers": {k: {"by_concurrency": v} for k, v in srv.items()}}, {}, {})
    assert m["verifydecode_speedup"] == pytest.approx(1.8) and m["verifydecode_plain_tokens_per_s"] == 100.0
    assert m["verifydecode_breakeven_accept_length"] == pytest.approx(2.4 / 1.8)
    assert m["mixed_speedup"] == pytest.approx(2.0)  # against its own plain (50), not plain's 100
    assert m["mixed_speedup_rounds_min"] == pytest.approx(2.0)  # its round against its plain's round
    del srv["plain"]  # plain failed to start: a speculative-only variant has nothing to be held against
    m = experiment.summarize(plan, {"servers": {k: {"by_concurrency": v} for k, v in srv.items()}}, {}, {})
    assert "verifydecode_speedup" not in m and m["mixed_speedup"] == pytest.approx(2.0)


def test_a_speculative_only_variant_is_timed_and_summarized_at_every_concurrency(tmp_path, monkeypatch):
    """A variant of speculative flags only is a way to serve main (SGLang's --speculative-adaptive picks the steps
    per batch size, 0 at 32): it is timed at every concurrency, as main is, and its speedup is given per
    concurrency against plain; a variant with other flags stays at batch 1, its plain too."""
    from eagle3kit.acceptance import experiment

    plan = experiment.OnlinePlan(target="embedded:smollm2", drafter="d", sweep_steps=(3,), trees=(), offbyone=False,
                                 proof=False, concurrencies=(1, 8), prompts_per_conc={1: 2, 8: 4}, rounds=1,
                                 variants={"adaptive": ["--speculative-adaptive"],
                                           "fi": ["--attention-backend", "flashinfer"]}, port=31300)

    class Srv:
        def __init__(self, url):
            self.url = url

        def stop(self):
            pass

    names = [s.name for s in experiment.servings(plan, tmp_path)]
    assert names == ["plain", "main", "main-adaptive", "plain-fi", "main-fi"]
    ports = []  # the plan's port: two runs on one GPU (gpu-mla-tiny-3's lanes) otherwise bind the same ports
    monkeypatch.setattr(online, "start_servers", lambda *a, **k: ports.append(a[3]) or {
        "servers": {n: Srv(n) for n in names}, "failed": {}})
    seen = {}

    def fake_measure_servers(timed, max_new_tokens, rounds, after_round=None, lost=None):
        seen.update({n: sorted(by_conc) for n, (_, by_conc) in timed.items()})
        done = {n: {c: _measured([1.0])[1] for c in by_conc} for n, (_, by_conc) in timed.items()}
        after_round(done)
        return done

    monkeypatch.setattr(online, "measure_servers", fake_measure_servers)
    experiment.run(plan, [[1, 2]] * 4, tmp_path / "online", log=lambda *_: None)
    assert seen == {"plain": [1, 8], "main": [1, 8], "main-adaptive": [1, 8], "plain-fi": [1], "main-fi": [1]}
    assert ports == [31300]
    # the data set's replies to batch 1's two prompts reach the comparison; a failing decoder costs nothing else

    def with_outputs(timed, max_new_tokens, rounds, after_round=None, lost=None):
        done = fake_measure_servers(timed, max_new_tokens, rounds, after_round)
        for by_conc in done.values():
            by_conc[1]["rounds"][0]["_outputs"] = [[1, 2], [3]]
        return done

    def losing_main_fi(timed, max_new_tokens, rounds, after_round=None, lost=None):  # a server lost in the rounds
        done = fake_measure_servers({n: v for n, v in timed.items() if n != "main-fi"}, max_new_tokens, rounds,
                                    after_round)
        lost["main-fi"] = "round 0, batch 1, prompt 1: ConnectionError: gone"
        return done
    monkeypatch.setattr(online, "measure_servers", losing_main_fi)
    res = experiment.run(plan, [[1, 2]] * 4, tmp_path / "online1", log=lambda *_: None)
    assert res["failed"] == {"main-fi": "during the timed rounds: round 0, batch 1, prompt 1: ConnectionError: gone"}
    assert "by_concurrency" in res["servers"]["main"] and "main-fi" not in res["servers"]  # the others' figures stand
    assert experiment.summarize(plan, res, {}, {})["online_servers_failed"] == 1
    monkeypatch.setattr(online, "measure_servers", with_outputs)
    res = experiment.run(plan, [[1, 2]] * 4, tmp_path / "online2", log=lambda *_: None, stored=["a b", "x"],
                         decode=lambda ids: " ".join("ab c"[i - 1] if i < 3 else "c" for i in ids))
    assert res["outputs_match_stored"]["main"] == {"identical": 0.5, "identical_prompts": 1, "prompts": 2,
                                                   "common_prefix": pytest.approx(0.5)}
    # timed replies run past the end-of-sequence token (equal work): compared as far as it, its share counted
    res = experiment.run(plan, [[1, 2]] * 4, tmp_path / "online2b", log=lambda *_: None, stored=["a", "x"],
                         decode=lambda ids: " ".join("ab c"[i - 1] if i < 3 else "c" for i in ids), eos_ids={2})
    assert res["outputs_match_stored"]["main"]["identical_prompts"] == 1  # [1, 2] cut to [1]: "a"
    assert res["tokens_past_eos"]["main"] == pytest.approx(1 / 3)  # of [1, 2] and [3]: the 2
    m = experiment.summarize(plan, res, {}, {})
    assert m["main_outputs_identical_to_stored_prompts"] == 1 and m["main_outputs_compared_with_stored"] == 2
    assert m["main_tokens_past_eos_share"] == pytest.approx(1 / 3)
    assert m["adaptive_outputs_identical_to_plain_prompts"] == 2 == m["adaptive_outputs_compared_with_plain"]
    line = experiment.speedup_report(m)
    assert "median of 1 paired rounds" in line and "1 of 2 prompts identical to stored" in line, line
    assert "33.3% of main's timed tokens past the end" in line and "2 of 2 prompts identical to plain" in line
    logged = []
    res = experiment.run(plan, [[1, 2]] * 4, tmp_path / "online3", log=logged.append, stored=["a b", "x"],
                         decode=lambda ids: 1 / 0)
    assert "outputs_match_stored" not in res and res["servers"]["main"]["by_concurrency"][1]
    assert any("stored replies not compared: ZeroDivisionError" in x for x in logged), logged
    p8, a8 = _measured([100.0, 300.0]), _measured([120.0, 390.0], [2.4, 1.5])
    plain = {1: p8[1], 8: {**p8[1], "output_tokens_per_s_median": 1000.0, "rounds": [{"output_tokens_per_s": 1000.0}]}}
    adaptive = {1: a8[1], 8: {**a8[1], "output_tokens_per_s_median": 950.0,
                              "rounds": [{"output_tokens_per_s": 950.0, "accept_length": 1.2}]}}
    srv = {"plain": plain, "main": plain, "main-adaptive": adaptive, "plain-fi": p8, "main-fi": a8}
    same = {n: {"identical": 0.5, "common_prefix": 0.75} for n in srv if n != "plain"}  # the run's own comparison
    m = experiment.summarize(plan, {"servers": {k: {"by_concurrency": v} for k, v in srv.items()},
                                    "outputs_match_plain": same}, {}, {})
    # every name a metric may take (gpu-drafter-pipeline-13 lost 05's record to 'main-adaptive_outputs_...')
    assert all(k.isidentifier() for k in m), [k for k in m if not k.isidentifier()]
    assert m["adaptive_outputs_identical_to_plain"] == 0.5 and m["fi_plain_common_prefix_with_plain"] == 0.75
    assert m["main_outputs_identical_to_plain"] == 0.5 and m["fi_outputs_identical_to_plain"] == 0.5
    # its rounds' ratios 1.2 and 1.3 (the medians' ratio 255 / 200 would give 1.275)
    assert m["adaptive_speedup"] == pytest.approx(1.25) and m["adaptive_speedup_c8"] == pytest.approx(0.95)
    assert m["adaptive_accept_length_c8"] == pytest.approx(1.2) and m["adaptive_plain_tokens_per_s_c8"] == 1000.0
    assert m["adaptive_speedup_c8_rounds_min"] == pytest.approx(0.95) and "adaptive_breakeven_accept_length_c8" not in m


def test_a_variant_or_control_name_that_cannot_name_a_metric_is_refused_before_any_server_starts():
    from eagle3kit.acceptance import experiment

    with pytest.raises(ValueError, match=r"variant names \['flash-infer'\].*'flash_infer'"):
        experiment.OnlinePlan(target="t", drafter="d", variants={"flash-infer": ["--attention-backend", "flashinfer"]})
    with pytest.raises(ValueError, match=r"control names \['fp8 data'\]"):
        experiment.OnlinePlan(target="t", drafter="d", controls={"fp8 data": "x"})
    experiment.OnlinePlan(target="t", drafter="d", variants={"flash_infer": []}, controls={"fp8": "x"})
    # a name whose metrics another server already writes would overwrite them silently
    for clash in ({"controls": {"online": "x"}}, {"controls": {"steps3": "x"}}, {"variants": {"tree5x4x8": []}},
                  {"controls": {"negative_control": "x"}},
                  # names that start a summary figure's: a control 'breakeven' wrote main's breakeven_accept_length
                  {"controls": {"breakeven": "x"}}, {"variants": {"breakeven": []}},
                  {"controls": {"offline_walk": "x"}}):
        with pytest.raises(ValueError, match="taken by another server"):
            experiment.OnlinePlan(target="t", drafter="d", **clash)
    with pytest.raises(ValueError, match="fp8 storage control"):  # a variant 'fp8' would make fp8_accept_rel_diff
        experiment.OnlinePlan(target="t", drafter="d", variants={"fp8": ["--kv-cache-dtype", "fp8_e4m3"]})
    # a control whose name merely starts like the sweep's is a control: never the setting to serve with
    plan = experiment.OnlinePlan(target="embedded:smollm2", drafter="d", controls={"treebank": "x"}, sweep_steps=(3,),
                                 trees=(), concurrencies=(1,))
    srv = {"plain": _measured([100.0]), "main": _measured([90.0], [2.4]), "treebank": _measured([150.0], [2.6])}
    m = experiment.summarize(plan, {"servers": {k: {"by_concurrency": v} for k, v in srv.items()}}, {}, {})
    assert m["online_best_setting"] == "main (3,1,4)" and "treebank_speedup" in m
    for clash in ({"variants": {"kv": []}, "controls": {"kv": "x"}},
                  {"variants": {"fi": []}, "controls": {"fi_plain": "x"}}):
        with pytest.raises(ValueError, match="variant and a control"):
            experiment.OnlinePlan(target="t", drafter="d", **clash)


def test_experiment_summary_names_the_fastest_setting_and_each_settings_spread(tmp_path):
    """The best setting is chosen among main, the sweep and the trees by speedup at batch 1 (a faster control does not
    count: it is not a drafter to serve), named with its (steps, topk, draft tokens); each setting's rounds give its
    spread."""
    from eagle3kit.acceptance import experiment

    plan = experiment.OnlinePlan(target="embedded:smollm2", drafter="d", controls={"engine": "e"}, sweep_steps=(1, 3, 7),
                                 trees=((5, 4, 8),), variants={}, concurrencies=(1,))
    srv = {"plain": _measured([100.0, 100.0]), "main": _measured([90.0, 92.0], [2.4, 2.4]),
           "steps1": _measured([60.0, 60.0], [1.5, 1.5]), "steps7": _measured([110.0, 120.0], [2.6, 2.6]),
           "tree5x4x8": _measured([118.0, 119.0], [2.75, 2.75]), "engine": _measured([200.0, 200.0], [3.0, 3.0]),
           "offbyone": _measured([80.0, 80.0], [1.9, 1.9])}
    settings = {"main": [3, 1, 4], "steps1": [1, 1, 2], "steps7": [7, 1, 8], "tree5x4x8": [5, 4, 8], "engine": [3, 1, 4]}
    results = {"servers": {k: {"by_concurrency": v, "setting": settings.get(k)} for k, v in srv.items()}}
    m = experiment.summarize(plan, results, {}, {})
    assert m["online_best_setting"] == "tree5x4x8 (5,4,8)"
    assert m["online_best_speedup"] == pytest.approx(1.185) and m["online_best_accept_length"] == 2.75
    assert (m["online_best_speedup_rounds_min"], m["online_best_speedup_rounds_max"]) == pytest.approx((1.18, 1.19))
    assert m["steps7_tokens_per_s_spread"] == pytest.approx(10 / 115) and m["steps1_tokens_per_s_spread"] == 0.0
    # each round against plain's round of the same moment (rounds interleave the servers): the speedup's own spread
    assert (m["steps7_speedup_rounds_min"], m["steps7_speedup_rounds_max"]) == pytest.approx((1.1, 1.2))
    assert (m["online_speedup_rounds_min"], m["online_speedup_rounds_max"]) == pytest.approx((0.9, 0.92))
    assert m["steps3_speedup_rounds_min"] == m["online_speedup_rounds_min"]  # main is the sweep's point at 3 steps
    tree_main = experiment.OnlinePlan(target="embedded:smollm2", drafter="d", serving=(5, 4, 8), sweep_steps=(1, 3),
                                      trees=(), concurrencies=(1,))  # main a tree: not the chain's point at 5 steps
    assert not any(k.startswith("steps5_") for k in experiment.summarize(tree_main, results, {}, {}))
    results["servers"]["plain"]["by_concurrency"] = _measured([125.0, 100.0])  # plain fast in round 0, slow in 1
    m = experiment.summarize(plan, results, {}, {})  # round by round, not fastest with fastest: 110/125 and 120/100
    assert (m["steps7_speedup_rounds_min"], m["steps7_speedup_rounds_max"]) == pytest.approx((0.88, 1.2))
    assert m["steps7_speedup"] == pytest.approx((110 / 125 + 1.2) / 2)  # the paired rounds' median (2 rounds)
    assert m["steps7_speedup_medians_ratio"] == pytest.approx(115 / 112.5)  # the medians' ratio pairs no rounds
    results["servers"]["plain"]["by_concurrency"] = _measured([100.0, 100.0])
    results["servers"]["steps7"]["by_concurrency"] = _measured([130.0, 130.0], [2.6, 2.6])
    assert experiment.summarize(plan, results, {}, {})["online_best_setting"] == "steps7 (7,1,8)"
    # with per-request times (batch 1 timed prompt by prompt), a setting's interval over the prompts too
    for name, tps in (("plain", 100.0), ("steps7", 130.0)):
        for r in results["servers"][name]["by_concurrency"][1]["rounds"]:
            r["per_request_time"] = [[100, 100 / (tps * f)] for f in (0.8, 1.0, 1.25, 0.9)]  # prompts of other speeds
    m = experiment.summarize(plan, results, {}, {})
    assert m["steps7_speedup_ci95_low"] == pytest.approx(1.3) == m["online_best_speedup_ci95_high"]  # 1.3x on each
    assert m["steps7_speedup_pooled"] == pytest.approx(1.3) == m["online_best_speedup_pooled"]
    assert "online_speedup_ci95_low" not in m and "steps1_speedup_ci95_low" not in m  # no per-request times: none
    for r in results["servers"]["main"]["by_concurrency"][1]["rounds"]:  # main (the sweep's 3 steps) 0.9x on each
        r["per_request_time"] = [[90, 100 / (100.0 * f)] for f in (0.8, 1.0, 1.25, 0.9)]
    m = experiment.summarize(plan, results, {}, {})
    assert m["online_speedup_ci95_low"] == pytest.approx(0.9) == m["steps3_speedup_ci95_high"]


def test_a_serving_flag_is_judged_against_sglangs_defaults_and_the_fastest_plain_server():
    """A variant whose flags are not speculative ones (SGLang's breakable prefill graph, which an EAGLE target may use
    and the default piecewise one not) changes plain too: its speedup against its own plain is kept, and also given
    against plain served with SGLang's defaults; the best setting is chosen among main, the sweep and main under each
    variant, against the fastest plain server of the run, whichever variant it is."""
    from eagle3kit.acceptance import experiment

    bcg = ["--cuda-graph-backend-prefill", "breakable"]
    plan = experiment.OnlinePlan(target="embedded:smollm2", drafter="d", sweep_steps=(3, 7), trees=(),
                                 variants={"bcg": bcg}, concurrencies=(1,))
    assert "plain-bcg" in [s.name for s in experiment.servings(plan, Path("/nonexistent"))]
    srv = {"plain": _measured([100.0, 104.0]), "main": _measured([101.0, 103.0], [2.5, 2.5]),
           "steps7": _measured([106.0, 108.0], [3.0, 3.0]), "plain-bcg": _measured([96.0, 100.0]),
           "main-bcg": _measured([110.0, 114.0], [2.5, 2.5])}
    settings = {"main": [3, 1, 4], "steps7": [7, 1, 8], "main-bcg": [3, 1, 4]}
    results = {"servers": {k: {"by_concurrency": v, "setting": settings.get(k)} for k, v in srv.items()}}
    m = experiment.summarize(plan, results, {}, {})
    paired = statistics.median  # of the rounds' ratios, each against plain's round of the same moment
    assert m["bcg_speedup"] == pytest.approx(paired([110 / 96, 114 / 100]))  # against its own plain, slowed by the flag
    assert m["bcg_speedup_vs_plain"] == pytest.approx(paired([110 / 100, 114 / 104]))  # against SGLang's defaults
    assert (m["bcg_speedup_vs_plain_rounds_min"], m["bcg_speedup_vs_plain_rounds_max"]) == pytest.approx(
        (114 / 104, 110 / 100))  # round by round
    assert m["online_best_setting"] == "main-bcg (3,1,4) --cuda-graph-backend-prefill breakable"
    assert m["online_best_baseline"] == "plain" and m["online_best_speedup"] == m["bcg_speedup_vs_plain"]
    assert m["online_best_speedup_rounds_min"] == pytest.approx(114 / 104) and m["online_best_accept_length"] == 2.5
    # the flag speeds plain more than main: the best is judged against that plain, not the slower default
    results["servers"]["plain-bcg"]["by_concurrency"] = _measured([120.0, 124.0])
    m = experiment.summarize(plan, results, {}, {})
    assert m["online_best_baseline"] == "plain-bcg" and m["online_best_setting"] == "main-bcg (3,1,4) " + " ".join(bcg)
    assert m["online_best_speedup"] == pytest.approx(paired([110 / 120, 114 / 124]))
    assert m["bcg_speedup_vs_plain"] == pytest.approx(paired([110 / 100, 114 / 104]))
    head = compare.table([{"run": "r", **m}]).splitlines()[0].split()  # 06's table: the baseline and the variant
    assert {"online_best_baseline", "bcg_speedup_vs_plain"} <= set(head)
    # without the variant's main, the sweep's best against the faster plain
    del results["servers"]["main-bcg"]
    m = experiment.summarize(plan, results, {}, {})
    assert m["online_best_setting"] == "steps7 (7,1,8)"
    assert m["online_best_speedup"] == pytest.approx(paired([106 / 120, 108 / 124]))
    # a speculative-only variant has no plain of its own: it is judged against plain, and no vs_plain twin is written
    plan = experiment.OnlinePlan(target="embedded:smollm2", drafter="d", sweep_steps=(3,), trees=(),
                                 variants={"adaptive": ["--speculative-adaptive"]}, concurrencies=(1,))
    srv = {"plain": _measured([100.0]), "main": _measured([101.0], [2.5]), "main-adaptive": _measured([105.0], [2.6])}
    m = experiment.summarize(plan, {"servers": {k: {"by_concurrency": v} for k, v in srv.items()}}, {}, {})
    assert m["online_best_setting"] == "main-adaptive (3,1,4) --speculative-adaptive"
    assert m["online_best_speedup"] == pytest.approx(1.05) == m["adaptive_speedup"] and "adaptive_speedup_vs_plain" not in m


def test_an_interrupted_online_run_keeps_the_rounds_measured_before_it(tmp_path, monkeypatch):
    """A serve phase cut by its time limit (record gpu-drafter-pipeline-7: 10 of 11 servers measured, then the
    interrupt, and no figure but the log's) keeps every whole round measured so far in partial.json; record_partial
    turns them into the step's metrics (marked partial, without the proof) and leaves a complete summary alone."""
    from eagle3kit.acceptance import experiment

    plan = experiment.OnlinePlan(target="embedded:smollm2", drafter="d", sweep_steps=(1, 3), trees=(), offbyone=False,
                                 proof=False, concurrencies=(1,))
    speed = {"P": (100.0, None), "M": (150.0, 2.5), "S": (80.0, 1.6)}

    class Srv:
        stopped = 0

        def __init__(self, url):
            self.url = url

        def stop(self):
            Srv.stopped += 1

    monkeypatch.setattr(online, "start_servers", lambda *a, **k: {
        "servers": {"plain": Srv("P"), "main": Srv("M"), "steps1": Srv("S")}, "failed": {}})
    timed = []

    def fake_measure(url, prompts, conc, max_new_tokens=256):
        if max_new_tokens == online.WARM_TOKENS:
            return {"output_tokens_per_s": 1.0}
        if len(timed) == 4:
            raise KeyboardInterrupt  # the phase's time limit, in the second round
        timed.append(url)
        tps, acc = speed[url]
        return {"output_tokens_per_s": tps, "_outputs": [[1, 2, 3]], **({"accept_length": acc} if acc else {})}

    monkeypatch.setattr(online, "measure", fake_measure)
    monkeypatch.setattr(online, "measure_interleaved", lambda urls, prompts, n: {  # batch 1, servers in turn
        name: {"per_request_time": [[1, 0.02]]} if n == 1 else fake_measure(u, prompts[name], 1, n)  # 1: the probe
        for name, u in urls.items()})
    monkeypatch.setattr(online, "flush", lambda url: None)
    monkeypatch.setattr(online, "server_accept_length", lambda url: None)
    logged, proved = [], []

    def on_proof(results):  # before the rounds: a failing proof is logged, the rounds go on
        proved.append(len(timed))
        raise ValueError("no draft records")
    with pytest.raises(KeyboardInterrupt):
        experiment.run(plan, [[1, 2]] * 16, tmp_path / "online", log=logged.append, on_proof=on_proof)
    assert proved == [0] and any("proof before the rounds failed: ValueError" in x for x in logged), logged
    assert Srv.stopped == 3 and timed == ["P", "M", "S", "S"]  # every server stopped all the same
    saved = json.loads((tmp_path / "online" / experiment.PARTIAL).read_text())
    assert sorted(saved["results"]["servers"]) == ["main", "plain", "steps1"] and "_outputs" not in json.dumps(saved)
    assert all(len(r["by_concurrency"]["1"]["rounds"]) == 1 for r in saved["results"]["servers"].values())
    (tmp_path / "metrics.json").write_text(json.dumps({"offline_tau_3": 3.0, "offline_walk_accept_length_3": 2.5}))
    m = experiment.record_partial(tmp_path)
    assert m["online_partial"] is True and m["online_servers_measured"] == 3 and m["online_servers_planned"] == 3
    assert m["online_speedup"] == pytest.approx(1.5) and m["online_accept_length"] == pytest.approx(2.5)
    assert m["steps1_speedup"] == pytest.approx(0.8) and m["offline_walk_online_rel_gap"] == pytest.approx(0.0)
    assert "export_params_unloaded" not in m and "online_required_servers_failed" not in m
    # a proof made before the rounds (proof.json) is part of the partial record
    (tmp_path / "proof.json").write_text(json.dumps({"proof": {
        "export_params_unloaded": 0, "export_params_checked": 11, "doctor_verified": True, "doctor_ok": True,
        "fed_layer_ids": [2, 15, 27], "fed_layer_rel_err": [0.01, 0.02, 0.01]}}))
    (tmp_path / "metrics.json").write_text(json.dumps({"offline_tau_3": 3.0, "offline_walk_accept_length_3": 2.5,
                                                       "offline_walk_same_replies": 2.4}))
    m = experiment.record_partial(tmp_path)
    assert m["offline_walk_same_replies_online_rel_gap"] == pytest.approx(0.1 / 2.5)  # recorded before the servers
    assert m["export_params_unloaded"] == 0 and m["doctor_verified_families"] == "llama" and m["online_partial"]
    (tmp_path / "proof.json").unlink()
    assert json.loads((tmp_path / "metrics.json").read_text())["online_speedup"] == m["online_speedup"]
    # the notebook's complete summary is never overwritten by a partial one
    (tmp_path / "metrics.json").write_text(json.dumps({"online_required_servers_failed": 0, "online_speedup": 1.0}))
    assert experiment.record_partial(tmp_path) == {}
    assert json.loads((tmp_path / "metrics.json").read_text())["online_speedup"] == 1.0
    assert experiment.record_partial(tmp_path / "elsewhere") == {}  # no online run there: nothing to record
    # a record brought back from the GPU machine names its target folder there: the same model here is given
    saved["plan"]["target"] = "/root/e3k-cache/models/smollm2-135m-instruct"
    (tmp_path / "online" / experiment.PARTIAL).write_text(json.dumps(saved))
    (tmp_path / "metrics.json").write_text(json.dumps({"offline_tau_3": 3.0}))
    from eagle3kit.target import TargetError

    with pytest.raises(TargetError):
        experiment.record_partial(tmp_path)
    assert experiment.record_partial(tmp_path, target="embedded:smollm2")["online_speedup"] == pytest.approx(1.5)


@pytest.mark.parametrize("target,family", [("embedded:smollm2", "llama"), ("embedded:deepseek-v3-tiny", "deepseek")])
def test_the_verified_family_is_the_rule_sglang_applied_to_the_served_target(target, family):
    """doctor_verified_families names the layer-id rule of the target that was served (Llama's, or DeepSeek/Kimi's
    of deepseek_v2.py), and only when both the export and the off-by-one control were identified by value."""
    from eagle3kit.acceptance import experiment

    plan = experiment.OnlinePlan(target=target, drafter="d", sweep_steps=(), trees=(), concurrencies=(1,))
    proof = {"doctor_verified": True, "doctor_ok": True, "fed_layer_ids": [2, 4, 6], "fed_layer_rel_err": [0.01]}
    results = {"servers": {}, "failed": {}}
    m = experiment.summarize(plan, results, {"proof": proof, "offbyone": {**proof, "doctor_ok": False}}, {})
    assert m["doctor_verified_families"] == family
    m = experiment.summarize(plan, results, {"proof": proof, "offbyone": {**proof, "doctor_verified": False}}, {})
    assert m["doctor_verified_families"] == ""


def test_outputs_compared_to_plain_by_identity_and_common_prefix():
    from eagle3kit.acceptance import experiment

    def srv(outs):
        return {"by_concurrency": {1: {"rounds": [{"_outputs": outs}]}}}

    results = {"servers": {"plain": srv([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]),
                           "main": srv([[1, 2, 3, 4], [5, 6, 0, 0], None]),
                           "bad": srv([[0, 2, 3, 4], [5, 6, 7, 8, 1], [9, 9]])}}
    m = outputs_match.outputs_match_plain(results)
    assert m["main"] == {"identical": 0.5, "identical_prompts": 1, "prompts": 2,
                         "common_prefix": pytest.approx((1 + 0.5) / 2)}
    assert m["bad"]["identical"] == pytest.approx(1 / 3)
    # cut at the end-of-sequence token 7 (timed replies go on past it): bad's second reply is plain's to its end
    assert outputs_match.outputs_match_plain(results, {7})["bad"]["identical_prompts"] == 2
    assert m["bad"]["common_prefix"] == pytest.approx((0 + 4 / 5 + 1) / 3)


def test_batch_1_replies_are_held_against_the_data_sets_own_replies():
    """The offline walk over "the same replies" walks the replies stored in the data set; how far batch 1's online
    replies (plain's and main's) follow them is measured as text, and summarized per server."""
    from eagle3kit.acceptance import experiment

    def srv(outs):
        return {"by_concurrency": {1: {"rounds": [{"_outputs": outs}]}}}
    words = {1: "the", 2: "cat", 3: "sat", 4: "dog", 5: "ran"}
    decode = lambda ids: " ".join(words[i] for i in ids)  # noqa: E731
    results = {"servers": {"plain": srv([[1, 2, 3], [1, 4, 5]]), "main": srv([[1, 2, 3], [1, 2, 5]]),
                           "steps5": srv([[9]])}}
    got = outputs_match.outputs_match_stored(results, [" the cat sat", "the dog ran\n"], decode)
    assert sorted(got) == ["main", "plain"]  # the two servers 05 holds against the stored text
    assert got["plain"] == {"identical": 1.0, "identical_prompts": 2, "prompts": 2, "common_prefix": 1.0}
    assert got["main"]["identical"] == 0.5 and got["main"]["common_prefix"] == pytest.approx((1 + 4 / 11) / 2)
    assert outputs_match.outputs_match_stored(results, [], decode) == {}
    plan = experiment.OnlinePlan(target="embedded:smollm2", drafter="d", sweep_steps=(3,), trees=(), offbyone=False,
                                 proof=False, concurrencies=(1,))
    m = experiment.summarize(plan, {"servers": {}, "outputs_match_stored": got}, {}, {})
    assert m["plain_outputs_identical_to_stored"] == 1.0 and m["main_common_prefix_with_stored"] < 1.0
    assert "main_common_prefix_with_stored" in compare.table([{"run": "r", **m}]).splitlines()[0]  # 06's table


def test_stored_first_replies_are_read_in_the_order_asked_and_only_as_text(tmp_path):
    convs = [{"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                                      {"role": "assistant", "content": "later"}]},
             {"id": "b", "messages": [{"role": "user", "content": "look"},
                                      {"role": "assistant", "content": [{"type": "image"}]}]},
             {"id": "c", "messages": [{"role": "user", "content": "no reply"}]}]
    (tmp_path / "regenerated.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    (tmp_path / "extraction.json").write_text(json.dumps({"regenerated_max_new_tokens": 64}))
    assert online.first_reply_texts(tmp_path, ["c", "a", "b"], 64) == ["", "hello", ""]
    (tmp_path / "extraction.json").write_text("{not json")
    with pytest.raises(ValueError, match="no readable extraction.json"):
        online.first_reply_texts(tmp_path, ["a"], 64)


def test_the_plots_draw_the_intervals_where_a_run_has_them(tmp_path):
    """compare.plot: the online bar of a run with an interval carries it as an error bar, a run without one gets
    none (no zero-length bar at 0); the offline walk is drawn beside tau; the speedup curve carries each setting's
    range over its rounds. controls_plot: each experiment's interval."""
    import matplotlib
    matplotlib.use("Agg")

    with_ci = {"run": "a", "offline_tau": 3.0, "offline_walk_accept_length": 2.7, "online_accept_length": 2.3,
               "online_accept_length_ci95_low": 2.0, "online_accept_length_ci95_high": 2.7,
               "offline_walk_accept_length_1": 1.8, "offline_walk_accept_length_3": 2.7}
    fig = compare.plot([with_ci, {"run": "b", "offline_tau": 2.0, "online_accept_length": 1.9}], tmp_path / "c.png")
    c = fig.axes[2]
    bars = [coll for coll in c.collections if coll.get_segments()]  # the error bars' line segments
    segs = [s for coll in bars for s in coll.get_segments() if len(s)]
    assert len(segs) == 1 and [round(y, 3) for y in (segs[0][0][1], segs[0][1][1])] == [2.0, 2.7], segs
    assert any(line.get_label() == "a offline walk" for line in fig.axes[0].get_lines())
    # the speedup curve: each point's range over its rounds (paired with plain's), none where a run has no rounds
    rounds = {"steps3_speedup": 0.84, "steps3_speedup_rounds_min": 0.73, "steps3_speedup_rounds_max": 0.94,
              "steps5_speedup": 1.06, "steps5_speedup_rounds_min": 0.985, "steps5_speedup_rounds_max": 1.135}
    fig = compare.plot([{"run": "a", **rounds}, {"run": "b", "steps3_speedup": 0.9, "steps5_speedup": 1.0}])
    segs = sorted((round(s[0][0], 3), round(s[0][1], 3), round(s[1][1], 3)) for coll in fig.axes[1].collections
                  for s in coll.get_segments() if len(s))
    assert segs == [(3.0, 0.73, 0.94), (5.0, 0.985, 1.135)], segs
    # each run's break-even in its own line and colour (-11, -12 and -13 were written over each other)
    fig = compare.plot([{"run": "a", **rounds, "breakeven_accept_length": 2.9},
                        {"run": "b", "steps3_speedup": 0.9, "breakeven_accept_length": 3.4}])
    notes = [(t.get_text(), t.xyann if hasattr(t, "xyann") else t.get_position(), t.get_color())
             for t in fig.axes[1].texts]
    assert [n[0][:23] for n in notes] == ["break-even accept 2.90 ", "break-even accept 3.40 "], notes
    curves = [c for c in fig.axes[1].containers]  # each run's speedup curve (error bar container), in row order
    assert [n[2] for n in notes] == [c[0].get_color() for c in curves] and notes[0][1] != notes[1][1], notes
    assert notes[0][0].endswith("(3 steps)")  # a run recorded before online_serving: served at (3,1,4)
    # each run's own serving setting labels its figures; runs at different settings are not labelled as one
    fig = compare.plot([{"run": "a", "steps3_speedup": 0.9, "breakeven_accept_length": 2.9, "online_serving": "5,1,6",
                         "online_accept_length": 2.8}, {"run": "b", "online_accept_length": 2.5}])
    assert fig.axes[1].texts[0].get_text().endswith("(5 steps)")
    assert "online accept length (each run's serving steps), 95 % over prompts" in \
        [t.get_text() for t in fig.axes[2].get_legend().get_texts()]
    assert compare.serving_of({"online_serving": "(5, 1, 6)"}) == (5, 1, 6) and compare.serving_of({}) == (3, 1, 4)
    assert compare.serving_of({"online_serving": "3,1"}) is None and compare.serving_of({"online_serving": None}) is None
    compare.controls_plot({"online_accept_length": 2.0, "online_serving": ""}, "t")  # an odd value: labelled "?"
    fig = compare.plot([{"run": "a", "online_accept_length": 2.8, "online_serving": "5,1,6"}])
    assert [t.get_text() for t in fig.axes[2].get_legend().get_texts()] == [
        "online accept length (5 steps), 95 % over prompts"]
    # equal rounds: the medians' ratio may round a hair past them (matplotlib refuses a negative error)
    compare.plot([{"run": "c", "steps3_speedup": 1.1, "steps3_speedup_rounds_min": 1.1 + 4e-16,
                   "steps3_speedup_rounds_max": 1.1 - 4e-16}])
    m = {"online_accept_length": 2.3, "online_accept_length_ci95_low": 2.0, "online_accept_length_ci95_high": 2.7,
         "negative_control_accept_length": 2.1, "negative_control_accept_length_ci95_low": 1.9,
         "negative_control_accept_length_ci95_high": 2.4, "breakeven_accept_length": 2.7}
    fig = compare.controls_plot(m, "t", tmp_path / "k.png")
    xs = sorted(tuple(round(p[0], 3) for p in s) for coll in fig.axes[0].collections for s in coll.get_segments()
                if len(s))
    assert xs == [(1.9, 2.4), (2.0, 2.7)], xs
    labels = [x.get_text() for x in fig.axes[0].get_yticklabels()]
    assert labels == ["layer ids off by one", "trained (SGLang states)"], labels
    assert "(3 steps, topk 1, 4 draft tokens" in fig.axes[0].get_xlabel()
    fig = compare.controls_plot({**m, "online_serving": "5,1,6"}, "t")
    assert "(5 steps, topk 1, 6 draft tokens" in fig.axes[0].get_xlabel()
    m.update(negative_control_accept_cost_ci95_low=0.03, negative_control_accept_cost_ci95_high=0.22,
             offbyone_doctor_ok=False, postnorm_accept_length=1.2, postnorm_doctor_ok=False, engine_accept_length=2.2,
             engine_doctor_ok=True, engine_accept_cost_ci95_low=-0.05, engine_accept_cost_ci95_high=0.29)
    labels = [x.get_text() for x in compare.controls_plot(m, "t").axes[0].get_yticklabels()][::-1]
    assert labels == ["trained (SGLang states)", "layer ids off by one\ndoctor flags it · cost [+0.03, +0.22]",
                      "final slot post-norm\ndoctor flags it", "states from transformers\ndoctor: ok · cost [-0.05, +0.29]"]
    from eagle3kit.acceptance import experiment

    m.update(offline_tau=2.0, **experiment.control_offline(["engine"], {"main": {"offline_tau_3": 2.0},
                                                                       "engine": {"offline_tau_3": 1.9}}, 3))
    labels = [x.get_text() for x in compare.controls_plot(m, "t").axes[0].get_yticklabels()][::-1]
    assert labels[0] == "trained (SGLang states)\noffline tau 2.000", labels
    assert labels[3] == "states from transformers\ndoctor: ok · cost [-0.05, +0.29] · offline tau 1.900 (-5.0%)", labels
    assert (tmp_path / "c.png").exists() and (tmp_path / "k.png").exists()


def test_control_offline_figures_are_against_mains_tau_at_the_same_steps():
    """fp8's storage goal (#11: within 2 %) read from the offline figures: each control's tau and its change against
    the main drafter's at the serving steps; a control without an offline figure, or a run without main's, gets no
    change (never one against 0 or another step count)."""
    from eagle3kit.acceptance.experiment import control_offline

    offline = {"main": {"offline_tau_3": 2.0, "offline_tau_5": 2.4}, "fp8": {"offline_tau_3": 1.99, "offline_tau_5": 9.0},
               "seed1": {"offline_tau_3": 1.97}, "engine": {"offline_tau_5": 2.0}}
    m = control_offline({"fp8": "a", "seed1": "b", "engine": "c", "original": "d"}, offline, 3)
    assert m == {"fp8_offline_tau": 1.99, "fp8_offline_rel_diff": pytest.approx(-0.005),
                 "seed1_offline_tau": 1.97, "seed1_offline_rel_diff": pytest.approx(-0.015)}, m
    assert control_offline({"fp8": "a"}, {"fp8": {"offline_tau_3": 1.99}}, 3) == {"fp8_offline_tau": 1.99}


def test_compare_cli_names_each_run_left_out_and_fails_when_a_given_run_gives_no_row(tmp_path, capsys):
    from eagle3kit import cli

    _write(tmp_path / "run1" / "metrics.json", {"online_accept_length": 2.5, "online_speedup": 1.1})
    assert cli.main(["compare", str(tmp_path / "run1"), "--out", str(tmp_path / "c")]) == 0
    assert cli.main(["compare", str(tmp_path / "run1"), str(tmp_path / "run9"), "--out", str(tmp_path / "c2")]) == 2
    err = capsys.readouterr().err
    assert "run9: no such file or folder" in err and "1 of the 2 runs given gave no row" in err and "Traceback" not in err


def test_a_headline_is_the_median_over_every_comparable_run_each_listed_never_the_best():
    """Four runs of one recipe at (3,1,4) accept 2.32, 2.48, 2.58, 2.36: the headline is their median (2.42) with
    each run listed, not the best (2.58); a run served at another setting is another claim; a chain setting's
    figure is compared across runs by its own name."""
    runs = [("-11", 2.32, 0.98), ("-12", 2.48, 0.77), ("-13", 2.58, 0.88), ("-15", 2.36, 0.91)]
    rows = [{"run": r, "online_accept_length": a, "online_speedup": s, "online_serving": "3,1,4",
             "steps7_speedup": s + 0.1, "online_best_speedup": 1.5} for r, a, s in runs]
    rows.append({"run": "-16", "online_accept_length": 2.9, "online_serving": "5,1,6", "offline_tau": float("nan"),
                 "steps7_speedup": 1.2})
    hs = {(h["claim"], h["setting"]): h for h in compare.headlines(rows)}
    acc = hs["online_accept_length", "3,1,4"]
    assert acc["median"] == pytest.approx(2.42) and acc["runs"] == 4 and (acc["min"], acc["max"]) == (2.32, 2.58)
    assert acc["each"] == [("-11", 2.32), ("-12", 2.48), ("-13", 2.58), ("-15", 2.36)]
    assert hs["online_accept_length", "5,1,6"]["median"] == 2.9 and hs["online_accept_length", "5,1,6"]["runs"] == 1
    assert hs["online_speedup", "3,1,4"]["median"] == pytest.approx(0.895)
    assert hs["steps7_speedup", ""]["runs"] == 5 and hs["steps7_speedup", ""]["median"] == pytest.approx(1.01)
    assert not any(c == "online_best_speedup" or c == "offline_tau" for c, _ in hs)  # a pick, and a nan: no claim
    text = compare.headline_table(rows)
    assert "2.420" in text and "-13 2.580" in text and "-11 2.320" in text
    m = compare.headline_metrics(rows)
    assert m["headline_online_accept_length_3_1_4_median"] == pytest.approx(2.42)
    assert m["headline_online_accept_length_3_1_4_runs"] == 4 and m["headline_steps7_speedup_runs"] == 5
