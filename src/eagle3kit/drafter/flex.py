"""The TTT attention as flex attention (GPUs): only the blocks a TTT step can see are computed.

The dense path (``ttt.causal_doc_mask`` + SDPA with a boolean mask) scores every pair of a [S, (k + 1) S] mask at
TTT step k, although step k's new keys are a diagonal (query t sees only its own key of steps 1..k). Over 5 steps
that is 15 S^2 scores for what causal attention within the samples plus 5 diagonals needs: at most 2.5 S^2. On
the H200 that dense attention took 53 % of a training step's device time (``gpu-drafter-pipeline-2/trainbench/
logs/compute-r2-profile.txt``: ``fmha_cutlass`` forward and backward).

Here the keys of all steps sit at fixed offsets of one KV of ``steps * S`` (step j's keys at [jS, (j + 1)S), zeros
for the steps not run yet, ``StepCache``), so every step has the same shapes and one compiled flex kernel serves
them all. Step k's ``BlockMask`` lists the blocks of the causal part within each sample (from ``create_block_mask``)
and, per query block, the diagonal block of each step 1..k; its ``mask_mod`` states the same rule element-wise
(``kv < S``: causal and the same sample; ``S <= kv < (k + 1) S``: ``kv % S == q``), so the eager reference (CPU)
and the compiled kernel agree, and the result equals the dense path's (tests/test_drafter_flex.py).
"""
from __future__ import annotations

import torch

IMPL = "eagle3kit_flex"  # the transformers attention implementation name the drafter is built with
BLOCK = 128  # flex attention's block size: rows are padded to a multiple of it

_compiled = None


def _flex_fn(device_type: str):
    """flex_attention, compiled on GPUs (one compile: every call has the same shapes); the eager reference on a CPU,
    where it materializes the scores (tests only)."""
    global _compiled
    from torch.nn.attention.flex_attention import flex_attention

    if device_type != "cuda":
        return flex_attention
    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **_):
    """transformers' attention interface: query [B, H, S, D], key/value [B, Hkv, KV, D], a ``BlockMask``."""
    out = _flex_fn(query.device.type)(query, key, value, block_mask=attention_mask, scale=scaling,
                                      enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(IMPL, attention)


register()


def uses_flex(model) -> bool:
    return getattr(model.config.transformer_layer_config, "_attn_implementation", None) == IMPL


class StepCache:
    """The KV "cache" of one TTT forward: step j's keys and values at [jS, (j + 1)S) of ``steps * S`` (zeros for steps
    not run yet). Duck-types the ``update`` of transformers' caches, which attention layers call."""

    def __init__(self, steps: int):
        self.steps = steps
        self.kv: dict[int, tuple[list, list]] = {}

    def update(self, key, value, layer_idx, *_, **__):
        ks, vs = self.kv.setdefault(layer_idx, ([], []))
        ks.append(key)
        vs.append(value)
        pad = self.steps - len(ks)
        if pad < 0:
            raise ValueError(f"TTT step {len(ks)} of a cache sized for {self.steps}")
        def padded(xs, x):  # keys and values may differ in head size (MLA: qk_nope + qk_rope against v_head)
            return torch.cat(xs + [x.new_zeros(x.shape[:2] + (pad * x.shape[2], x.shape[3]))], dim=2)
        return padded(ks, key), padded(vs, value)


def _mask_mod(doc: torch.Tensor, s: int, limit: torch.Tensor):
    def mod(b, h, q, kv):
        j = kv % s
        base = (kv < s) & (q >= j) & (doc[b, q] == doc[b, j])
        return base | ((kv >= s) & (kv < limit) & (j == q))
    return mod


def step_masks(doc_ids: torch.Tensor, steps: int) -> list:
    """One ``BlockMask`` per TTT step for ``doc_ids`` [rows, S] (S a multiple of ``BLOCK``) over a KV of
    ``steps * S`` (``StepCache``'s layout)."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    rows, s = doc_ids.shape
    if s % BLOCK:
        raise ValueError(f"rows of {s} tokens: flex attention needs a multiple of {BLOCK}")
    qb, dev = s // BLOCK, doc_ids.device
    base = create_block_mask(_mask_mod(doc_ids, s, torch.tensor(s, device=dev)), B=rows, H=None, Q_LEN=s, KV_LEN=s,
                             device=dev, BLOCK_SIZE=BLOCK)
    width = steps * qb

    def widen(idx):
        return torch.cat([idx, idx.new_zeros(idx.shape[:-1] + (width - idx.shape[-1],))], dim=-1)

    masks = []
    num, idx = base.kv_num_blocks, widen(base.kv_indices)
    full_num, full_idx = base.full_kv_num_blocks, (None if base.full_kv_indices is None
                                                   else widen(base.full_kv_indices))
    diag = torch.arange(qb, device=dev, dtype=idx.dtype).view(1, 1, qb, 1).expand(rows, idx.shape[1], qb, 1)
    for k in range(steps):
        if k:  # the diagonal block of step k's keys, after the blocks listed so far
            idx = idx.clone().scatter_(-1, (num + (k - 1)).unsqueeze(-1).to(idx.dtype), diag + k * qb)
        masks.append(BlockMask.from_kv_blocks(num + k, idx, full_num, full_idx, BLOCK_SIZE=BLOCK,
                                              mask_mod=_mask_mod(doc_ids, s, torch.tensor((k + 1) * s, device=dev)),
                                              seq_lengths=(s, width * BLOCK)))
    return masks
