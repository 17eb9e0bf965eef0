"""Drafter checkpoints for serving: SGLang's ``LlamaForCausalLMEagle3`` and speculators' ``Eagle3Speculator``.

SGLang 0.5.14 (``models/llama_eagle3.py``; ../shared/notes/drafter-sources.md §1): config keys
``architectures: [LlamaForCausalLMEagle3]``, ``model_type: llama``, the decoder geometry, ``vocab_size`` (the
target's), ``draft_vocab_size`` (must be present), ``tie_word_embeddings: false`` (true would make the draft's
lm_head the target's embedding), ``eagle_config.eagle_aux_hidden_state_layer_ids`` in SGLang's convention for the
target's family (Llama/Qwen: output of layer k = our input_of_layer k+1; DeepSeek/Kimi: see ``layers``),
``norm_output``/``fc_norm``. Weights ``fc``, ``layers.0.*``, ``norm``, ``lm_head [N, H]``, ``d2t``, ``fc_norm.*``;
no ``embed_tokens`` (SGLang takes the target's). SGLang drops unknown names and leaves unloaded parameters
uninitialised without a word: only names it loads are written, and ``sglang_names`` is checked by a test.
``eagle3kit.json`` beside them records what the drafter was trained on (the doctor reads it).
"""
from __future__ import annotations

import copy
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3kit.drafter.checkpoint import load_checkpoint
from eagle3kit.layers import from_input_of_layer, sglang_convention, token_errors
from eagle3kit.store import publish

FORMAT = "eagle3kit-drafter/1"
KIND = "drafter export"  # the mark (``folders``) of every drafter folder written here
_LAYER0 = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
           "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
           "post_attention_layernorm.weight", "hidden_norm.weight")
_GEOMETRY = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "hidden_act", "rms_norm_eps", "max_position_embeddings", "vocab_size", "rope_theta", "rope_scaling",
             "rope_parameters", "attention_bias", "mlp_bias", "bos_token_id", "eos_token_id", "pad_token_id")


class ExportError(ValueError):
    pass


def sglang_names(num_aux: int, fc_norm: bool) -> list[str]:
    """The tensor names LlamaForCausalLMEagle3 loads for a one-layer draft (all of them: none optional)."""
    names = ["fc.weight", "norm.weight", "lm_head.weight", "d2t"] + [f"layers.0.{n}" for n in _LAYER0]
    return names + ([f"fc_norm.{i}.weight" for i in range(num_aux)] if fc_norm else [])


# the MLA head (drafter/mla.py): names Eagle3DeepseekV2ForCausalLM.load_weights maps onto its parameters
# (kimi_k25_eagle3.py:413-486: layers.0. -> model.midlayer., q_a_proj + kv_a_proj_with_mqa fused on load)
_MLA_LAYER0 = ("self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight",
               "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight",
               "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
               "input_layernorm.weight", "post_attention_layernorm.weight", "hidden_norm.weight")
MLA_MODEL_TYPE = "deepseek_v3"  # transformers' DeepseekV3Config parses the draft's config.json inside SGLang


def mla_sglang_names(num_aux: int, fc_norm: bool) -> list[str]:
    """The tensor names Eagle3DeepseekV2ForCausalLM loads for the MLA head (all of them; embeddings: the target's)."""
    names = ["fc.weight", "norm.weight", "lm_head.weight", "d2t"] + [f"layers.0.{n}" for n in _MLA_LAYER0]
    return names + ([f"fc_norm.{i}.weight" for i in range(num_aux)] if fc_norm else [])


def mla_sglang_config(model, target_path, aux_layer_ids) -> dict:
    """config.json of the MLA head's SGLang export (kimi_k25_eagle3.py reads these keys; model_config.py:744 marks
    the architecture MLA, so the draft's KV pool and attention backend are MLA's)."""
    from eagle3kit.target import TargetInfo

    c = model.config
    info = TargetInfo.read(Path(target_path))
    sg_ids = from_input_of_layer(aux_layer_ids, sglang_convention(info.model_type), info.num_layers)
    return {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": MLA_MODEL_TYPE, "num_hidden_layers": 1,
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_attention_heads,
            "q_lora_rank": c.q_lora_rank, "kv_lora_rank": c.kv_lora_rank, "qk_nope_head_dim": c.qk_nope_head_dim,
            "qk_rope_head_dim": c.qk_rope_head_dim, "v_head_dim": c.v_head_dim, "hidden_act": c.hidden_act,
            "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": c.max_position_embeddings,
            "rope_parameters": dict(c.rope_parameters), "rope_interleave": bool(c.rope_interleave),
            "target_hidden_size": c.target_hidden_size, "vocab_size": int(info.vocab_size),
            "draft_vocab_size": int(model.draft_vocab_size), "tie_word_embeddings": False, "bias": False,
            "torch_dtype": "bfloat16", "fc_norm": bool(c.fc_norm), "norm_output": bool(c.norm_output),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": sg_ids, "use_aux_hidden_state": True}}


def export_names(model) -> list[str]:
    from eagle3kit.drafter.mla import is_mla

    n, fc = len(model.config.eagle_aux_hidden_state_layer_ids), bool(model.config.fc_norm)
    return mla_sglang_names(n, fc) if is_mla(model) else sglang_names(n, fc)


def sglang_config(model, target_path, aux_layer_ids) -> dict:
    """config.json of the SGLang export."""
    from eagle3kit.drafter.mla import is_mla
    from eagle3kit.target import TargetInfo

    if is_mla(model):
        return mla_sglang_config(model, target_path, aux_layer_ids)
    info = TargetInfo.read(Path(target_path))
    tl = model.config.transformer_layer_config.to_dict()
    cfg = {k: tl[k] for k in _GEOMETRY if tl.get(k) is not None}
    rope = tl.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    sg_ids = from_input_of_layer(aux_layer_ids, sglang_convention(info.model_type), info.num_layers)
    cfg.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
               draft_vocab_size=int(model.draft_vocab_size), vocab_size=int(info.vocab_size),
               tie_word_embeddings=False, torch_dtype="bfloat16", norm_output=bool(model.config.norm_output),
               fc_norm=bool(model.config.fc_norm),
               eagle_config={"eagle_aux_hidden_state_layer_ids": sg_ids, "use_aux_hidden_state": True})
    return cfg


def sglang_tensors(model) -> dict:
    sd = model.state_dict()
    names = export_names(model)
    left = sorted(n for n, p in model.named_parameters() if p.requires_grad and n not in names
                  and not n.startswith("embed_tokens"))  # embeddings: SGLang takes the target's
    if left:  # trained, but not in what SGLang loads: it would run another network, silently
        raise ExportError(f"the drafter trained {left}, which SGLang 0.5.14's {sglang_config_arch(model)} does not "
                          f"load: it would run without them. Fix: train the layer SGLang runs (drafter.model / mla)")
    out = {}
    for n in names:
        if n == "d2t":
            d2t = sd.get("d2t")
            out[n] = (d2t if d2t is not None else torch.zeros(model.draft_vocab_size, dtype=torch.int64)).to(torch.int64)
        else:
            out[n] = sd[n].detach().to(torch.bfloat16)
    return {k: v.contiguous().cpu() for k, v in out.items()}


def sglang_config_arch(model) -> str:
    from eagle3kit.drafter.mla import ARCH, is_mla

    return ARCH if is_mla(model) else "LlamaForCausalLMEagle3"


def to_sglang(model, vocab, dest, target_path, aux_layer_ids, provenance: dict | None = None,
              aux_ids_override: list[int] | None = None, final_pre_norm: bool = True,
              teacher_exact: bool | None = None) -> Path:
    """Write an SGLang draft directory (atomically: ``dest`` is replaced whole). ``aux_ids_override`` writes
    other SGLang layer ids than the training layers' (the off-by-one experiment; the doctor flags it);
    ``final_pre_norm``: whether the training data's final slot was pre-norm; ``teacher_exact``: whether the teacher
    saw the target's own logits (a pre-norm slot normed, or a recorded post-norm slot taken as it is; None: as
    ``final_pre_norm``). The doctor flags False."""
    from eagle3kit.drafter.model import check_servable

    if model.config.transformer_layer_config.num_hidden_layers != 1:
        raise ExportError("SGLang 0.5.14 runs layers > 0 of a draft with other norms than speculators trains "
                          "(hidden_norm as input norm): export one-layer drafters only")
    from eagle3kit.drafter.mla import is_mla

    if not is_mla(model):
        check_servable(model.config)
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        _write_sglang(tmp, model, vocab, target_path, aux_layer_ids, provenance, aux_ids_override, final_pre_norm,
                      teacher_exact)
    except BaseException:  # a full disk: no temp folder left behind, ``dest`` as it was
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _publish(tmp, dest)


def _write_sglang(tmp, model, vocab, target_path, aux_layer_ids, provenance, aux_ids_override, final_pre_norm,
                  teacher_exact) -> None:
    from eagle3kit.target import TargetInfo

    cfg = sglang_config(model, target_path, aux_layer_ids)
    if aux_ids_override is not None:
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [int(k) for k in aux_ids_override]
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(sglang_tensors(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    info = TargetInfo.read(Path(target_path))
    (tmp / "eagle3kit.json").write_text(json.dumps({
        "format": FORMAT, "target": str(target_path), "target_model_type": info.model_type,
        "target_num_layers": info.num_layers, "capture_layer_ids": [int(k) for k in aux_layer_ids] + [info.num_layers],
        "layer_convention": "input_of_layer", "draft_vocab_size": int(vocab.size), **(provenance or {}),
        "final_pre_norm": bool(final_pre_norm),
        "teacher_exact": bool(final_pre_norm if teacher_exact is None else teacher_exact)}, indent=1, default=str))


def to_speculators(model, dest, provenance: dict | None = None) -> Path:
    """speculators' own checkpoint (``Eagle3Speculator``: what vLLM loads), via its ``save_pretrained``."""
    from eagle3kit.drafter.mla import is_mla

    if is_mla(model):
        raise ExportError("speculators' format holds the Llama head only (speculators 0.9 has no MLA drafter class): "
                          "an MLA drafter exports to SGLang only. Fix: `eagle3kit export sglang`")
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        model.save_pretrained(str(tmp))
        (tmp / "eagle3kit.json").write_text(json.dumps({"format": FORMAT, **(provenance or {})}, indent=1,
                                                       default=str))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _publish(tmp, dest)


def _publish(tmp: Path, dest: Path) -> Path:
    """``tmp`` marked as a drafter export (``folders``: a later export may replace it) and renamed to ``dest``; a
    failure (a full disk) removes ``tmp`` and leaves ``dest`` as it was."""
    from eagle3kit.folders import mark

    try:
        mark(tmp, KIND)
        return publish(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_sglang_export(path, target_path=None, attn_implementation: str = "sdpa"):
    """The exported drafter loaded back into speculators' model (what a test or the notebook compares against the
    trained one). Refuses an export with tensors SGLang would not load or without ones it needs."""
    from eagle3kit.drafter.model import build
    from eagle3kit.drafter.vocab import DraftVocab

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    meta = json.loads((path / "eagle3kit.json").read_text()) if (path / "eagle3kit.json").exists() else {}
    target_path = Path(target_path or meta.get("target") or "")
    try:
        tensors = load_file(str(path / "model.safetensors"))
    except Exception as e:  # noqa: BLE001 - a cut or corrupt file: the user's input, named with the fix
        raise ExportError(f"{path / 'model.safetensors'}: not a readable safetensors file ({type(e).__name__}: {e}). "
                          f"Fix: export another checkpoint (--checkpoint final) or train again") from None
    mla_head = (cfg.get("architectures") or [""])[0] == "Eagle3DeepseekV2ForCausalLM"
    names = mla_sglang_names if mla_head else sglang_names
    want = set(names(len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]), bool(cfg.get("fc_norm"))))
    missing, extra = sorted(want - set(tensors)), sorted(set(tensors) - want - {"t2d"})
    if missing or extra:
        raise ExportError(f"{path}: SGLang would leave {missing} uninitialised and drop {extra}")
    vocab = DraftVocab.from_d2t(tensors["d2t"], int(cfg["vocab_size"]))
    aux = meta.get("capture_layer_ids", [])[:-1]
    if mla_head:
        from eagle3kit.drafter import mla

        model = mla.build(target_path, aux, vocab, config=mla.config_of_export(cfg, attn_implementation, aux))
    else:
        model = build(target_path, aux, vocab, fc_norm=bool(cfg.get("fc_norm")),
                      norm_output=bool(cfg.get("norm_output")), attn_implementation=attn_implementation)
    state = {k: v.float() for k, v in tensors.items() if k not in ("d2t", "t2d")}
    model.load_state_dict(state, strict=False)
    return model, cfg, meta


def export_drafter(src, dest, fmt: str, checkpoint: str = "best", sglang_layer_ids=None, force: bool = False) -> dict:
    """``eagle3kit export sglang|speculators <train out_dir or export> DEST``. ``DEST`` must be new, empty, an earlier
    drafter export, or ``force`` (``folders.claim``): what the user put there is never replaced."""
    from eagle3kit.folders import FolderError, claim

    try:
        claim(dest, KIND, force)
    except FolderError as e:
        raise ExportError(str(e)) from None
    src = Path(src)
    export_dir = src / checkpoint if (src / "train.json").exists() else src
    if not (export_dir / "config.json").exists():
        raise ExportError(f"{export_dir}: no exported drafter there (training still running, or no evaluation yet?)")
    model, cfg, meta = load_sglang_export(export_dir)
    from eagle3kit.drafter.vocab import DraftVocab

    vocab = DraftVocab.from_d2t(model.d2t if model.d2t is not None else torch.zeros(model.draft_vocab_size,
                                                                                       dtype=torch.int64),
                                int(cfg["vocab_size"]))
    aux = meta["capture_layer_ids"][:-1]
    provenance = {k: v for k, v in meta.items() if k not in ("format", "target", "target_model_type",
                                                             "target_num_layers", "capture_layer_ids",
                                                             "layer_convention", "final_pre_norm", "draft_vocab_size",
                                                             "teacher_exact")}
    if fmt == "sglang":
        out = to_sglang(model, vocab, dest, meta["target"], aux, provenance, aux_ids_override=sglang_layer_ids,
                        final_pre_norm=meta.get("final_pre_norm", True), teacher_exact=meta.get("teacher_exact"))
    elif fmt == "speculators":
        out = to_speculators(model, dest, {**meta, **provenance})
    else:
        raise ExportError(f"format {fmt!r}: drafters export to 'sglang' or 'speculators'")
    return {"format": fmt, "dest": str(out), "from": str(export_dir)}


@torch.no_grad()
def loadback_rel_err(train_dir, data_dir, rows: int = 256) -> float:
    """The ``final/`` export loaded back (bf16, as SGLang gets it) against the last checkpoint's fp32 weights on one
    held-out sample (the first training one when nothing is held out; ``data_dir`` None: seeded random states of the
    captured shape, for a live training): max per-row relative error of the logits."""
    from eagle3kit.drafter import data as D
    from eagle3kit.drafter.ttt import draft_steps

    train_dir = Path(train_dir)
    exported, _, meta = load_sglang_export(train_dir / "final")
    trained = copy.deepcopy(exported)
    ckpt = load_checkpoint(train_dir / "checkpoints" / "last.pt")
    trained.load_state_dict(ckpt["model"], strict=False)
    if data_dir is None:  # a live training keeps no data set: seeded random states of the captured shape
        g = torch.Generator().manual_seed(0)
        n_states, vocab = len(meta["capture_layer_ids"]), exported.embed_tokens.num_embeddings
        sample = {"hidden_states": torch.randn(rows + 1, n_states, exported.hidden_size, generator=g),
                  "token_ids": torch.randint(0, vocab, (rows + 1,), generator=g),
                  "loss_mask": torch.ones(rows + 1, dtype=torch.int64)}
    else:
        held = D.CaptureSource(data_dir, "heldout")
        sample = (held if len(held) else D.CaptureSource(data_dir, "train")).load(0)
    b = D.collate([D.align(sample, len(meta["capture_layer_ids"]), exported.hidden_size, rows)])
    x, y = (next(draft_steps(m.float(), b["aux"].float(), b["input_ids"], b["doc_ids"], b["position_ids"], 1))
            for m in (exported, trained))
    return float(token_errors(x, y).max())
