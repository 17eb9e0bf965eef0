"""The reference engine: a transformers forward that writes the same capture files as the SGLang hook.

On the CPU it is the engine of the embedded default; beside SGLang it is the yardstick. Layer ids use the
"input of layer k" convention: ``hidden_states[k]`` of transformers for k < L; the final slot (k = L) is the last
layer's output *before* the final norm (transformers' ``hidden_states[L]`` is after it), read at the norm's input.
"""
from __future__ import annotations

from pathlib import Path

import torch

from eagle3kit.capture.format import capture_metadata, write_sample
from eagle3kit.target import TargetInfo, load_model


def head_kw(model) -> dict:
    """The forward's keywords that keep the LM head to the last position (``logits_to_keep``, where the model takes
    it): the capture reads hidden states only, and the head's logits of every position are a third of a forward's
    work on the embedded default (49,152 columns)."""
    import inspect

    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def fp32_gemms(model) -> None:
    """Each linear layer of a bf16 ``model`` on the CPU as a GPU's bf16 GEMM computes it: the bf16 operands
    multiplied and summed in fp32, the output rounded to bf16 (only the order of the sum differs). A CPU without
    bf16 instructions runs torch's own bf16 matmul 4x slower than this (5.1 of a 5.6-s forward of 192 tokens on the
    embedded default): the bf16 engine that calibrates the capture check's bounds (spec.bf16_engine)."""
    import types

    import torch.nn.functional as F

    def forward(self, x):
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)

    for m in model.modules():
        if type(m) is torch.nn.Linear:
            m.forward = types.MethodType(forward, m)


class ReferenceEngine:
    def __init__(self, model_path, aux_layer_ids, final_normed: bool = False, dtype: str = "float32",
                 device: str = "cpu", model=None, tokenizer=None):
        self.path = Path(model_path)
        self.info = TargetInfo.read(self.path)
        L = self.info.num_layers
        bad = [k for k in aux_layer_ids if not 1 <= k < L]
        if bad:
            raise ValueError(f"aux_layer_ids {bad}: in the 'input of layer k' convention k must be in [1, {L - 1}]")
        self.layer_ids = [int(k) for k in aux_layer_ids] + [L]
        self.final_normed = final_normed
        if model is None:
            tokenizer, model = load_model(self.path, dtype=dtype, device=device, tokenizer=tokenizer)
            if dtype == "bfloat16" and torch.device(device).type == "cpu":
                fp32_gemms(model)
        self.tokenizer, self.model = tokenizer, model
        self.device = next(model.parameters()).device
        self._pre_norm = None
        self._norm = self._find_norm(model)
        self._norm.register_forward_hook(self._on_norm)
        self.head_kw = head_kw(model)

    @staticmethod
    def _find_norm(model):
        inner = getattr(model, "model", model)
        norm = getattr(inner, "norm", None)
        if norm is None:
            raise ValueError(f"{type(model).__name__}: no final norm at model.model.norm")
        return norm

    def _on_norm(self, module, args, output):
        self._pre_norm = args[0].detach()

    @torch.no_grad()
    def _forward(self, input_ids, attention_mask=None, past_key_values=None):
        kw = {"past_key_values": past_key_values, "use_cache": True} if past_key_values is not None else {"use_cache": False}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, **kw,
                         **self.head_kw)
        hs = out.hidden_states
        stack = [hs[k] for k in self.layer_ids[:-1]] + [self._pre_norm]
        result = {"hidden_states": torch.stack(stack, dim=2)}  # [B, T, n, H]
        if self.final_normed:
            result["final_normed"] = hs[-1]
        return result

    def hidden(self, token_ids: list[int]) -> dict:
        """Captured tensors of one prompt, one forward."""
        ids = torch.tensor([token_ids], device=self.device)
        r = self._forward(ids)
        return self._unbatch(r, 0, len(token_ids), token_ids)

    def hidden_batched(self, prompts: list[list[int]]) -> list[dict]:
        """Several prompts in one right-padded forward (positions stay 0..n-1 for every prompt)."""
        n = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.full((len(prompts), n), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), n), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = torch.tensor(p)
            mask[i, :len(p)] = 1
        r = self._forward(ids.to(self.device), mask.to(self.device))
        return [self._unbatch(r, i, len(p), p) for i, p in enumerate(prompts)]

    def hidden_chunked(self, token_ids: list[int], chunk: int) -> dict:
        """The prompt in chunks of ``chunk`` tokens over a KV cache, as a chunked prefill runs it."""
        from transformers import DynamicCache

        cache = DynamicCache()
        parts = []
        for s in range(0, len(token_ids), chunk):
            ids = torch.tensor([token_ids[s:s + chunk]], device=self.device)
            parts.append(self._forward(ids, past_key_values=cache))
        joined = {k: torch.cat([p[k] for p in parts], dim=1) for k in parts[0]}
        return self._unbatch(joined, 0, len(token_ids), token_ids)

    @staticmethod
    def _unbatch(r: dict, i: int, n: int, token_ids) -> dict:
        out = {k: v[i, :n].cpu() for k, v in r.items()}
        out["token_ids"] = torch.tensor(token_ids, dtype=torch.int64)
        return out

    def metadata(self, rank: int = 0, tp_size: int = 1) -> dict:
        return capture_metadata("transformers", str(self.path), rank, tp_size, self.layer_ids,
                                self.info.num_layers, self.final_normed)

    def capture(self, out_dir, key: str, token_ids: list[int], rank: int = 0, tp_size: int = 1,
                storage: str = "bf16", tensors: dict | None = None) -> dict:
        """Write ``<key>.rank<r>.safetensors`` and its marker, exactly as the SGLang hook does."""
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        tensors = tensors if tensors is not None else self.hidden(token_ids)
        return write_sample(Path(out_dir), key, rank, tensors, self.metadata(rank, tp_size), storage,
                            extra_marker={"rid": key, "chunks": 1})
