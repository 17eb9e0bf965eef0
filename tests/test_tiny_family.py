"""The users' family on the CPU (#14): the tiny DeepSeek-V3 made here is what SGLang and transformers expect (MLA
sizes SGLang's triton kernels assume, per-expert weight names, the config keys deepseek_v2.py reads), and the
capture steps run on it end to end (params/cpu-deepseek-tiny.yaml: target, TP check over 2 gloo ranks, capture
spec, extraction with the reference check, a drafter trained and exported under the family's layer-id rule, its
offline acceptance)."""
import json
import os
from pathlib import Path
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from eagle3kit.warm_kernel import ENV as WARM_KERNEL
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def deepseek_tiny():
    from eagle3kit.target import resolve_target

    return resolve_target("embedded:deepseek-v3-tiny")


def test_tiny_deepseek_has_the_family_geometry_and_sglangs_config_keys(deepseek_tiny):
    cfg = json.loads((deepseek_tiny / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["model_type"] == "deepseek_v3"
    assert cfg["kv_lora_rank"] == 512 and cfg["qk_rope_head_dim"] == 64  # SGLang's triton MLA kernels need these
    assert cfg["first_k_dense_replace"] == 1 and cfg["n_routed_experts"] > cfg["num_experts_per_tok"] > 1
    assert cfg["moe_layer_freq"] == 1 and cfg["topk_method"] == "noaux_tc" and cfg["scoring_func"] == "sigmoid"
    with safe_open(str(deepseek_tiny / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in names and "model.layers.0.mlp.gate_proj.weight" in names
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names)  # per expert, as SGLang loads
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names


def test_transformers_loads_the_per_expert_files_into_the_same_network(deepseek_tiny):
    from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    from eagle3kit.tiny import SEED

    loaded = AutoModelForCausalLM.from_pretrained(deepseek_tiny, dtype=torch.bfloat16)
    cfg = json.loads((deepseek_tiny / "config.json").read_text())
    torch.manual_seed(SEED)
    fresh = DeepseekV3ForCausalLM(DeepseekV3Config(**{k: v for k, v in cfg.items()
                                                      if k in DeepseekV3Config().to_dict()})).to(torch.bfloat16)
    a, b = fresh.state_dict(), loaded.state_dict()
    assert set(a) == set(b)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert differ == [k for k in a if k.endswith("e_score_correction_bias")]  # set after init, on purpose


@pytest.mark.slow(2)
def test_capture_steps_run_on_the_tiny_deepseek(tmp_path):
    out = tmp_path / "run"
    # the params' steps at the smallest sizes whose claims hold (the whole 49,152-token draft vocabulary stays: a
    # random target's tokens fall anywhere in it, and 2,048 left no held-out row counted)
    small = ["01_tp_check.num_prompts=2", "01_tp_check.max_len=64", "02_capture_spec.num_concurrent=8",
             "03_extract.max_tokens=160", "03_extract.max_samples=12", "03_extract.compact_samples=2",
             "03_extract.reference_check=1", "04_train.tokens_per_batch=256", "04_train.max_steps=4"]
    r = subprocess.run([sys.executable, "-m", "eagle3kit.cli", "run", str(ROOT / "params" / "cpu-deepseek-tiny.yaml"),
                        "--run-dir", str(out), *(a for kv in small for a in ("--set", kv))],
                       capture_output=True, text=True, timeout=1500,
                       env={**os.environ, "OMP_NUM_THREADS": "1", WARM_KERNEL: "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    status = json.loads((out / "status.json").read_text())
    assert all(s["state"] == "ok" for s in status.values()) and len(status) == 6, status
    m = json.loads((out / "metrics.json").read_text())
    assert m["target_model_type"] == "deepseek_v3" and m["tp_ranks"] == 2 and m["tp_check_run"]
    assert m["tp_bitwise_equal_fraction"] == 1.0 and m["capture_mismatches"] == 0
    assert m["negative_controls_caught"] == m["negative_controls_total"] == 5
    assert m["extract_failed"] == 0 and m["verify_reference_failed"] == 0 and m["extract_verified"] > 0
    # a drafter for the family, exported with deepseek_v2.py's rule (aux [2, 4, 5] stay as they are: +1 only when the
    # first id is 1), the doctor passing it, and its offline figures (noise on random weights, but computed)
    assert m["train_steps"] == 4 and m["export_doctor_ok"] and m["export_loadback_max_rel_err"] < 0.05
    assert m["offline_tau_3"] >= m["offline_tau_1"] >= 1.0


def test_tiny_kimi_is_the_deepseek_inside_kimi_k25s_wrapper(deepseek_tiny, tmp_path, monkeypatch):
    """Config layout and weight names as SGLang 0.5.14 loads kimi_k25 (its configs/kimi_k25.py and models/kimi_k25.py):
    the language model under text_config / language_model., the decoder layers where capture hooks them, and the
    reference engine runs the same network as the unwrapped DeepSeek."""
    from eagle3kit.capture.server import decoder_layer_template
    from eagle3kit.target import TargetInfo, load_model, resolve_target

    kimi = resolve_target("embedded:kimi-k25-tiny")
    cfg = json.loads((kimi / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"] and cfg["model_type"] == "kimi_k25"
    assert cfg["text_config"]["architectures"] == ["DeepseekV3ForCausalLM"]  # deepseek_v2.py reads it
    v = cfg["vision_config"]
    assert v["vt_hidden_size"] == v["hidden_size"] and v["text_hidden_size"] == cfg["text_config"]["hidden_size"]
    assert (v["hidden_size"] // v["num_attention_heads"]) % 4 == 0 and cfg["media_placeholder_token_id"] < cfg[
        "text_config"]["vocab_size"]
    with safe_open(str(kimi / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert all(n.startswith("language_model.") for n in names)
    assert "language_model.model.layers.1.mlp.experts.0.gate_proj.weight" in names and "language_model.lm_head.weight" in names
    assert decoder_layer_template(kimi) == "language_model.model.layers.{}"
    assert decoder_layer_template(deepseek_tiny) == "model.layers.{}"
    info = TargetInfo.read(kimi)
    # the served class is the wrapper's, the layer geometry and the layer-id rule its language model's
    assert (info.architecture, info.model_type) == ("KimiK25ForConditionalGeneration", "deepseek_v3")
    assert (info.num_layers, info.hidden_size) == (cfg["text_config"]["num_hidden_layers"], cfg["text_config"]["hidden_size"])
    tok, wrapped = load_model(kimi)
    _, plain = load_model(deepseek_tiny)
    ids = tok("The same network inside the wrapper", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(wrapped(ids).logits, plain(ids).logits)
    out = tmp_path / "kimi-data"
    r = subprocess.run([sys.executable, "-m", "eagle3kit.cli", "extract", "--target", str(kimi), "--out", str(out),
                        "--max-samples", "3", "--max-tokens", "96"], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout)
    assert summary["written"] > 0 and summary["verify_problems"] == 0 and summary["layer_ids"][-1] == info.num_layers
    # the trainer's target head (final norm, lm_head) under the wrapper's names is the language model's own, by value:
    # 04 and 05 train and walk a drafter against it (params/{cpu,gpu}-kimi-tiny.yaml). The transformers SGLang 0.5.14
    # pins (5.8) does not know kimi_k25 (04 failed there on AutoConfig, gpu-family-kimi-tiny-3): neither may need it
    import transformers

    from eagle3kit.drafter.model import TargetHead, build, layer_config
    from eagle3kit.drafter.vocab import DraftVocab

    known = transformers.AutoConfig.from_pretrained.__func__

    def as_transformers_5_8(cls, path, *a, **kw):
        if json.loads((Path(path) / "config.json").read_text())["model_type"] == "kimi_k25":
            raise ValueError("The checkpoint you are trying to load has model type `kimi_k25` but Transformers does "
                             "not recognize this architecture.")
        return known(cls, path, *a, **kw)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", classmethod(as_transformers_5_8))
    with pytest.raises(ValueError, match="kimi_k25"):
        transformers.AutoConfig.from_pretrained(str(kimi))
    draft_cfg = layer_config(kimi)
    assert (draft_cfg.hidden_size, draft_cfg.vocab_size, draft_cfg.num_hidden_layers) == (info.hidden_size, info.vocab_size, 1)
    assert draft_cfg.rms_norm_eps == cfg["text_config"]["rms_norm_eps"]
    head = TargetHead.from_target(kimi)
    ids = torch.arange(0, info.vocab_size, 3)
    drafter = build(kimi, [1, 2, info.num_layers], DraftVocab(ids, info.vocab_size))  # speculators' loader asks AutoConfig
    assert torch.equal(drafter.embed_tokens.weight, wrapped.get_input_embeddings().weight)
    assert torch.equal(drafter.lm_head.weight, head.weight[ids].to(drafter.lm_head.weight.dtype))
    with safe_open(str(kimi / "model.safetensors"), "pt") as f:
        assert torch.equal(head.weight, f.get_tensor("language_model.lm_head.weight"))
        assert torch.equal(head.norm_weight, f.get_tensor("language_model.model.norm.weight"))
    assert not torch.equal(head.weight, wrapped.get_input_embeddings().weight)  # untied: the head, not the embedding


def test_tiny_kimi_ships_the_processor_sglang_builds_on(tmp_path):
    """SGLang 0.5.14 treats Kimi-K2.5 as multimodal (no flag turns it off) and its KimiK2_5VLImageProcessor reads
    ``.tokenizer``, ``.image_processor`` and ``.media_processor.media_proc_cfg`` of what AutoProcessor returns
    (multimodal/processors/kimi_k25.py). Without the folder's processor (or without trust_remote_code)
    AutoProcessor finds no image processor and SGLang cannot build one; with it (trust_remote_code, as Kimi-K2.5's
    own), every field is there and text is tokenized as by the tokenizer."""
    from transformers import AutoProcessor, AutoTokenizer

    from eagle3kit.target import resolve_target

    kimi = resolve_target("embedded:kimi-k25-tiny")
    proc = AutoProcessor.from_pretrained(kimi, trust_remote_code=True)
    cfg = proc.media_processor.media_proc_cfg
    assert {"patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side", "image_mean",
            "image_std"} <= set(cfg) and isinstance(cfg["merge_kernel_size"], int)
    assert hasattr(proc, "image_processor") and proc.chat_template
    tok = AutoTokenizer.from_pretrained(kimi)
    assert proc("the sea", return_tensors=None)["input_ids"] == tok("the sea")["input_ids"]
    with pytest.raises(NotImplementedError, match="text-only"):
        proc("an image", images=[object()])
    # without trust_remote_code (SGLang without --trust-remote-code), or without the folder's processor files,
    # transformers finds no image processor and refuses: no processor, with or without media fields
    with pytest.raises(OSError, match="image processor"):
        AutoProcessor.from_pretrained(kimi)
    bare = tmp_path / "no-processor"
    bare.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(kimi / name, bare / name)
    with pytest.raises(OSError, match="image processor"):
        AutoProcessor.from_pretrained(bare, trust_remote_code=True)


@pytest.mark.parametrize("family", ["qwen3", "llama_with_biases"])
def test_a_qwen3_or_biased_llama_target_gets_the_llama_draft_sglang_serves(family, tmp_path):
    """SGLang 0.5.14 serves every EAGLE-3 draft as LlamaForCausalLMEagle3: a Llama layer without biases. Before, a
    Qwen3 target kept speculators' Qwen3 layer (its config refused at build; past that, q_norm and k_norm trained and
    left out of the export, which SGLang runs without), and a Llama target with attention biases trained biases the
    export drops. Now both train a bias-free Llama layer, and an export refuses any trained tensor SGLang does not
    load (found by an audit)."""
    import transformers

    from eagle3kit.drafter import export as E
    from eagle3kit.drafter.model import build, layer_config
    from eagle3kit.drafter.vocab import DraftVocab

    geo = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
    if family == "qwen3":
        cfg, cls = transformers.Qwen3Config(head_dim=16, **geo), transformers.Qwen3ForCausalLM
    else:
        cfg, cls = transformers.LlamaConfig(attention_bias=True, mlp_bias=True, **geo), transformers.LlamaForCausalLM
    torch.manual_seed(0)
    target = tmp_path / "target"
    cls(cfg).save_pretrained(target)
    tl = layer_config(target)
    assert tl.model_type == "llama" and not tl.attention_bias and not tl.mlp_bias
    drafter = build(target, [1, 2, 3], DraftVocab(torch.arange(0, 256, 2), 256))
    trained = {n for n, p in drafter.named_parameters() if p.requires_grad and not n.startswith("embed_tokens")}
    assert trained <= set(E.sglang_names(3, False)), trained - set(E.sglang_names(3, False))
    E.sglang_tensors(drafter)  # every trained tensor goes to SGLang
    extra = torch.nn.Parameter(torch.ones(4))  # one SGLang would not load: refused, by name
    drafter.layers[0].self_attn.register_parameter("q_norm_weight", extra)
    with pytest.raises(E.ExportError, match=r"layers\.0\.self_attn\.q_norm_weight"):
        E.sglang_tensors(drafter)
