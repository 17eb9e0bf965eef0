"""What SGLang did with an exported drafter, from the records of ``drafthook``:

* ``compare_params``: every parameter SGLang's draft holds, against the tensor the export gave it (q/k/v stacked
  into ``qkv_proj``, gate/up into ``gate_up_proj`` as SGLang's loader stacks them) and the embeddings against the
  target's: ``unloaded`` lists parameters that hold anything else (SGLang leaves unloaded ones uninitialised).
* ``compare_logits``: the trained network (the export loaded back into speculators' model) run on exactly the inputs
  SGLang gave its draft (aux states, shifted tokens, positions) against the draft's own outputs: per-row relative
  error of the logits (the last row from SGLang's logits processor, every row from its normed hidden state and its
  lm_head) and argmax agreement.
* ``fed_layers``: which target layers SGLang fed the draft's ``fc``, identified against a transformers forward of
  the same prompt; the doctor's prediction for the config (``layers``) must name the same.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle3kit.drafter.export import load_sglang_export
from eagle3kit.layers import token_errors


def records(out_dir) -> dict:
    """rid -> tensors of each request the draft hook saw."""
    return {p.stem: load_file(str(p)) for p in sorted(Path(out_dir).glob("*.safetensors"))
            if p.name != "draft_params.safetensors"}


def expected_params(export_dir) -> dict:
    """SGLang's parameter names (relative to the draft's LlamaModel, plus ``lm_head.weight``) -> the exported tensor."""
    t = load_file(str(Path(export_dir) / "model.safetensors"))
    cfg = json.loads((Path(export_dir) / "config.json").read_text())
    if (cfg.get("architectures") or [""])[0] == "Eagle3DeepseekV2ForCausalLM":
        return mla_expected_params(t)
    L = "layers.0."
    exp = {"fc.weight": t["fc.weight"], "norm.weight": t["norm.weight"], "lm_head.weight": t["lm_head.weight"],
           L + "self_attn.qkv_proj.weight": torch.cat([t[L + "self_attn.q_proj.weight"], t[L + "self_attn.k_proj.weight"],
                                                      t[L + "self_attn.v_proj.weight"]]),
           L + "self_attn.o_proj.weight": t[L + "self_attn.o_proj.weight"],
           L + "mlp.gate_up_proj.weight": torch.cat([t[L + "mlp.gate_proj.weight"], t[L + "mlp.up_proj.weight"]]),
           L + "mlp.down_proj.weight": t[L + "mlp.down_proj.weight"]}
    for n in ("input_layernorm", "post_attention_layernorm", "hidden_norm"):
        exp[f"{L}{n}.weight"] = t[f"{L}{n}.weight"]
    for k in t:
        if k.startswith("fc_norm."):
            exp[k] = t[k]
    return exp


def mla_expected_params(t: dict) -> dict:
    """The MLA head's parameters as SGLang holds them, relative to its ``Eagle3MLAModel`` (kimi_k25_eagle3.py:413-486):
    ``layers.0.`` is ``midlayer.``, q_a_proj and kv_a_proj_with_mqa concatenated into ``fused_qkv_a_proj_with_mqa``,
    gate/up into ``gate_up_proj``; kv_b_proj stays a parameter (w_kc / w_vc are views split from it after loading)."""
    L, M, a = "layers.0.", "midlayer.", "self_attn."
    exp = {k: t[k] for k in ("fc.weight", "norm.weight", "lm_head.weight")}
    exp[M + a + "fused_qkv_a_proj_with_mqa.weight"] = torch.cat([t[L + a + "q_a_proj.weight"],
                                                                 t[L + a + "kv_a_proj_with_mqa.weight"]])
    for n in ("q_a_layernorm", "q_b_proj", "kv_a_layernorm", "kv_b_proj", "o_proj"):
        exp[f"{M}{a}{n}.weight"] = t[f"{L}{a}{n}.weight"]
    exp[M + "mlp.gate_up_proj.weight"] = torch.cat([t[L + "mlp.gate_proj.weight"], t[L + "mlp.up_proj.weight"]])
    exp[M + "mlp.down_proj.weight"] = t[L + "mlp.down_proj.weight"]
    for n in ("input_layernorm", "post_attention_layernorm", "hidden_norm"):
        exp[f"{M}{n}.weight"] = t[f"{L}{n}.weight"]
    exp.update({k: t[k] for k in t if k.startswith("fc_norm.")})
    return exp


def compare_params(sglang_params: dict, export_dir, target_path) -> dict:
    from speculators.utils.loading import load_model_layers

    exp = expected_params(export_dir)
    embed = load_model_layers(["embed_tokens.weight"], str(target_path))["embed_tokens.weight"]
    unloaded, checked = [], []
    for name, value in sorted(sglang_params.items()):
        want = embed if name == "embed_tokens.weight" else exp.get(name)
        ok = want is not None and tuple(want.shape) == tuple(value.shape) and torch.equal(want.to(value.dtype), value)
        (checked if ok else unloaded).append(name)
    never_held = sorted(set(exp) - set(sglang_params))
    return {"export_params_checked": len(checked), "export_params_unloaded": len(unloaded),
            "export_params_unloaded_names": unloaded, "export_tensors_not_held": never_held}


@torch.no_grad()
def compare_logits(recs: dict, export_dir, sglang_lm_head: torch.Tensor | None = None, device: str = "cpu") -> dict:
    """The trained drafter on SGLang's own draft inputs, against SGLang's draft outputs."""
    from eagle3kit.drafter.ttt import draft_steps

    model, _, _ = load_sglang_export(export_dir)
    model = model.to(device).float().eval()
    last_errs, row_errs, agree, rows = [], [], 0, 0
    for rid, r in recs.items():
        n = r["input_ids"].shape[0]
        logits = next(draft_steps(model, r["aux"].to(device).float(), r["input_ids"].to(device).long(),
                                  torch.zeros(n, dtype=torch.long, device=device), r["positions"].to(device).long(), 1))
        logits = logits.float().cpu()
        if "last_logits" in r:
            last_errs.append(float(token_errors(logits[-1:], r["last_logits"][None])[0]))
        if sglang_lm_head is not None:
            theirs = r["normed"].float() @ sglang_lm_head.float().T
            row_errs.append(float(token_errors(logits, theirs).max()))
            agree += int((logits.argmax(-1) == theirs.argmax(-1)).sum())
            rows += n
    out = {"export_logits_requests": len(recs)}
    if last_errs:
        out["export_logits_max_rel_err"] = max(last_errs)
    if row_errs:
        out["export_logits_all_rows_max_rel_err"] = max(row_errs)
        out["export_logits_argmax_agreement"] = agree / rows if rows else 0.0
    return out


@torch.no_grad()
def fed_layers(aux: torch.Tensor, prompt_ids, target_path, device: str = "cpu") -> dict:
    """Which input_of_layer states ``aux`` ([T, n * H], SGLang's fc input over the prompt) holds, by slot."""
    from eagle3kit.layers import identify
    from eagle3kit.target import load_model

    tok, model = load_model(Path(target_path), dtype="float32", device=device)
    pre = {}
    h = model.model.norm.register_forward_hook(lambda m, a, o: pre.__setitem__("x", a[0].detach()))
    try:
        out = model(input_ids=torch.tensor([list(prompt_ids)], device=device), output_hidden_states=True)
    finally:
        h.remove()
    hs = out.hidden_states
    L = len(hs) - 1
    cands = {k: hs[k][0].float().cpu() for k in range(1, L)}
    cands[L] = pre["x"][0].float().cpu()
    H = cands[1].shape[-1]
    n = aux.shape[-1] // H
    ids, errs = [], []
    for j in range(n):
        best, err, _ = identify(aux[:, j * H:(j + 1) * H].float(), cands)
        ids.append(int(best))
        errs.append(err)
    return {"fed_layer_ids": ids, "fed_layer_rel_err": errs}


def verify_doctor(export_dir, recs: dict, target_path, device: str = "cpu") -> dict:
    """SGLang's fed layers (by value) against the doctor's prediction for this config, and the doctor's verdict."""
    from eagle3kit.layers import sglang_convention, sglang_default_aux, to_input_of_layer
    from eagle3kit.target import TargetInfo

    cfg = json.loads((Path(export_dir) / "config.json").read_text())
    meta = json.loads((Path(export_dir) / "eagle3kit.json").read_text())
    info = TargetInfo.read(Path(target_path))
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    predicted = sglang_default_aux(info.num_layers) if ids is None else \
        to_input_of_layer(ids, sglang_convention(info.model_type), info.num_layers)
    r = next(r for r in recs.values() if "prompt_ids" in r)
    fed = fed_layers(r["aux"], _prompt_from_record(r), target_path, device)
    from eagle3kit.doctor import diagnose

    # the doctor's whole diagnosis: layers, EAGLE-3.1 options against training, the MLA head's tensors
    diag = diagnose(export_dir, target_path)
    return {**fed, "doctor_predicted_layer_ids": predicted, "doctor_verified": fed["fed_layer_ids"] == predicted,
            "doctor_ok": diag.ok, "doctor_findings": str(diag), "trained_layer_ids": meta["capture_layer_ids"][:-1]}


def _prompt_from_record(r: dict) -> list[int]:
    """The prompt x_0..x_{T-1} whose aux states a draft-extend record holds (attached by ``attach_prompts``)."""
    return r["prompt_ids"].tolist()


def attach_prompts(recs: dict, prompts_by_rid: dict) -> dict:
    """Add each request's prompt to its record, checked: SGLang feeds row t the next token x_{t+1}."""
    for rid, r in recs.items():
        if rid in prompts_by_rid:
            p = torch.tensor(prompts_by_rid[rid], dtype=torch.int64)
            if p.shape[0] != r["input_ids"].shape[0] or not torch.equal(p[1:], r["input_ids"][:-1].long()):
                raise ValueError(f"{rid}: the draft's input tokens are not the prompt shifted by one (prompt "
                                 f"{p.shape[0]} tokens, draft extend {r['input_ids'].shape[0]} rows from position "
                                 f"{int(r['positions'][0]) if r['positions'].numel() else None}: a cached prefix?)")
            r["prompt_ids"] = p
    return recs
