"""The layer doctor: which hidden state "layer k" means in each engine, and whether a capture, a drafter config and
a serving engine agree. One convention travels inside eagle3kit: ``input_of_layer`` (k = the residual stream
entering decoder layer k = output of layer k-1; k = L = the last layer's output before the final norm).

| convention        | id k in a config means                                   | who                          |
| input_of_layer    | input of layer k; L = final, pre-norm                    | eagle3kit, speculators, vLLM,|
|                   |                                                          | SafeAILab EAGLE-3            |
| hf_hidden_states  | transformers hidden_states[k]; k = L is AFTER the norm   | transformers                 |
| sglang_llama      | output of layer k (SGLang adds 1): input of layer k + 1  | SGLang Llama/Qwen, SpecForge |
| sglang_deepseek   | +1 only when ids[0] == 1, else input of layer k          | SGLang DeepSeek-V2/V3, Kimi  |
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

CONVENTIONS = ("input_of_layer", "speculators", "vllm", "eagle", "hf_hidden_states", "sglang_llama", "specforge",
               "sglang_deepseek")
_SAME_AS_INPUT = {"input_of_layer", "speculators", "vllm", "eagle", "hf_hidden_states"}
_OUTPUT_OF = {"sglang_llama", "specforge"}
DEEPSEEK_TYPES = {"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25", "kimi_vl"}


class NotExpressible(ValueError):
    pass


def _check_convention(convention: str):
    if convention not in CONVENTIONS:
        raise ValueError(f"unknown layer-id convention {convention!r}; known: {CONVENTIONS}")


def sglang_convention(model_type: str) -> str:
    """The convention SGLang applies to ``eagle_aux_hidden_state_layer_ids`` for a target ``model_type``."""
    return "sglang_deepseek" if model_type in DEEPSEEK_TYPES else "sglang_llama"


def sglang_default_aux(num_layers: int) -> list[int]:
    """What SGLang captures (input_of_layer) when the drafter config names no layer ids."""
    return [2, num_layers // 2, num_layers - 3]


def to_input_of_layer(ids, convention: str, num_layers: int) -> list[int]:
    """Layer ids of ``convention`` -> eagle3kit's input_of_layer ids."""
    _check_convention(convention)
    ids = [int(k) for k in ids]
    if convention in _SAME_AS_INPUT:
        out = ids
    elif convention in _OUTPUT_OF:
        out = [k + 1 for k in ids]
    else:  # sglang_deepseek: the rule looks at the first id only
        out = [k + 1 for k in ids] if ids and ids[0] == 1 else ids
    # SGLang's capture runs inside its layer loop (i < num_layers): the last layer's output is out of its reach
    top = num_layers - 1 if convention.startswith("sglang") else num_layers
    bad = [k for k, o in zip(ids, out) if not 0 <= o <= top]
    if bad:
        raise ValueError(f"layer ids {bad} ({convention}) fall outside a {num_layers}-layer model"
                         + (f" (SGLang captures the inputs of layers 0..{top})" if top < num_layers else ""))
    return out


def from_input_of_layer(ids, convention: str, num_layers: int) -> list[int]:
    """input_of_layer ids -> the ids to write in a config of ``convention`` (NotExpressible if none exist)."""
    _check_convention(convention)
    ids = [int(k) for k in ids]
    if convention in _SAME_AS_INPUT:
        out = ids
    elif convention in _OUTPUT_OF:
        out = [k - 1 for k in ids]
        if min(out, default=0) < 0 or (convention == "sglang_llama" and max(out, default=0) > num_layers - 2):
            raise NotExpressible(f"input_of_layer {ids}: SGLang Llama captures outputs of layers 0..{num_layers - 2}")
    else:
        out = ids if not ids or ids[0] != 1 else [k - 1 for k in ids]
        if to_input_of_layer(out, convention, num_layers) != ids:
            raise NotExpressible(f"input_of_layer {ids} cannot be written for SGLang DeepSeek: ids starting with 1 "
                                 f"get +1, so the input of layer 1 can only come with the +1 rule on every id")
    if to_input_of_layer(out, convention, num_layers) != ids:
        raise NotExpressible(f"input_of_layer {ids} has no {convention} form")
    return out


def describe(k: int, num_layers: int) -> str:
    """Plain words for one input_of_layer id."""
    if k == 0:
        return "the embeddings (input of layer 0)"
    if k == num_layers:
        return f"the output of the last layer ({num_layers - 1}) before the final norm"
    return f"the output of layer {k - 1} (input of layer {k})"


@dataclass
class Finding:
    level: str  # "ok" | "warning" | "error"
    what: str
    fix: str = ""


@dataclass
class Diagnosis:
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(f.level == "error" for f in self.findings)

    def table(self) -> list[dict]:
        return [{"level": f.level, "what": f.what, "fix": f.fix} for f in self.findings]

    def __str__(self) -> str:
        return "\n".join(f"[{f.level}] {f.what}" + (f"\n        fix: {f.fix}" if f.fix else "") for f in self.findings)


def check(capture_layer_ids, drafter_config: dict, model_type: str, num_layers: int, engine: str = "sglang",
          final_is_pre_norm: bool = True, trainer: str = "speculators") -> Diagnosis:
    """Do the capture (input_of_layer ids, aux then final), the drafter config and the serving engine agree?"""
    d = Diagnosis()
    cap = [int(k) for k in capture_layer_ids]
    trained_aux, final = cap[:-1], cap[-1]
    if final != num_layers:
        d.findings.append(Finding("error", f"the capture's last slot is {describe(final, num_layers)}, not the final "
                                  f"state", f"capture with the final state (input_of_layer {num_layers}) last"))
    eagle = drafter_config.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids", drafter_config.get("eagle_aux_hidden_state_layer_ids"))
    conv = sglang_convention(model_type) if engine == "sglang" else "input_of_layer"
    source = "SGLang's default (config has no eagle_aux_hidden_state_layer_ids)" if ids is None else \
        f"eagle_aux_hidden_state_layer_ids {ids} read by {engine} as {conv}"
    try:
        fix = (f"set eagle_config.eagle_aux_hidden_state_layer_ids = "
               f"{from_input_of_layer(trained_aux, conv, num_layers)} in the drafter's config.json")
    except ValueError as e:
        fix = f"recapture with layers the engine can feed ({e})"
    try:
        served = sglang_default_aux(num_layers) if ids is None else to_input_of_layer(ids, conv, num_layers)
    except ValueError as e:  # ids the engine cannot capture at all (the last layer's output, past the model)
        d.findings.append(Finding("error", f"{source}: {e}", fix))
    else:
        if served == trained_aux:
            d.findings.append(Finding("ok", f"{source} feeds the drafter " +
                                      ", ".join(describe(k, num_layers) for k in served) + ", as in training"))
        else:
            offsets = sorted({s - t for s, t in zip(served, trained_aux)}) if len(served) == len(trained_aux) else []
            d.findings.append(Finding("error", f"{source} feeds input_of_layer {served}, but the drafter was trained "
                                      f"on {trained_aux}" + (f" (offset {offsets})" if offsets else ""), fix))
    if not final_is_pre_norm and trainer == "speculators":
        d.findings.append(Finding("error", "the final state was captured after the norm; speculators applies the "
                                  "target's norm itself", "capture the final state before the norm (the default)"))
    if engine == "sglang":
        unread = {"norm_before_residual": "norm_before_residual=False", "norm_before_fc": "norm_before_fc=False "
                  "(fc_norm, per aux state, is read by SGLang)"}
        tl = drafter_config.get("transformer_layer_config") or {}
        for key, fix in unread.items():
            if drafter_config.get(key) or tl.get(key):
                d.findings.append(Finding("error", f"{key}=True: SGLang 0.5.14's LlamaForCausalLMEagle3 does not read "
                                          f"it and runs another network than the one trained", f"train with {fix}"))
        window = sliding_window(drafter_config) or sliding_window(tl)
        if window:
            d.findings.append(Finding("error", f"sliding-window attention ({window}) in the draft: SGLang runs full "
                                      f"attention unless --speculative-draft-window-size is given",
                                      "train with full attention, or serve with --speculative-draft-window-size"))
    return d


def sliding_window(config) -> int | bool | None:
    """The draft attention's sliding window, if it uses one (a dict or a transformers config). layer_types decides
    where given (speculators' full-attention recipe writes sliding_window 2048 beside layer_types ["full_attention"]
    and use_sliding_window false: full attention); else a window counts unless use_sliding_window is false."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    window, types = get("sliding_window"), get("layer_types")
    if types:
        return (window or True) if "sliding_attention" in types else None
    return window if window and get("use_sliding_window") is not False else None


def post_norm_share(final_states: torch.Tensor, norm_weight: torch.Tensor, tol: float = 0.02) -> float:
    """Share of tokens whose "final" state is already the final norm's output (RMS of state / norm weight = 1).

    The output of an RMSNorm with weight w satisfies rms(h / w) = 1 for every token (up to bf16 rounding); the
    residual stream before the norm has no such constraint (SmolLM2: RMS 2 to 400). A capture whose last slot is
    post-norm (an engine that hands out normed states) gives a share near 1, the correct pre-norm state near 0.
    """
    h = final_states.float().reshape(-1, final_states.shape[-1])
    w = norm_weight.float().to(h.device)  # the head may sit on the GPU, the loaded states on the CPU (05, -14)
    keep = w.abs() > 1e-3 * w.abs().max()
    r = (h[:, keep] / w[keep]).pow(2).mean(-1).sqrt()
    return float(((r - 1).abs() < tol).float().mean()) if r.numel() else 0.0


def token_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Median over tokens of |a - b| / |b| per token: the metric that tells layers apart.

    A whole-tensor relative error is dominated by attention-sink tokens whose norm is 100x the others (SmolLM2:
    25,000 vs 150), which makes neighbouring layers look 1.5 % apart; per token they are 20 % or more apart,
    while bf16 rounding is 0.2 %.
    """
    return token_errors(a, b).median().item()


def token_errors(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| / |b| of every token (rows of [..., H]): the capture check takes its worst (``spec.check_states``)."""
    a, b = a.float().reshape(-1, a.shape[-1]), b.float().reshape(-1, b.shape[-1])
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)


def identify(captured: torch.Tensor, candidates: dict) -> tuple:
    """Which reference state is ``captured``? Returns (best name, its per-token error, all errors)."""
    errs = {name: token_rel_err(captured, ref) for name, ref in candidates.items() if ref.shape == captured.shape}
    best = min(errs, key=errs.get)
    return best, errs[best], errs
