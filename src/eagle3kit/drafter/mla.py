"""The MLA EAGLE-3 head SGLang 0.5.14 serves as ``Eagle3DeepseekV2ForCausalLM`` (``models/kimi_k25_eagle3.py``), in
plain torch, with the module names ``ttt.draft_steps`` runs (``fc``, ``fc_norm``, ``embed_tokens``, ``rotary_emb``,
``layers``, ``norm``, ``lm_head``), so TTT, the draft vocabulary, the loss and the export stay as for the Llama head.

One step, as SGLang computes it (kimi_k25_eagle3.py:149-185, 273-299; deepseek_v2.py:1476-1708 and
deepseek_common/attention_forward_methods/forward_mla.py for the attention):

    h0 = fc(cat_i fc_norm_i(aux_i))            (fc, fc_norm only on the first step: the input is n_aux x wide)
    x  = cat([input_layernorm(embed), hidden_norm(h0)])                               [2H]
    q  = q_b_proj(q_a_layernorm(q_a_proj(x)))  per head [qk_nope | qk_rope]
    c, k_pe = kv_a_proj_with_mqa(x)            [kv_lora | qk_rope]  (k_pe: one head, shared; never normed)
    k_nope, v = kv_b_proj(kv_a_layernorm(c))   per head [qk_nope | v_head]
    rope on q's and k_pe's rope part only (interleaved pairs unless ``rope_interleave: false``; DeepSeek-YaRN when the
    config has rope scaling, its cos/sin times mscale(factor, mscale) / mscale(factor, mscale_all_dim))
    attention with scale qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under rope scaling
    r  = o_proj(attn) + h0;  out = mlp(post_attention_layernorm(r)) + r
    logits = lm_head(norm(out));  next step's h = norm(out) if norm_output else out

SGLang runs the attention absorbed (``w_kc``/``w_vc`` split from ``kv_b_proj``, scores against the cached latent
``[kv_a_layernorm(c), rope(k_pe)]``); it is the same product re-associated, which ``tests/test_drafter_mla.py``
checks against this non-absorbed form. SGLang fuses ``q_a_proj`` and ``kv_a_proj_with_mqa`` on load (in that order)
and splits ``kv_b_proj`` after it; the checkpoint keeps the separate names (see ``export``).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

ARCH = "Eagle3DeepseekV2ForCausalLM"
MLA_DIMS = ("num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim")
ROPE_TYPES = ("default", "yarn", "deepseek_yarn")  # SGLang runs every non-default rope of this head as deepseek_yarn
# (deepseek_v2.py:1539-1540); others would train one rope and serve another


class MLAError(ValueError):
    pass


@dataclass
class MLAConfig:
    """The draft's geometry and options: the keys of its SGLang config.json (``export.mla_sglang_config``)."""
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    vocab_size: int
    draft_vocab_size: int
    eagle_aux_hidden_state_layer_ids: list = field(default_factory=list)  # input_of_layer (eagle3kit's convention)
    target_hidden_size: int = 0
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    rope_interleave: bool = True
    fc_norm: bool = False
    norm_output: bool = False
    attn_implementation: str = "sdpa"

    def __post_init__(self):
        self.target_hidden_size = self.target_hidden_size or self.hidden_size
        rope = dict(self.rope_parameters or {})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        if rope["rope_type"] not in ROPE_TYPES:
            raise MLAError(f"rope_type {rope['rope_type']!r}: SGLang 0.5.14 runs any rope scaling of an MLA draft as "
                           f"DeepSeek-YaRN; train with default or yarn rope ({ROPE_TYPES})")
        self.rope_parameters = rope
        if self.hidden_act != "silu":
            raise MLAError(f"hidden_act {self.hidden_act!r}: SGLang's DeepseekV2MLP runs silu only")
        # ttt.draft_steps, flex.uses_flex and the export read these, as on speculators' config
        self.transformer_layer_config = SimpleNamespace(_attn_implementation=self.attn_implementation,
                                                        num_hidden_layers=1)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rope_scaling(self) -> dict | None:
        """SGLang's ``rope_scaling`` for this head: None for default rope, else the rope dict (deepseek_yarn)."""
        return None if self.rope_parameters["rope_type"] == "default" else self.rope_parameters

    def softmax_scale(self) -> float:
        """deepseek_v2.py:1533 and 1645-1646 (model_config.py:1820-1838): qk_head_dim^-0.5, times
        yarn_mscale(factor, mscale_all_dim)^2 under rope scaling (unless apply_yarn_scaling/apply_scale is false)."""
        scale = self.qk_head_dim ** -0.5
        rs = self.rope_scaling
        if rs and rs.get("apply_yarn_scaling", True) and rs.get("apply_scale", True):
            m = yarn_mscale(rs.get("factor", 1.0), float(rs.get("mscale_all_dim", 0.0) or 0.0))
            scale *= m * m
        return scale

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("attn_implementation")
        return d


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """SGLang's ``yarn_get_mscale`` (rotary_embedding/yarn.py:59-62)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def config_from_target(target_path, aux_layer_ids, draft_vocab_size: int, fc_norm: bool = False,
                       norm_output: bool = False, overrides: dict | None = None,
                       attn_implementation: str = "sdpa") -> MLAConfig:
    """The draft's MLA geometry: the target's own where the target is MLA (DeepSeek-V3, Kimi-K2.x: ``kv_lora_rank``
    in its language model's config), else every ``MLA_DIMS`` key from ``overrides`` (a clear error names the
    missing ones). ``overrides`` (``mla_<key>`` train settings without the prefix) win over the target's values."""
    from eagle3kit.family import language_model_config

    tc = language_model_config(Path(target_path)).to_dict()
    over = {k: v for k, v in (overrides or {}).items() if v is not None}
    is_mla = bool(tc.get("kv_lora_rank"))
    dims = {k: over.get(k, tc.get(k) if is_mla else None) for k in MLA_DIMS}
    missing = [k for k, v in dims.items() if not v]
    if missing:
        raise MLAError(f"drafter=mla on target {target_path} ({tc.get('model_type')}, not MLA"
                       f"{' or without ' + ', '.join(missing) if is_mla else ''}): set "
                       f"{', '.join('mla_' + k for k in missing)} (e.g. --set mla_{missing[0]}=...)")
    rope = tc.get("rope_parameters") or ({"rope_type": "default", "rope_theta": tc.get("rope_theta", 10000.0)}
                                         | dict(tc.get("rope_scaling") or {}))
    return MLAConfig(hidden_size=tc["hidden_size"], intermediate_size=over.get("intermediate_size",
                     tc.get("intermediate_size") or 4 * tc["hidden_size"]),
                     vocab_size=tc["vocab_size"], draft_vocab_size=int(draft_vocab_size),
                     eagle_aux_hidden_state_layer_ids=[int(k) for k in aux_layer_ids],
                     rms_norm_eps=tc.get("rms_norm_eps", 1e-6), hidden_act=tc.get("hidden_act", "silu"),
                     max_position_embeddings=tc.get("max_position_embeddings", 4096), rope_parameters=rope,
                     rope_interleave=bool(tc.get("rope_interleave", True)) if is_mla else True, fc_norm=fc_norm,
                     norm_output=norm_output, attn_implementation=attn_implementation, **dims)


class RMSNorm(torch.nn.Module):
    """SGLang's RMSNorm (layernorm.py forward_native): in fp32, cast back, times the weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class MLARotary(torch.nn.Module):
    """cos/sin [B, S, rope/2] of SGLang's rope for this head: plain (``get_rope``) or DeepSeek-YaRN
    (rope_variant.py:334-420: inv_freq blended by the ramp between the correction dims, cos/sin times mscale)."""

    def __init__(self, cfg: MLAConfig):
        super().__init__()
        r, rp = cfg.qk_rope_head_dim, cfg.rope_parameters
        base = float(rp.get("rope_theta", 10000.0))
        pos_freqs = base ** (torch.arange(0, r, 2, dtype=torch.float) / r)
        inv = 1.0 / pos_freqs
        self.mscale = 1.0
        rs = cfg.rope_scaling
        if rs:
            factor = float(rs.get("factor", 1.0))
            orig = rs.get("original_max_position_embeddings", cfg.max_position_embeddings)
            low, high = _yarn_range(rs.get("beta_fast", 32), rs.get("beta_slow", 1), r, base, orig)
            ramp = torch.clamp((torch.arange(r // 2, dtype=torch.float) - low) / ((high - low) or 0.001), 0, 1)
            mask = (1 - ramp) * rs.get("extrapolation_factor", 1)
            inv = inv / factor * (1 - mask) + inv * mask
            self.mscale = (yarn_mscale(factor, float(rs.get("mscale", 1))) /
                           yarn_mscale(factor, float(rs.get("mscale_all_dim", 0) or 0)) * rs.get("attn_factor", 1))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        f = position_ids.float()[..., None] * self.inv_freq
        return f.cos() * self.mscale, f.sin() * self.mscale


def _yarn_range(beta_fast, beta_slow, dim, base, max_pos):
    def d(rot):
        return dim * math.log(max_pos / (rot * 2 * math.pi)) / (2 * math.log(base))
    return max(math.floor(d(beta_fast)), 0), min(math.ceil(d(beta_slow)), dim - 1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [B, S, heads, r]; cos/sin [B, S, r/2]. ``interleave``: pairs (2i, 2i + 1) (SGLang's non-neox style, the
    default for DeepSeek/Kimi: ``is_neox_style = not rope_interleave``), else halves."""
    c, s = cos[:, :, None].to(x.dtype), sin[:, :, None].to(x.dtype)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class MLAAttention(torch.nn.Module):
    def __init__(self, cfg: MLAConfig, layer_idx: int = 0):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        h2, nh = 2 * cfg.hidden_size, cfg.num_attention_heads
        self.q_a_proj = torch.nn.Linear(h2, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = torch.nn.Linear(cfg.q_lora_rank, nh * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = torch.nn.Linear(h2, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = torch.nn.Linear(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = torch.nn.Linear(nh * cfg.v_head_dim, cfg.hidden_size, bias=False)
        self.scaling = cfg.softmax_scale()

    def forward(self, x, position_embeddings, attention_mask, past_key_values=None):
        c = self.cfg
        b, s, _ = x.shape
        nh, nope, rope = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, s, nh, c.qk_head_dim)
        q_nope, q_pe = q.split([nope, rope], dim=-1)
        ckv, k_pe = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(ckv)).view(b, s, nh, nope + c.v_head_dim)
        k_nope, v = kv.split([nope, c.v_head_dim], dim=-1)
        cos, sin = position_embeddings
        q_pe = apply_rope(q_pe, cos, sin, c.rope_interleave)
        k_pe = apply_rope(k_pe[:, :, None], cos, sin, c.rope_interleave).expand(b, s, nh, rope)
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)
        k = torch.cat([k_nope, k_pe], dim=-1).transpose(1, 2)
        v = v.transpose(1, 2)
        if past_key_values is not None:  # the keys of this row's earlier TTT steps (DynamicCache, flex.StepCache)
            k, v = past_key_values.update(k, v, self.layer_idx)
        from eagle3kit.drafter import flex

        if c.transformer_layer_config._attn_implementation == flex.IMPL:
            out = flex.attention(self, q, k, v, attention_mask, scaling=self.scaling)[0]
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=self.scaling)
            out = out.transpose(1, 2)
        return self.o_proj(out.reshape(b, s, nh * c.v_head_dim))


class MLP(torch.nn.Module):
    """SGLang's DeepseekV2MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.up_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MLADecoderLayer(torch.nn.Module):
    """SGLang's ``Eagle3MLADecoderLayer``; takes ``[embed, hidden]`` (2H) as speculators' first layer does and
    returns the pre-norm state ``mlp + residual`` (SGLang returns the two apart and sums them in ``norm``)."""

    def __init__(self, cfg: MLAConfig, layer_idx: int = 0):
        super().__init__()
        self.hidden_size = cfg.hidden_size
        self.self_attn = MLAAttention(cfg, layer_idx)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                cache_position=None, position_embeddings=None, **_):
        embeds, hidden = hidden_states.split(self.hidden_size, dim=-1)
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        r = self.self_attn(x, position_embeddings, attention_mask, past_key_values) + residual
        return self.mlp(self.post_attention_layernorm(r)) + r


class MLADraftModel(torch.nn.Module):
    """The drafter: modules named as ``ttt.draft_steps`` and the export read them (speculators' layout)."""

    def __init__(self, cfg: MLAConfig):
        super().__init__()
        self.config = cfg
        self.hidden_size = cfg.hidden_size
        self.draft_vocab_size = cfg.draft_vocab_size
        n = len(cfg.eagle_aux_hidden_state_layer_ids)
        self.embed_tokens = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # SGLang takes the target's (set_embed)
        self.fc = torch.nn.Linear(n * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.fc_norm = (torch.nn.ModuleList([RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(n)])
                        if cfg.fc_norm else None)
        self.layers = torch.nn.ModuleList([MLADecoderLayer(cfg, 0)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary_emb = MLARotary(cfg)
        self.register_buffer("d2t", None)  # set by load_vocab_mappings when the draft vocabulary is reduced
        self.register_buffer("t2d", None)

    def load_vocab_mappings(self, t2d: torch.Tensor, d2t: torch.Tensor) -> None:
        self.t2d, self.d2t = t2d.clone(), d2t.clone()

    def load_target_weights(self, target_path, vocab) -> None:
        """Embeddings, the draft lm_head (the target's rows of the draft vocabulary) and the final norm from the
        target's files, as the Llama head's ``_load_target_weights`` does."""
        from eagle3kit.drafter.model import target_tensors

        w = target_tensors(target_path)
        with torch.no_grad():
            self.embed_tokens.weight.copy_(w["embed_tokens.weight"])
            self.lm_head.weight.copy_(w["lm_head.weight"][vocab.ids])
            if "norm.weight" in w:
                self.norm.weight.copy_(w["norm.weight"])


def build(target_path, aux_layer_ids, vocab, fc_norm: bool = False, norm_output: bool = False,
          train_lm_head: bool = True, overrides: dict | None = None, attn_implementation: str = "sdpa",
          config: MLAConfig | None = None, seed: int | None = None) -> MLADraftModel:
    """An MLA drafter for ``target_path`` (``config``: a given geometry, e.g. an export's, instead of the
    target's)."""
    cfg = config or config_from_target(target_path, aux_layer_ids, vocab.size, fc_norm, norm_output, overrides,
                                       attn_implementation)
    if seed is not None:
        torch.manual_seed(seed)
    model = MLADraftModel(cfg)
    if vocab.size != vocab.vocab_size:
        model.load_vocab_mappings(vocab.t2d, vocab.d2t)
    model.load_target_weights(target_path, vocab)
    model.lm_head.weight.requires_grad_(train_lm_head)
    return model


def is_mla(model) -> bool:
    return isinstance(model, MLADraftModel)


def config_of_export(cfg: dict, attn_implementation: str = "sdpa", aux_layer_ids=None) -> MLAConfig:
    """An MLAConfig from an export's config.json (``aux_layer_ids``: the training layers, input_of_layer)."""
    keys = {k: cfg[k] for k in ("hidden_size", "intermediate_size", *MLA_DIMS, "vocab_size", "draft_vocab_size",
                                "rms_norm_eps", "hidden_act", "max_position_embeddings", "rope_interleave")
            if k in cfg}
    rope = cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0)}
    ids = aux_layer_ids or cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    return MLAConfig(**keys, eagle_aux_hidden_state_layer_ids=list(ids), rope_parameters=rope,
                     target_hidden_size=cfg.get("target_hidden_size") or cfg["hidden_size"],
                     fc_norm=bool(cfg.get("fc_norm") or cfg.get("use_aux_norm")),
                     norm_output=bool(cfg.get("norm_output")), attn_implementation=attn_implementation)


def read_config(path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


# Kimi-K2.5's language model (its config.json ``text_config``, the DeepSeek-V3 layout): the geometry the draft KV
# comparison is priced at
KIMI_K25_TEXT = {"hidden_size": 7168, "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536,
                 "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                 "intermediate_size": 18432, "vocab_size": 163840}


def draft_kv_bytes_per_token(config: dict, dtype_bytes: int = 2) -> int:
    """Bytes of draft KV cache one token takes in SGLang 0.5.14, from a draft's config.json: an MLA draft
    (``kv_lora_rank`` set: model_config.py:744 marks Eagle3DeepseekV2ForCausalLM MLA) holds one latent of
    kv_lora_rank + qk_rope_head_dim per layer (MLATokenToKVPool, memory_pool.py:2138-2142); a Llama draft K and V of
    num_key_value_heads x head_dim each (MHATokenToKVPool)."""
    layers = int(config.get("num_hidden_layers") or 1)
    if config.get("kv_lora_rank"):
        return layers * (int(config["kv_lora_rank"]) + int(config["qk_rope_head_dim"])) * dtype_bytes
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    return layers * 2 * kv_heads * head_dim * dtype_bytes


# SGLang's log line that confirms a pool's size on the GPU (memory_pool.py:1023 / 1029, one per pool: the target's,
# then the draft's): "KV Cache is allocated. dtype: ..., #tokens: N, KV size: G GB" (MLA) or "K size: .., V size: .."
KV_LOG_PATTERN = r"KV Cache is allocated\. dtype: (\S+), #tokens: (\d+), (?:KV size: ([\d.]+) GB|K size: ([\d.]+) GB, V size: ([\d.]+) GB)"


def kv_log_bytes_per_token(log_text: str) -> list[float]:
    """Bytes per token of every KV pool SGLang logged (in order: the target's, then the draft's), from its GB
    figures (2-digit rounding: use a pool of at least ~10 GB for a 1 % reading)."""
    import re

    out = []
    for m in re.finditer(KV_LOG_PATTERN, log_text):
        gb = float(m.group(3)) if m.group(3) else float(m.group(4)) + float(m.group(5))
        out.append(gb * (1 << 30) / int(m.group(2)))
    return out
