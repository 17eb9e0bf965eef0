"""Every tensor a drafter's engine builds from its ``config.json``, and the check of an exported drafter against it.

SGLang loads a drafter by building the network its config describes, then copying each tensor of the safetensors
files into the parameter of that name; a name it does not know is dropped and a parameter nothing loads stays
uninitialised, without a word (a shape that disagrees fails only at load, on the GPU). So the doctor checks, before
anything is served: the config against the target (the aux states it is fed are the target's), every tensor's name,
shape and dtype against what the loader builds from that config, and every file read to its end (a cut copy fails).

``ARCHITECTURES`` maps a config's ``architectures[0]`` to ``expected(config) -> {name: (shape, dtype)}``; an
architecture adds its own function there (an MLA drafter, its own names and shapes).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

# safetensors' dtype codes, and the config's torch_dtype names for them
_CODES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "int64": "I64", "int32": "I32", "bool": "BOOL"}
_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
          "F8_E4M3": 1, "F8_E5M2": 1}


class TensorCheckError(ValueError):
    pass


def _int(cfg: dict, key: str, default=None) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise TensorCheckError(f"config.json: {key}={v!r}: expected a positive integer")
    return v


def llama_eagle3(cfg: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """SGLang 0.5.14's ``LlamaForCausalLMEagle3`` (``models/llama_eagle3.py``): ``fc`` maps the aux states
    (``target_hidden_size`` or ``hidden_size`` each, ``num_aux_hidden_states`` or as many as the eagle_config's ids,
    else 3) to ``hidden_size``; ``fc_norm`` one RMSNorm per aux state; layer 0's attention reads embeddings and
    hidden states concatenated (2 x hidden_size); ``lm_head [draft_vocab_size, hidden_size]`` unless the embeddings
    are tied; ``d2t [draft_vocab_size]`` (draft id -> target id offsets, int64). q/k/v and gate/up are loaded into
    SGLang's fused qkv_proj and gate_up_proj under these names. No ``embed_tokens``: the target's is used."""
    dtype = _CODES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"))
    if dtype is None:
        raise TensorCheckError(f"config.json: torch_dtype={cfg.get('torch_dtype')!r}: expected bfloat16, float16 or "
                               f"float32")
    h = _int(cfg, "hidden_size")
    h_in = _int(cfg, "target_hidden_size", h)
    heads = _int(cfg, "num_attention_heads")
    kv = _int(cfg, "num_key_value_heads", heads)
    head_dim = _int(cfg, "head_dim", h // heads if h % heads == 0 else None)
    inter = _int(cfg, "intermediate_size")
    n_layers = _int(cfg, "num_hidden_layers", 1)
    eagle = cfg.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    n_aux = cfg.get("num_aux_hidden_states") or (len(ids) if isinstance(ids, list) and ids else 3)
    vocab = _int(cfg, "vocab_size")
    draft = _int(cfg, "draft_vocab_size", vocab) if cfg.get("draft_vocab_size") is not None else vocab
    out = {"fc.weight": ((h, h_in * n_aux), dtype)}
    if cfg.get("bias"):
        out["fc.bias"] = ((h,), dtype)
    if cfg.get("fc_norm") or cfg.get("use_aux_norm"):
        out.update({f"fc_norm.{i}.weight": ((h_in,), dtype) for i in range(n_aux)})
    for i in range(n_layers):
        width = 2 * h if i == 0 else h
        p = f"layers.{i}."
        out.update({p + "self_attn.q_proj.weight": ((heads * head_dim, width), dtype),
                    p + "self_attn.k_proj.weight": ((kv * head_dim, width), dtype),
                    p + "self_attn.v_proj.weight": ((kv * head_dim, width), dtype),
                    p + "self_attn.o_proj.weight": ((h, heads * head_dim), dtype),
                    p + "mlp.gate_proj.weight": ((inter, h), dtype), p + "mlp.up_proj.weight": ((inter, h), dtype),
                    p + "mlp.down_proj.weight": ((h, inter), dtype), p + "input_layernorm.weight": ((h,), dtype),
                    p + "post_attention_layernorm.weight": ((h,), dtype), p + "hidden_norm.weight": ((h,), dtype)})
    out["norm.weight"] = ((h,), dtype)
    if not cfg.get("tie_word_embeddings"):
        out["lm_head.weight"] = ((draft, h), dtype)
    out["d2t"] = ((draft,), "I64")
    return out


def mla_expected_tensors(config: dict) -> dict:
    """{name: (shape, dtype)} of every tensor an MLA export holds, as SGLang 0.5.14's Eagle3DeepseekV2ForCausalLM
    builds and loads them from ``config`` (kimi_k25_eagle3.py:116-122, 143-147, 199-240, 344-349, 413-505;
    deepseek_v2.py:1544-1631): ``q_a_proj`` and ``kv_a_proj_with_mqa`` rows fill the fused [q_lora + kv_lora + rope,
    2H] projection, ``kv_b_proj`` is split into w_kc / w_vc after loading, ``d2t`` gives the hot token ids. No
    ``embed_tokens``: SGLang takes the target's (set_embed)."""
    h, th = config["hidden_size"], config.get("target_hidden_size") or config["hidden_size"]
    nh, nope, rope = config["num_attention_heads"], config["qk_nope_head_dim"], config["qk_rope_head_dim"]
    qr, kr, vd, inter = config["q_lora_rank"], config["kv_lora_rank"], config["v_head_dim"], config["intermediate_size"]
    eagle = config.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids", config.get("eagle_aux_hidden_state_layer_ids"))
    n = len(ids) if ids is not None else 3
    vocab = config.get("draft_vocab_size") or config["vocab_size"]
    bf = "bfloat16"
    a = "layers.0.self_attn."
    out = {"fc.weight": ((h, n * th), bf), "norm.weight": ((h,), bf), "lm_head.weight": ((vocab, h), bf),
           "d2t": ((vocab,), "int64"),
           a + "q_a_proj.weight": ((qr, 2 * h), bf), a + "q_a_layernorm.weight": ((qr,), bf),
           a + "q_b_proj.weight": ((nh * (nope + rope), qr), bf),
           a + "kv_a_proj_with_mqa.weight": ((kr + rope, 2 * h), bf), a + "kv_a_layernorm.weight": ((kr,), bf),
           a + "kv_b_proj.weight": ((nh * (nope + vd), kr), bf), a + "o_proj.weight": ((h, nh * vd), bf),
           "layers.0.mlp.gate_proj.weight": ((inter, h), bf), "layers.0.mlp.up_proj.weight": ((inter, h), bf),
           "layers.0.mlp.down_proj.weight": ((h, inter), bf), "layers.0.input_layernorm.weight": ((h,), bf),
           "layers.0.hidden_norm.weight": ((h,), bf), "layers.0.post_attention_layernorm.weight": ((h,), bf)}
    if config.get("fc_norm") or config.get("use_aux_norm"):
        out.update({f"fc_norm.{i}.weight": ((th,), bf) for i in range(n)})
    return out


def deepseek_v2_eagle3(cfg: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """``mla_expected_tensors`` in safetensors' dtype codes."""
    try:
        return {k: (tuple(shape), _CODES[dt]) for k, (shape, dt) in mla_expected_tensors(cfg).items()}
    except (KeyError, TypeError) as e:
        raise TensorCheckError(f"config.json: {e} missing or not a number (an MLA drafter's keys)") from None


ARCHITECTURES = {"LlamaForCausalLMEagle3": llama_eagle3, "Eagle3DeepseekV2ForCausalLM": deepseek_v2_eagle3}
# names a loader skips on purpose (read by no one): allowed, with the shape they must have
IGNORED = {"t2d": lambda cfg: ((cfg.get("vocab_size"),), ("BOOL", "I64"))}


def expected_tensors(cfg: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, safetensors dtype)} the engine builds from ``cfg``; TensorCheckError for an architecture
    without a table or a config it cannot be built from."""
    archs = cfg.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch not in ARCHITECTURES:
        raise TensorCheckError(f"config.json: architectures={archs!r}: no tensor table for it (known: "
                               f"{sorted(ARCHITECTURES)})")
    return ARCHITECTURES[arch](cfg)


def read_header(path: Path, read_through: bool = True) -> dict[str, dict]:
    """The tensors of one safetensors file ({name: {dtype, shape, data_offsets}}), the file read to its end
    (``read_through``; else its size only is checked against the header): a file
    cut short, with bytes past its last tensor, or with a tensor whose byte span disagrees with its shape, raises
    TensorCheckError naming the file (and the tensor)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            raise TensorCheckError(f"{path}: cut short ({size} bytes, its header alone needs {8 + max(n, 0)}): not a "
                                   f"whole safetensors file")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise TensorCheckError(f"{path}: its header is not JSON ({e}): not a safetensors file") from None
        header.pop("__metadata__", None)
        end = 0
        for name, t in header.items():
            code, shape, (a, b) = t["dtype"], t["shape"], t["data_offsets"]
            if code in _BYTES and (b - a) != math.prod(shape) * _BYTES[code]:
                raise TensorCheckError(f"{path}: tensor {name} {code}{shape} spans {b - a} bytes, not "
                                       f"{math.prod(shape) * _BYTES[code]}")
            end = max(end, b)
        if 8 + n + end != size:
            raise TensorCheckError(f"{path}: {'cut short' if 8 + n + end > size else 'bytes past its last tensor'}: "
                                   f"its tensors need {8 + n + end} bytes, the file has {size}")
        while read_through and f.read(1 << 24):  # every byte read once: a read error surfaces here, not in the server
            pass
    return header


def check_files(folder: Path, cfg: dict) -> list[tuple[str, str]]:
    """(level, what) of every disagreement between ``folder``'s safetensors files and ``expected_tensors(cfg)``,
    naming the tensor; [] when every tensor is there, of its shape and dtype, and nothing else is."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        return [("error", f"{folder}: no *.safetensors file: the engine would load no weights")]
    try:
        want = expected_tensors(cfg)
    except TensorCheckError as e:
        return [("error", str(e))]
    found: dict[str, tuple] = {}
    problems = []
    for path in files:
        try:
            header = read_header(path)
        except TensorCheckError as e:
            problems.append(("error", str(e)))
            continue
        for name, t in header.items():
            if name in found:
                problems.append(("error", f"{path.name}: tensor {name} is also in {found[name][2]}"))
            found[name] = (tuple(t["shape"]), t["dtype"], path.name)
    if problems:
        return problems
    for name, (shape, dtype, file) in sorted(found.items()):
        if name in want:
            ws, wd = want[name]
            if shape != ws:
                problems.append(("error", f"{file}: tensor {name} has shape {list(shape)}, the config makes "
                                          f"{list(ws)}"))
            if dtype != wd:
                problems.append(("error", f"{file}: tensor {name} is {dtype}, the config makes {wd}"))
        elif name in IGNORED:
            ws, wds = IGNORED[name](cfg)
            if shape != ws or dtype not in wds:
                problems.append(("error", f"{file}: tensor {name} {dtype}{list(shape)}: expected {list(ws)}"))
        else:
            problems.append(("error", f"{file}: tensor {name} is not one the engine loads for "
                                      f"{cfg['architectures'][0]}: it would be dropped"))
    for name in sorted(set(want) - set(found)):
        problems.append(("error", f"tensor {name} {list(want[name][0])} is missing: the engine would leave it "
                                  f"uninitialised"))
    return problems
