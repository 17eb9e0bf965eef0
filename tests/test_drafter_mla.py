"""The MLA EAGLE-3 head (drafter/mla.py) against SGLang 0.5.14's Eagle3DeepseekV2ForCausalLM, on a CPU.

The reference below is written from SGLang's equations (kimi_k25_eagle3.py, deepseek_v2.py's absorbed MLA: w_kc / w_vc
split from kv_b_proj, scores against the cached latent [kv_a_layernorm(c), rope(k_pe)]), token by token as a served
chain runs: step 0 sees the latents of its sample's positions <= t, step k also its own latents of steps 1..k.
Its rope is the complex product of interleaved pairs (SGLang's non-neox style), independent of mla.apply_rope.
"""
from __future__ import annotations

import json
import math
import re

import pytest
import torch

from eagle3kit.drafter import mla
from eagle3kit.drafter.ttt import draft_steps

SMALL = dict(hidden_size=32, intermediate_size=48, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=24,
             qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, vocab_size=50, draft_vocab_size=50,
             eagle_aux_hidden_state_layer_ids=[1, 2, 3], rope_parameters={"rope_type": "default", "rope_theta": 100.0})


def small_model(fc_norm=True, norm_output=False, seed=0, **kw):
    torch.manual_seed(seed)
    m = mla.MLADraftModel(mla.MLAConfig(**{**SMALL, **kw}, fc_norm=fc_norm, norm_output=norm_output)).double()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight") or ".fc_norm." in f".{name}":
                p.copy_(1 + 0.3 * torch.randn_like(p))  # norms that are not the identity
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    return m


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_ref(x, pos, theta, rope_on="rope"):
    """Interleaved pairs as complex numbers times e^(i pos theta_j), theta_j = base^(-2j/r)."""
    r = x.shape[-1]
    freqs = theta ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    z = torch.view_as_complex(x.reshape(*x.shape[:-1], r // 2, 2).contiguous())
    return torch.view_as_real(z * torch.polar(torch.ones_like(freqs), pos * freqs)).flatten(-2)


def reference(m, aux, ids, pos, steps, rope_on="rope", norm_output=None):
    """SGLang's chain, token by token, absorbed MLA. rope_on='nope' and norm_output=<flipped> are wrong variants."""
    c, sd = m.config, {k: v for k, v in m.state_dict().items()}
    eps, nh, nope, rr, kr = c.rms_norm_eps, c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
    theta = c.rope_parameters["rope_theta"]
    norm_output = c.norm_output if norm_output is None else norm_output
    a = "layers.0.self_attn."
    w_kc, w_vc = sd[a + "kv_b_proj.weight"].unflatten(0, (nh, nope + c.v_head_dim)).split([nope, c.v_head_dim], 1)
    n = aux.shape[0]
    chunks = aux.chunk(len(c.eagle_aux_hidden_state_layer_ids), -1)
    if c.fc_norm:
        chunks = [rms(x, sd[f"fc_norm.{i}.weight"], eps) for i, x in enumerate(chunks)]
    hidden = torch.cat(chunks, -1) @ sd["fc.weight"].T
    latents, logits = [], []  # latents[k][t]: (normed c [kr], rotated k_pe [rr]) of step k at row t
    for k in range(steps):
        emb = sd["embed_tokens.weight"][torch.cat([ids[k:], ids.new_zeros(k)])]
        x = torch.cat([rms(emb, sd["layers.0.input_layernorm.weight"], eps),
                       rms(hidden, sd["layers.0.hidden_norm.weight"], eps)], -1)
        q = (rms(x @ sd[a + "q_a_proj.weight"].T, sd[a + "q_a_layernorm.weight"], eps)
             @ sd[a + "q_b_proj.weight"].T).view(n, nh, nope + rr)
        ckv = x @ sd[a + "kv_a_proj_with_mqa.weight"].T
        lat = rms(ckv[:, :kr], sd[a + "kv_a_layernorm.weight"], eps)
        p = (pos + k).double()[:, None]
        if rope_on == "rope":
            q_nope, q_pe = q[..., :nope], rope_ref(q[..., nope:], p[:, :, None], theta)
            k_pe = rope_ref(ckv[:, kr:], p, theta)
        else:  # wrong: the rope rotates the first rope-width dims of the nope part instead
            q_nope, q_pe = torch.cat([rope_ref(q[..., :rr], p[:, :, None], theta), q[..., rr:nope]], -1), q[..., nope:]
            k_pe = ckv[:, kr:]
        latents.append((lat, k_pe))
        q_abs = torch.einsum("thn,hnc->thc", q_nope, w_kc)  # absorbed: q_nope . (w_kc c) = (q_nope w_kc) . c
        out = torch.zeros(n, nh, c.v_head_dim, dtype=torch.float64)
        for t in range(n):
            keys = [(latents[0][0][j], latents[0][1][j]) for j in range(t + 1)]
            keys += [(latents[i][0][t], latents[i][1][t]) for i in range(1, k + 1)]
            cs, kp = torch.stack([x for x, _ in keys]), torch.stack([y for _, y in keys])
            s = (q_abs[t] @ cs.T + q_pe[t] @ kp.T) * c.softmax_scale()
            o_lat = torch.softmax(s, -1) @ cs  # [nh, kr]
            out[t] = torch.einsum("hc,hvc->hv", o_lat, w_vc)
        r = out.reshape(n, -1) @ sd[a + "o_proj.weight"].T + hidden
        hh = rms(r, sd["layers.0.post_attention_layernorm.weight"], eps)
        mlp = (torch.nn.functional.silu(hh @ sd["layers.0.mlp.gate_proj.weight"].T) *
               (hh @ sd["layers.0.mlp.up_proj.weight"].T)) @ sd["layers.0.mlp.down_proj.weight"].T
        pre = mlp + r
        normed = rms(pre, sd["norm.weight"], eps)
        logits.append(normed @ sd["lm_head.weight"].T)
        hidden = normed if norm_output else pre
    return logits


def run_model(m, aux, ids, pos, steps):
    n = aux.shape[0]
    return list(draft_steps(m, aux, ids, torch.zeros(n, dtype=torch.long), pos, steps))


@pytest.mark.parametrize("fc_norm,norm_output", [(False, False), (True, True)])
def test_forward_equals_sglang_absorbed_reference(fc_norm, norm_output):
    m = small_model(fc_norm, norm_output)
    g = torch.Generator().manual_seed(1)
    n, steps = 7, 3
    aux, ids = torch.randn(n, 3 * 32, generator=g, dtype=torch.float64), torch.randint(0, 50, (n,), generator=g)
    pos = torch.arange(n) + 1
    got, want = run_model(m, aux, ids, pos, steps), reference(m, aux, ids, pos, steps)
    for k in range(steps):
        assert torch.allclose(got[k], want[k], atol=1e-5, rtol=0), (k, (got[k] - want[k]).abs().max())


def test_the_reference_comparison_catches_wrong_variants():
    """Rope on the nope part, or norm_output flipped, gives other logits (far past the 1e-5 the test above allows;
    SGLang keeps cos/sin in fp32, as mla.MLARotary does): the test above would fail on them."""
    m = small_model(True, False)
    g = torch.Generator().manual_seed(2)
    n, steps = 6, 2
    aux, ids = torch.randn(n, 3 * 32, generator=g, dtype=torch.float64), torch.randint(0, 50, (n,), generator=g)
    pos = torch.arange(n) + 3
    got = run_model(m, aux, ids, pos, steps)
    for variant in (dict(rope_on="nope"), dict(norm_output=True)):
        wrong = reference(m, aux, ids, pos, steps, **variant)
        assert (got[-1] - wrong[-1]).abs().max() > 1e-3, variant
    assert torch.allclose(got[-1], reference(m, aux, ids, pos, steps)[-1], atol=1e-5)


def test_softmax_scale_and_yarn_as_sglang_computes_them():
    # Kimi-K2.x rope: yarn, factor 64, mscale = mscale_all_dim = 1: scale = 192^-0.5 (0.1 ln 64 + 1)^2, cos/sin x 1
    yarn = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "beta_fast": 1.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096}
    c = mla.MLAConfig(**{**SMALL, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rope_parameters": yarn})
    assert c.softmax_scale() == pytest.approx(192 ** -0.5 * (0.1 * math.log(64) + 1) ** 2)
    assert mla.MLAConfig(**{**SMALL, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64}).softmax_scale() == \
        pytest.approx(192 ** -0.5)
    rot = mla.MLARotary(c)
    plain = 1.0 / 50000.0 ** (torch.arange(0, 64, 2).float() / 64)
    assert rot.mscale == pytest.approx(1.0)
    assert torch.allclose(rot.inv_freq[:5], plain[:5])  # fast dims extrapolated
    assert torch.allclose(rot.inv_freq[-5:], plain[-5:] / 64)  # slow dims interpolated by the factor
    with pytest.raises(mla.MLAError, match="DeepSeek-YaRN"):
        mla.MLAConfig(**{**SMALL, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}})


def test_geometry_from_an_mla_target_and_a_clear_error_otherwise():
    from eagle3kit.target import resolve_target

    cfg = mla.config_from_target(resolve_target("embedded:deepseek-v3-tiny"), [2, 4, 5], 64)
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.q_lora_rank, cfg.num_attention_heads) == (512, 64, 256, 4)
    with pytest.raises(mla.MLAError, match=r"not MLA.*mla_num_attention_heads, mla_q_lora_rank"):
        mla.config_from_target(resolve_target("embedded:smollm2"), [2, 15, 26], 64)
    dims = dict(num_attention_heads=3, q_lora_rank=32, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=16)
    c = mla.config_from_target(resolve_target("embedded:smollm2"), [2, 15, 26], 64, overrides=dims)
    assert (c.hidden_size, c.num_attention_heads, c.kv_lora_rank) == (576, 3, 64)


def test_train_settings_choose_the_mla_head():
    from eagle3kit.drafter.train import TrainConfig, TrainError

    c = TrainConfig.from_dict({"data": "d", "out_dir": "o", "drafter": "mla", "eagle31": True, "mla_q_lora_rank": 8})
    assert c.use_fc_norm and c.use_norm_output and c.mla_overrides()["q_lora_rank"] == 8
    with pytest.raises(TrainError, match="drafter='gqa'"):
        TrainConfig.from_dict({"data": "d", "out_dir": "o", "drafter": "gqa"})
    with pytest.raises(TrainError, match="mla_\\* settings apply to drafter=mla"):
        TrainConfig.from_dict({"data": "d", "out_dir": "o", "mla_q_lora_rank": 8})
    with pytest.raises(TrainError, match="exactly one layer"):
        TrainConfig.from_dict({"data": "d", "out_dir": "o", "drafter": "mla", "num_layers": 2})


# ---- export: the contract of SGLang 0.5.14's Eagle3DeepseekV2ForCausalLM.load_weights (kimi_k25_eagle3.py:413-486)
# Its parameters (named_parameters of the module tree built in __init__, deepseek_v2.py:1544-1631 with the fused
# projection replaced at kimi_k25_eagle3.py:116-122), for n aux states:
def sglang_params(n_aux: int, fc_norm: bool) -> set:
    a = "model.midlayer.self_attn."
    p = {"model.embed_tokens.weight", "model.fc.weight", "model.norm.weight", "lm_head.weight",
         a + "fused_qkv_a_proj_with_mqa.weight", a + "q_a_layernorm.weight", a + "q_b_proj.weight",
         a + "kv_b_proj.weight", a + "o_proj.weight", a + "kv_a_layernorm.weight",
         "model.midlayer.mlp.gate_up_proj.weight", "model.midlayer.mlp.down_proj.weight",
         "model.midlayer.input_layernorm.weight", "model.midlayer.hidden_norm.weight",
         "model.midlayer.post_attention_layernorm.weight"}
    return p | ({f"model.fc_norm.{i}.weight" for i in range(n_aux)} if fc_norm else set())


def sglang_load(names, params) -> tuple[set, set]:
    """(parameters loaded, names skipped) as load_weights maps checkpoint names: d2t/t2d apart; layers.0. ->
    midlayer., model. prefixed except lm_head.; gate/up_proj stacked; q_a_proj + kv_a_proj_with_mqa fused only when
    both arrive; anything else not a parameter is skipped with a warning."""
    loaded, skipped, cached = set(), set(), set()
    for name in names:
        if name in ("d2t", "t2d"):
            continue
        m = re.sub(r"^layers\.0\.", "midlayer.", name)
        m = m if m.startswith("lm_head.") else f"model.{m}"
        stacked = next((m.replace(w, ".gate_up_proj") for w in (".gate_proj", ".up_proj") if w in m), None)
        if stacked and stacked in params:
            loaded.add(stacked)
            continue
        if "q_a_proj" in m or "kv_a_proj_with_mqa" in m:
            cached.add(m)
            q_name, kv_name = m.replace("kv_a_proj_with_mqa", "q_a_proj"), m.replace("q_a_proj", "kv_a_proj_with_mqa")
            if q_name in cached and kv_name in cached:
                fused = q_name.replace("q_a_proj", "fused_qkv_a_proj_with_mqa")
                if fused in params:
                    loaded.add(fused)
                cached -= {q_name, kv_name}
            continue
        (loaded if m in params else skipped).add(m if m in params else name)
    return loaded, skipped


@pytest.fixture(scope="module")
def deepseek_export(tmp_path_factory):
    from eagle3kit.drafter import vocab as V
    from eagle3kit.drafter.export import to_sglang
    from eagle3kit.target import resolve_target

    target = resolve_target("embedded:deepseek-v3-tiny")
    freq = torch.arange(49152).flip(0)
    voc = V.build(freq, 300)
    m = mla.build(target, [2, 4, 5], voc, fc_norm=True, norm_output=True, seed=0)
    with torch.no_grad():  # bf16-exact weights (the export is bf16), not the initial ones
        for name, p in m.named_parameters():
            if name.startswith("embed_tokens"):  # frozen: the target's, as SGLang takes them
                continue
            p.copy_((p + 0.02 * torch.randn_like(p)).bfloat16().float())
    dest = to_sglang(m, voc, tmp_path_factory.mktemp("mla") / "export", target, [2, 4, 5])
    return m, dest, target


def test_export_round_trip_and_sglang_name_contract(deepseek_export):
    from safetensors.torch import load_file

    from eagle3kit.doctor import mla_expected_tensors
    from eagle3kit.drafter.export import load_sglang_export

    m, dest, target = deepseek_export
    cfg = json.loads((dest / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and cfg["num_hidden_layers"] == 1
    assert cfg["q_lora_rank"] == 256 and cfg["kv_lora_rank"] == 512 and cfg["draft_vocab_size"] == 300
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # DeepSeek: input_of_layer as-is
    assert cfg["tie_word_embeddings"] is False and cfg["fc_norm"] and cfg["norm_output"]
    from transformers import AutoConfig  # SGLang parses it with transformers' config class of model_type

    hf = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    assert (hf.q_lora_rank, hf.kv_lora_rank, hf.rope_parameters["rope_type"]) == (256, 512, "default")
    tensors = load_file(str(dest / "model.safetensors"))
    params = sglang_params(3, True)
    loaded, skipped = sglang_load(list(tensors), params)
    assert not skipped and loaded == params - {"model.embed_tokens.weight"}  # embeddings: the target's (set_embed)
    assert {k: (tuple(v.shape), str(v.dtype)[6:]) for k, v in tensors.items()} == mla_expected_tensors(cfg)
    back, _, _ = load_sglang_export(dest, target)
    g = torch.Generator().manual_seed(3)
    n = 9
    aux, ids = torch.randn(n, 3 * 256, generator=g), torch.randint(0, 49152, (n,), generator=g)
    with torch.no_grad():
        a, b = run_model(m, aux, ids, torch.arange(n), 2), run_model(back, aux, ids, torch.arange(n), 2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_the_name_contract_catches_what_sglang_would_skip():
    params = sglang_params(3, False)
    ok = ["fc.weight", "layers.0.self_attn.q_a_proj.weight", "layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    assert sglang_load(ok, params)[0] >= {"model.fc.weight", "model.midlayer.self_attn.fused_qkv_a_proj_with_mqa.weight"}
    _, skipped = sglang_load(["midlayer.self_attn.q_proj.weight", "layers.0.self_attn.q_a_proj.weight"], params)
    assert "midlayer.self_attn.q_proj.weight" in skipped  # a Llama-style q_proj: not a parameter of this head
    lonely, _ = sglang_load(["layers.0.self_attn.q_a_proj.weight"], params)
    assert not lonely  # q_a_proj without kv_a_proj_with_mqa is never fused, never loaded


def test_speculators_format_refuses_mla(deepseek_export, tmp_path):
    from eagle3kit.drafter.export import ExportError, to_speculators

    with pytest.raises(ExportError, match="MLA drafter exports to SGLang only"):
        to_speculators(deepseek_export[0], tmp_path / "spec")


def test_doctor_passes_the_export_and_flags_a_broken_one(deepseek_export, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from eagle3kit.doctor import check_mla, check_options

    _, dest, _ = deepseek_export
    cfg = json.loads((dest / "config.json").read_text())
    assert all(f.level == "ok" for f in check_mla(dest, cfg))
    assert check_options(cfg, {"train": {"eagle31": True}})[0].level == "ok"
    flipped = check_options({**cfg, "norm_output": False}, {"train": {"eagle31": True}})
    assert flipped[0].level == "error" and "norm_output=False" in flipped[0].what
    bad = tmp_path / "bad"
    shutil.copytree(dest, bad)
    t = load_file(str(bad / "model.safetensors"))
    t["layers.0.self_attn.q_proj.weight"] = t.pop("layers.0.self_attn.q_a_proj.weight")
    t["layers.0.mlp.down_proj.weight"] = t["layers.0.mlp.down_proj.weight"][:, :-1].contiguous()
    save_file(t, str(bad / "model.safetensors"))
    msgs = " ".join(f.what for f in check_mla(bad, {**cfg, "rope_parameters": {"rope_type": "linear"}}))
    for want in ("uninitialised", "would skip", "shape or dtype", "DeepSeek-YaRN"):
        assert want in msgs


def test_draft_kv_bytes_at_kimi_k25_geometry():
    from eagle3kit.drafter.model import _as_llama
    from transformers import DeepseekV3Config

    kimi = mla.KIMI_K25_TEXT
    mla_bytes = mla.draft_kv_bytes_per_token({**kimi, "num_hidden_layers": 1})
    assert mla_bytes == (512 + 64) * 2
    # the Llama head eagle3kit builds for this target (model._as_llama: its heads, hidden / heads wide)
    llama = _as_llama(DeepseekV3Config(**kimi)).to_dict()
    llama_bytes = mla.draft_kv_bytes_per_token({**llama, "num_hidden_layers": 1})
    assert llama_bytes == 2 * 64 * 112 * 2 and llama_bytes / mla_bytes == pytest.approx(24.9, abs=0.05)
    log = ("KV Cache is allocated. dtype: torch.bfloat16, #tokens: 1000000, KV size: 1.07 GB\n"
           "KV Cache is allocated. dtype: torch.bfloat16, #tokens: 10000, K size: 0.13 GB, V size: 0.13 GB")
    got = mla.kv_log_bytes_per_token(log)
    assert got[0] == pytest.approx(1152, rel=0.01) and got[1] == pytest.approx(27917, rel=0.01)


def test_load_proof_reads_the_mla_parameters_sglang_holds(deepseek_export):
    """proof.compare_params on parameters named and fused as SGLang's Eagle3MLAModel holds them (what drafthook saves):
    none unloaded; one corrupted tensor is counted."""
    from safetensors.torch import load_file
    from speculators.utils.loading import load_model_layers

    from eagle3kit.acceptance import proof

    _, dest, target = deepseek_export
    t = load_file(str(dest / "model.safetensors"))
    held = {k: v for k, v in proof.expected_params(dest).items()}
    assert {("model." + k if k != "lm_head.weight" else k) for k in held} == sglang_params(3, True) - {
        "model.embed_tokens.weight"}
    held["embed_tokens.weight"] = load_model_layers(["embed_tokens.weight"], str(target))["embed_tokens.weight"]
    assert proof.compare_params(held, dest, target)["export_params_unloaded"] == 0
    held["midlayer.self_attn.fused_qkv_a_proj_with_mqa.weight"] = torch.cat(
        [t["layers.0.self_attn.kv_a_proj_with_mqa.weight"], t["layers.0.self_attn.q_a_proj.weight"]])  # wrong order
    assert proof.compare_params(held, dest, target)["export_params_unloaded"] == 1
