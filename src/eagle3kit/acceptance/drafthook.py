"""A forward hook for SGLang's EAGLE3 draft model: what SGLang feeds the draft, what the draft computes, and the
weights SGLang loaded into it (loaded through ``--forward-hooks``, SGLang's own extension point).

SGLang 0.5.14 registers ``--forward-hooks`` in every ModelRunner, the draft worker's included, by fnmatch on
``named_modules()`` of the loaded model (``model_executor/hook_manager.py``); the factory gets only its config.
``LlamaForCausalLMEagle3``'s ``model`` (a LlamaModel with ``fc``) is called as
``model(input_ids, positions, forward_batch, input_embeds)`` and returns ``(normed hidden [T, H], [aux])``; for the
draft's prefill extend (``ForwardMode.EXTEND``), ``forward_batch.spec_info.hidden_states`` is the target's aux
states ``[T, n_aux * H_target]`` that ``fc`` projects: exactly what the drafter was trained on, if the layers agree.
Its ``logits_processor`` then gets that normed hidden state (the same tensor) and the draft's ``lm_head``.
The target's own ``model`` and ``logits_processor`` match the same names: they are told apart by ``fc`` and by the
hidden-state tensor's identity. Draft decode steps (DECODE, DRAFT_EXTEND_V2, CUDA-graph capture) are skipped.

Writes ``<out_dir>/<rid>.safetensors`` (aux, input_ids, positions, normed, last_logits) per request of ours (rid
prefix), and ``<out_dir>/draft_params.safetensors`` (every parameter of the draft model and its lm_head, as SGLang
holds them) once. Never raises into SGLang: errors go to ``<out_dir>/errors.txt``. Not for a measured server: the
writes are synchronous (this is a proof, run on its own server).
"""
from __future__ import annotations

import traceback
from pathlib import Path

import torch

FACTORY = "eagle3kit.acceptance.drafthook"
RID_PREFIX = "e3kdraft-"
_STATES: dict = {}


def draft_hooks(out_dir, rid_prefix: str = RID_PREFIX) -> list[dict]:
    cfg = {"out_dir": str(out_dir), "rid_prefix": rid_prefix}
    return [{"name": "e3k_draft_model", "target_modules": ["model"], "hook_factory": f"{FACTORY}:model_hook",
             "config": cfg},
            {"name": "e3k_draft_logits", "target_modules": ["logits_processor"],
             "hook_factory": f"{FACTORY}:logits_hook", "config": cfg}]


class _State:
    def __init__(self, config):
        self.out = Path(config["out_dir"])
        self.out.mkdir(parents=True, exist_ok=True)
        self.prefix = config["rid_prefix"]
        self.pending = None  # (normed tensor object, [(rid, tensors)])
        self.params: dict | None = None
        self.errors = 0

    def error(self, where: str) -> None:
        self.errors += 1
        if self.errors <= 20:
            with open(self.out / "errors.txt", "a") as f:
                f.write(f"{where}:\n{traceback.format_exc()}\n")


def _state(config) -> _State:
    key = config["out_dir"]
    if key not in _STATES:
        _STATES[key] = _State(config)
    return _STATES[key]


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _is_prefill(fb) -> bool:
    mode = getattr(fb, "forward_mode", None)
    return getattr(mode, "name", str(mode)) == "EXTEND"


def split_rows(rids, seq_lens, prefix: str):
    """(rid, index in the batch, start, stop) of our requests in a packed forward (rows in ``rids`` order; the
    logits processor's ``next_token_logits`` has one row per request of the batch, in the same order)."""
    out, a = [], 0
    for i, (rid, n) in enumerate(zip(rids, seq_lens)):
        n = int(n)
        if isinstance(rid, str) and rid.startswith(prefix):
            out.append((rid, i, a, a + n))
        a += n
    return out


def model_hook(config):
    st = _state(config)

    def hook(module, args, output):
        try:
            if not hasattr(module, "fc") or _capturing() or len(args) < 3:
                return
            fb = args[2]
            if not _is_prefill(fb) or not getattr(fb, "rids", None):
                return
            normed = output[0] if isinstance(output, tuple) else output
            aux = fb.spec_info.hidden_states
            rows = []
            for rid, i, a, b in split_rows(fb.rids, fb.extend_seq_lens_cpu, st.prefix):
                rows.append((rid, i, {"aux": aux[a:b].detach().cpu().clone(), "input_ids": args[0][a:b].cpu().clone(),
                                   "positions": args[1][a:b].cpu().clone(),
                                   "normed": normed[a:b].detach().cpu().clone()}))
            if rows and st.params is None:  # only once a request of ours is in the batch (not on warmup)
                st.params = {k: v.detach().to("cpu", copy=True) for k, v in module.named_parameters()}
            st.pending = (normed, rows) if rows else None
        except Exception:  # noqa: BLE001 - never raise into SGLang
            st.pending = None
            st.error("model_hook")
    return hook


def logits_hook(config):
    st = _state(config)

    def hook(module, args, output):
        try:
            if st.pending is None or len(args) < 3 or args[1] is not st.pending[0]:
                return
            _, rows = st.pending
            st.pending = None
            from safetensors.torch import save_file

            if st.params is not None and "lm_head.weight" not in st.params:
                st.params["lm_head.weight"] = args[2].weight.detach().to("cpu", copy=True)
                save_file({k: v.contiguous() for k, v in st.params.items()}, str(st.out / "draft_params.safetensors"))
            logits = getattr(output, "next_token_logits", None)
            for rid, i, t in rows:
                if logits is not None and i < logits.shape[0]:
                    t["last_logits"] = logits[i].detach().float().cpu().clone()
                save_file({k: v.contiguous() for k, v in t.items()}, str(st.out / f"{rid}.safetensors"))
        except Exception:  # noqa: BLE001
            st.error("logits_hook")
    return hook
