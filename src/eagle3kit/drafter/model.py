"""The drafter (speculators' ``Eagle3DraftModel``) configured to the network SGLang 0.5.14 runs, and the teacher.

SGLang's ``LlamaForCausalLMEagle3`` reads neither ``norm_before_residual`` nor ``norm_before_fc`` nor a draft's
sliding window (../shared/notes/drafter-sources.md §1.1, §1.3): a drafter trained with any of them is run as a
different network, silently. speculators turns all three on by default; here they are always off, and
``SGLANG_UNSUPPORTED`` is what the doctor refuses in an export. ``fc_norm`` and ``norm_output`` are read by SGLang.

The teacher is the target's own head: its final norm applied to the captured final state (the last slot, the
last layer's output *before* the norm), then its full ``lm_head`` (tied to the embeddings for SmolLM2). The full
vocabulary matters: the target's greedy token may lie outside the draft vocabulary, and acceptance counts it.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

# config keys of speculators' Eagle3 that SGLang 0.5.14 ignores, and the value SGLang's network has
SGLANG_UNSUPPORTED = {"norm_before_residual": False, "norm_before_fc": False}


class DrafterError(ValueError):
    pass


def layer_config(target_path, num_layers: int = 1, attn_implementation: str = "sdpa"):
    """The draft decoder's transformers config: the target's geometry, ``num_layers`` layers, full attention."""
    from eagle3kit.family import language_model_config

    cfg = copy.deepcopy(language_model_config(target_path))  # a multimodal wrapper's language model (Kimi-K2.5)
    # SGLang serves every EAGLE-3 draft as LlamaForCausalLMEagle3: a Llama layer without biases. Another family's
    # layer (speculators' Qwen3 one has q_norm and k_norm) would train parameters the export cannot carry, and a
    # Llama target with attention or MLP biases would train biases SGLang's draft layer does not have
    if cfg.model_type != "llama":
        cfg = _as_llama(cfg)
    cfg.attention_bias = cfg.mlp_bias = False
    cfg.num_hidden_layers = num_layers
    cfg._attn_implementation = attn_implementation
    for k in ("sliding_window", "layer_types", "use_sliding_window", "max_window_layers"):
        if hasattr(cfg, k):
            setattr(cfg, k, None)
    return cfg


def _as_llama(cfg):
    """A Llama decoder config of the target's width (DeepSeek/Kimi targets get a Llama-style draft head, which
    SGLang serves as LlamaForCausalLMEagle3 beside any target)."""
    from transformers import LlamaConfig

    heads = cfg.num_attention_heads
    return LlamaConfig(hidden_size=cfg.hidden_size, intermediate_size=getattr(cfg, "intermediate_size", 4 * cfg.hidden_size),
                       num_attention_heads=heads, num_key_value_heads=getattr(cfg, "num_key_value_heads", heads) or heads,
                       head_dim=cfg.hidden_size // heads, vocab_size=cfg.vocab_size, rms_norm_eps=cfg.rms_norm_eps,
                       max_position_embeddings=cfg.max_position_embeddings, hidden_act="silu",
                       rope_parameters={"rope_type": "default", "rope_theta": getattr(cfg, "rope_theta", 10000.0)})


def build(target_path, aux_layer_ids, vocab, num_layers: int = 1, fc_norm: bool = False, norm_output: bool = False,
          train_lm_head: bool = True, ttt_steps: int = 3, attn_implementation: str = "sdpa"):
    """A speculators ``Eagle3DraftModel`` for ``target_path``: embeddings and the initial draft ``lm_head`` (the
    target's rows of the draft vocabulary) from the target; ``aux_layer_ids`` in eagle3kit's input_of_layer
    convention (speculators' own)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    tl = layer_config(target_path, num_layers, attn_implementation)
    arch = json.loads((Path(target_path) / "config.json").read_text()).get("architectures") or []
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=vocab.size, fc_norm=fc_norm, norm_output=norm_output,
        eagle_aux_hidden_state_layer_ids=[int(k) for k in aux_layer_ids], **SGLANG_UNSUPPORTED,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=ttt_steps)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=str(target_path), architectures=arch)))
    _quiet_speculators()
    model = Eagle3DraftModel(config)
    if vocab.size != vocab.vocab_size:
        model.load_vocab_mappings(vocab.t2d, vocab.d2t)
    _load_target_weights(model)
    model.lm_head.weight.requires_grad_(train_lm_head)
    check_servable(model.config)
    return model


def _load_target_weights(model) -> None:
    """What ``Eagle3DraftModel.load_verifier_weights`` does (embeddings, ``lm_head[t2d]``, the final norm from the
    target's files; the embeddings' trainability) without its ``AutoConfig.from_pretrained(target)``, which the
    transformers SGLang 0.5.14 pins (5.8) refuses for a kimi_k25 wrapper (04 failed there, gpu-family-kimi-tiny-4).
    That call served only a hidden-size check, which cannot fail here: ``layer_config`` sizes the draft from the
    target's own language model."""
    from speculators.models.eagle3 import Eagle3DraftModel

    super(Eagle3DraftModel, model).load_verifier_weights()  # the base loader: load_model_layers on the target's files
    model.embed_tokens.weight.requires_grad_(model.config.embed_requires_grad)


def _quiet_speculators():
    try:
        from loguru import logger

        logger.disable("speculators")
    except ImportError:
        pass


def check_servable(config) -> None:
    """Refuse a drafter SGLang 0.5.14 would run as another network."""
    from eagle3kit.layers import sliding_window

    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    bad = [f"{k}={get(k)}" for k, ok in SGLANG_UNSUPPORTED.items() if bool(get(k, ok)) != ok]
    tl = get("transformer_layer_config")
    tl_get = (tl.get if isinstance(tl, dict) else (lambda k, d=None: getattr(tl, k, d))) if tl is not None else None
    if tl is not None and sliding_window(tl):
        bad.append(f"sliding_window={tl_get('sliding_window')}")
    if bad:
        raise DrafterError(f"the drafter uses {', '.join(bad)}, which SGLang 0.5.14's LlamaForCausalLMEagle3 does not "
                           f"read: it would run a different network without a warning. Fix: train with "
                           f"norm_before_residual=False, norm_before_fc=False and full attention (fc_norm and "
                           f"norm_output are supported)")


def target_tensors(target_path) -> dict:
    """The target's embeddings, ``lm_head`` (the embeddings when tied) and final norm, by suffix from its files (a
    multimodal wrapper's ``language_model.`` prefix included)."""
    from speculators.utils.loading import load_model_layers

    _quiet_speculators()
    w = load_model_layers(["embed_tokens.weight", "lm_head.weight", "model.norm.weight"], str(target_path))
    if "embed_tokens.weight" not in w:
        raise DrafterError(f"{target_path}: no embeddings (embed_tokens.weight) in the target's files")
    return {"embed_tokens.weight": w["embed_tokens.weight"],
            "lm_head.weight": w.get("lm_head.weight", w["embed_tokens.weight"]),
            **({"norm.weight": w["model.norm.weight"]} if "model.norm.weight" in w else {})}


def trainable_state(model) -> dict:
    """What training changes (and checkpoints hold): every parameter that requires a gradient."""
    return {k: v for k, v in model.state_dict().items()
            if k in {n for n, p in model.named_parameters() if p.requires_grad}}


class TargetHead(torch.nn.Module):
    """The target's final norm and full ``lm_head``: target logits from the captured final (pre-norm) state.
    ``final_normed``: the final slot already is the norm's output (a capture inside SGLang's prefill graph, recorded
    ``final_slot: post_norm``): only the ``lm_head`` is applied."""

    def __init__(self, norm_weight: torch.Tensor, lm_head_weight: torch.Tensor, eps: float):
        super().__init__()
        self.register_buffer("norm_weight", norm_weight.detach().clone())
        self.register_buffer("weight", lm_head_weight.detach().clone())
        self.eps = eps
        self.final_normed = False
        self.source: tuple | None = None  # where the weights came from (from_target): known_greedy_tokens's key

    @classmethod
    def from_target(cls, target_path) -> "TargetHead":
        from speculators.utils.loading import load_model_layers

        _quiet_speculators()
        w = load_model_layers(["embed_tokens.weight", "lm_head.weight", "model.norm.weight"], str(target_path))
        if "model.norm.weight" not in w:
            raise DrafterError(f"{target_path}: no final norm weight (model.norm.weight) in the target's files")
        cfg = layer_config(target_path)
        head = cls(w["model.norm.weight"], w.get("lm_head.weight", w["embed_tokens.weight"]), cfg.rms_norm_eps)
        files = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(Path(target_path).glob("*.safetensors"))]
        head.source = (str(Path(target_path).resolve()), *files)
        return head

    def placed(self, device) -> "TargetHead":
        """On ``device``; float32 on a CPU (bf16 matmuls are slow there), the stored dtype on a GPU."""
        head = self.to(device)
        return head.float() if torch.device(device).type == "cpu" else head

    def norm(self, h: torch.Tensor) -> torch.Tensor:
        x = h.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.norm_weight.float() * x).to(h.dtype)

    def logits(self, final: torch.Tensor) -> torch.Tensor:
        h = final if self.final_normed else self.norm(final)
        return h.to(self.weight.dtype) @ self.weight.T

    def draft_logits(self, final: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
        """``logits(final)[:, vocab_ids]`` from the draft vocabulary's rows of the head alone (kept after the first
        call: a run's draft vocabulary does not change)."""
        if getattr(self, "_draft", None) is None or self._draft[0] is not vocab_ids:
            self._draft = (vocab_ids, self.weight.index_select(0, vocab_ids))
        h = final if self.final_normed else self.norm(final)
        return h.to(self.weight.dtype) @ self._draft[1].T
