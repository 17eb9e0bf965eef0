"""The users' family as its checkpoints lay it out, read into transformers' models.

DeepSeek-V3's checkpoints (and SGLang's loader) hold one Linear per expert (``mlp.experts.{e}.gate_proj.weight``
...), where transformers 5 fuses them (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]):
``per_expert`` and ``fuse_experts`` turn one into the other. Kimi-K2.5 wraps that language model in
``KimiK25ForConditionalGeneration``: its config under ``text_config``, its weights under ``language_model.``;
transformers has no class for the wrapper, so the reference engine and the drafter read the language model inside it
(``language_model_config``, ``load_language_model``). Used by ``target`` (loading a user's target) and ``tiny``
(writing the tiny targets of the family).
"""
from __future__ import annotations

import json
from pathlib import Path

KIMI_PREFIX = "language_model."  # where Kimi-K2.5's checkpoint keeps its language model's weights


def per_expert(state: dict) -> dict:
    """transformers 5's fused expert tensors (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I])
    as the per-expert Linear weights DeepSeek's checkpoints hold and SGLang loads."""
    out = {}
    for name, w in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base, inter = name[: -len("gate_up_proj")], w.shape[1] // 2
            for e in range(w.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = w[e, :inter].contiguous()
                out[f"{base}{e}.up_proj.weight"] = w[e, inter:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(w.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = w[e].contiguous()
        else:
            out[name] = w.contiguous()
    return out


def fuse_experts(state: dict) -> dict:
    """The inverse of ``per_expert``: per-expert Linear weights as transformers 5's fused expert tensors."""
    import re

    import torch

    out, experts = {}, {}
    for name, w in state.items():
        m = re.match(r"(.*mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$", name)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = w
        else:
            out[name] = w
    for base, by_e in experts.items():
        es = [by_e[e] for e in sorted(by_e)]
        out[base + "gate_up_proj"] = torch.stack([torch.cat([e["gate"], e["up"]]) for e in es])
        out[base + "down_proj"] = torch.stack([e["down"] for e in es])
    return out


def language_model_config(path: Path):
    """transformers' config of the target's language model. A multimodal wrapper (Kimi-K2.5) keeps it under
    ``text_config``, and is built from there: the transformers SGLang 0.5.14 pins (5.8) does not know ``kimi_k25``
    itself, so ``AutoConfig.from_pretrained`` on the wrapper fails there (gpu-family-kimi-tiny-3)."""
    from transformers import AutoConfig

    conf = json.loads((Path(path) / "config.json").read_text())
    if "text_config" not in conf:
        return AutoConfig.from_pretrained(str(path))
    text = {k: v for k, v in conf["text_config"].items() if k != "architectures"}
    return AutoConfig.for_model(text.pop("model_type"), **text)


def load_language_model(path: Path, dtype):
    """transformers' model of a wrapped target's language model (Kimi-K2.5: ``text_config`` and the weights under
    ``language_model.``), or None when ``path`` is not a wrapper this module knows."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    conf = json.loads((Path(path) / "config.json").read_text())
    if (conf.get("architectures") or [""])[0] != "KimiK25ForConditionalGeneration":
        return None
    model = AutoModelForCausalLM.from_config(language_model_config(path), dtype=dtype)  # then every weight from the files (checked below)
    state = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        state.update({k[len(KIMI_PREFIX):]: v for k, v in load_file(str(f)).items() if k.startswith(KIMI_PREFIX)})
    fused = fuse_experts(state)
    missing, unexpected = model.load_state_dict(fused, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: the language model's weights do not fit: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    return model.to(dtype).eval()
