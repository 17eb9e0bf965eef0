"""Tiny random-weight targets of the users' own family, made here in seconds (no download), cached like the embedded
default, for the code paths a 1 T-parameter Kimi-K2.5 takes (#14):

``embedded:deepseek-v3-tiny``  ``DeepseekV3ForCausalLM``: MLA with DeepSeek's own ``kv_lora_rank`` 512 and rope
                               head 64 (SGLang's triton MLA kernels assume them), a dense first layer, then MoE layers
                               (8 routed experts, top 2, one shared expert, sigmoid scores with a correction bias).
``embedded:kimi-k25-tiny``     the same language model inside Kimi-K2.5's wrapper as SGLang 0.5.14 loads it
                               (``models/kimi_k25.py``, ``configs/kimi_k25.py``): ``KimiK25ForConditionalGeneration``,
                               model_type ``kimi_k25``, the DeepSeek-V3 config under ``text_config`` (with its own
                               ``architectures``, which deepseek_v2.py reads), a minimal ``vision_config``, weights
                               under ``language_model.`` (decoder layers at ``language_model.model.layers.{i}``). No
                               vision weights: text never reaches the tower (SGLang builds it and leaves it unloaded).
                               A text-only processor (``tiny_kimi_processor.py``, by ``auto_map``; serve with
                               ``--trust-remote-code``) gives SGLang's Kimi processor the fields it reads. transformers
                               has no class for the model; the reference engine runs its language model
                               (``eagle3kit.family.load_language_model``).

Tokenizer and chat template are the embedded SmolLM2's (its vocabulary sizes the embeddings). Weights are saved per
expert (``mlp.experts.{e}.gate_proj.weight`` ...), as DeepSeek's checkpoints are and SGLang loads them, and
config.json carries the keys SGLang 0.5.14's ``deepseek_v2.py`` reads that transformers does not write
(``moe_layer_freq``, and like the real config ``topk_method``, ``scoring_func``).
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from eagle3kit.family import KIMI_PREFIX, per_expert

SEED = 0
VERSION = 3  # of what make_* writes: a cached tiny target of another version is made again
DEEPSEEK_V3 = dict(  # transformers' DeepseekV3Config fields
    hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
    n_group=1, topk_group=1, kv_lora_rank=512, q_lora_rank=256, qk_rope_head_dim=64, qk_nope_head_dim=64,
    v_head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6,
    routed_scaling_factor=2.5, norm_topk_prob=True)
SGLANG_EXTRA = {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}  # read by deepseek_v2.py


def make_deepseek_v3(out: Path, tokenizer_dir: Path) -> Path:
    """A random-weight DeepSeek-V3 of ``DEEPSEEK_V3``'s geometry with ``tokenizer_dir``'s tokenizer, in ``out``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = DeepseekV3Config(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                           **DEEPSEEK_V3)
    torch.manual_seed(SEED)
    model = DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():  # a router whose correction bias is not all zero, as a trained one
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn_like(p) * 0.01)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    save_file(per_expert({k: v.detach().cpu() for k, v in model.state_dict().items()}),
              str(tmp / "model.safetensors"), metadata={"format": "pt"})
    conf = {**cfg.to_dict(), **SGLANG_EXTRA, "architectures": ["DeepseekV3ForCausalLM"], "torch_dtype": "bfloat16"}
    conf.pop("dtype", None)
    (tmp / "config.json").write_text(json.dumps(conf, indent=2))
    tok.save_pretrained(tmp)
    for f in ("generation_config.json",):
        if (Path(tokenizer_dir) / f).exists():
            shutil.copy2(Path(tokenizer_dir) / f, tmp / f)
    return tmp


KIMI_VISION = {  # the fields SGLang's vision tower reads, tiny (configs/kimi_k25.py, models/kimi_k25.py)
    "hidden_size": 32, "vt_hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
    "patch_size": 14, "init_pos_emb_height": 4, "init_pos_emb_width": 4, "init_pos_emb_time": 4,
    "merge_kernel_size": [2, 2], "pos_emb_type": "divided_fixed", "video_attn_type": "spatial_temporal"}
KIMI_PROCESSOR = "processing_kimi_k25_tiny"  # the text-only processor module shipped in the folder
KIMI_MEDIA = {"patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 256, "patch_limit_on_one_side": 16,
              "fixed_output_tokens": None, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def make_kimi_k25(out: Path, tokenizer_dir: Path) -> Path:
    """The tiny DeepSeek-V3 wrapped as Kimi-K2.5 (config layout and weight names of SGLang 0.5.14's loader)."""
    from safetensors.torch import load_file, save_file

    inner = make_deepseek_v3(out.parent / f".{out.name}-lm", tokenizer_dir)
    try:
        text = json.loads((inner / "config.json").read_text())
        weights = load_file(str(inner / "model.safetensors"))
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        save_file({KIMI_PREFIX + k: v for k, v in weights.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        conf = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text,
                "vision_config": {**KIMI_VISION, "text_hidden_size": text["hidden_size"]},
                "media_placeholder_token_id": text["vocab_size"] - 1, "pad_token_id": 0, "ignore_index": -100,
                "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
        (tmp / "config.json").write_text(json.dumps(conf, indent=2))
        # SGLang builds its Kimi processor around AutoProcessor's answer (it reads .tokenizer, .image_processor and
        # .media_processor.media_proc_cfg): a text-only processor, loaded with --trust-remote-code as Kimi-K2.5's own
        shutil.copy2(Path(__file__).with_name("tiny_kimi_processor.py"), tmp / f"{KIMI_PROCESSOR}.py")
        (tmp / "processor_config.json").write_text(json.dumps(
            {"auto_map": {"AutoProcessor": f"{KIMI_PROCESSOR}.KimiK25TinyProcessor"}, "media_proc_cfg": KIMI_MEDIA},
            indent=2))
        for f in inner.iterdir():
            if f.name not in ("config.json", "model.safetensors"):
                shutil.copy2(f, tmp / f.name)
        return tmp
    finally:
        shutil.rmtree(inner, ignore_errors=True)
