"""A target's geometry without its weights, for measuring the drafter trainer at the users' scale on one GPU.

``make_head_only`` writes a target folder with Kimi-K2.5's language-model config (hidden 7168, vocabulary 163,840,
61 layers) and only the tensors the trainer reads: the embeddings, the LM head and the final norm (random, bf16); no
decoder layer, so no engine can run it. ``write_synthetic_dataset`` writes an eagle3kit data set for it: real
conversations rendered as extract renders them, with random hidden states of the target's geometry in place of
captured ones (recorded as engine ``synthetic``). A drafter trained on it learns nothing; what it measures is the
trainer's speed at that geometry (``benchmarks/train_throughput.py --data``), which decides how many training GPUs
one capture server can feed (``live/DESIGN.md``)."""
from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch

# Kimi-K2.5's language model (DeepSeek-V3's architecture at Kimi-K2's sizes: 64 heads, 384 experts)
KIMI_K25_TEXT = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64,
    vocab_size=163840, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
    n_routed_experts=384, num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1,
    max_position_embeddings=262144, rope_theta=50000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    hidden_act="silu", torch_dtype="bfloat16")


def make_head_only(out: Path, tokenizer_dir: Path, config: dict | None = None, seed: int = 0) -> Path:
    """A folder with ``config`` (default Kimi-K2.5's text config), ``tokenizer_dir``'s tokenizer, and random
    ``model.embed_tokens``, ``lm_head`` and ``model.norm`` weights (bf16, std 0.02; the norm ones)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    conf = dict(config or KIMI_K25_TEXT)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    if len(tok) > conf["vocab_size"]:
        raise ValueError(f"the tokenizer of {tokenizer_dir} has {len(tok)} tokens, more than vocab_size "
                         f"{conf['vocab_size']}")
    g = torch.Generator().manual_seed(seed)
    shape = (conf["vocab_size"], conf["hidden_size"])
    weights = {"model.embed_tokens.weight": torch.empty(shape, dtype=torch.bfloat16).normal_(0, 0.02, generator=g),
               "lm_head.weight": torch.empty(shape, dtype=torch.bfloat16).normal_(0, 0.02, generator=g),
               "model.norm.weight": torch.ones(conf["hidden_size"], dtype=torch.bfloat16)}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**conf, "eagle3kit_head_only": True}, indent=2))
    tok.save_pretrained(out)
    return out


def random_states(n_tokens: int, n_slots: int, hidden_size: int, generator: torch.Generator) -> torch.Tensor:
    """Random residual-stream states, ``[n_tokens, n_slots, hidden_size]`` bf16: N(0, 1) rows, each token's scaled by
    its own log-normal factor (e^N(0, 1)). A real residual stream's RMS varies from token to token; rows of RMS 1
    are what a final norm of weight 1 outputs, and the trainer refuses such a last slot as post-norm (unscaled
    N(0, 1) rows at hidden 7168 have RMS 1 within 1 %)."""
    scale = torch.randn(n_tokens, 1, 1, generator=generator).exp()
    return (torch.randn(n_tokens, n_slots, hidden_size, generator=generator) * scale).to(torch.bfloat16)


class SyntheticEngine:
    """The reference engine's capture interface, writing random states of ``target``'s geometry (``random_states``)
    for the requested token ids: every sample a file as a capture makes it, checked as one."""

    def __init__(self, target: Path, layer_ids: list[int], num_layers: int, hidden_size: int, seed: int = 0):
        self.target, self.layer_ids, self.num_layers, self.hidden_size = Path(target), layer_ids, num_layers, hidden_size
        self.seed = seed

    def capture(self, out_dir, key: str, token_ids: list[int], rank: int = 0, tp_size: int = 1,
                storage: str = "bf16", tensors: dict | None = None) -> dict:
        from eagle3kit.capture.format import capture_metadata, write_sample

        g = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{key}".encode()))  # the same file every run
        hs = random_states(len(token_ids), len(self.layer_ids), self.hidden_size, g)
        meta = capture_metadata("synthetic", str(self.target), rank, tp_size, self.layer_ids, self.num_layers, False)
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        return write_sample(Path(out_dir), key, rank, {"hidden_states": hs,
                                                       "token_ids": torch.tensor(token_ids, dtype=torch.int64)},
                            meta, storage, extra_marker={"rid": key, "chunks": 1})


def write_synthetic_dataset(out: Path, target: Path, max_samples: int, max_tokens: int,
                            data: str = "embedded:sharegpt", storage: str = "bf16", seed: int = 0) -> dict:
    """``max_samples`` conversations of ``data`` rendered with ``target``'s tokenizer, written as a data set of
    random states at ``target``'s geometry (EAGLE-3's default layers); returns extract's summary."""
    from transformers import AutoTokenizer

    from eagle3kit.extract import ReferenceBackend, extract, load_samples, settings_for
    from eagle3kit.pipeline import default_aux
    from eagle3kit.target import TargetInfo

    info = TargetInfo.read(target)
    layer_ids = default_aux(info.num_layers) + [info.num_layers]
    samples, _ = load_samples(data, AutoTokenizer.from_pretrained(target), max_samples, max_tokens)
    settings = {**settings_for(target, info, layer_ids, storage, data, max_tokens), "engine": "synthetic"}
    engine = SyntheticEngine(target, layer_ids, info.num_layers, info.hidden_size, seed)
    return extract(samples, out, ReferenceBackend(engine, storage), settings, progress=False)
