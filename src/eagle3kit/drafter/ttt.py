"""The training-time-test (TTT) forward: ``steps`` chained draft steps over one packed row, as serving chains them.

Row t of a packed batch stands for the draft started after position t of its sample (see ``data.align``): its
aux states ``g_t`` (target layers at position t) and the next token ``x_{t+1}``. Step 0 projects ``g_t`` with
``fc``; step k > 0 feeds the previous step's own output (pre-norm, or post-norm with ``norm_output``) with the
embedding of token ``x_{t+1+k}``: on the target's greedy path (regenerated data) that is the token the draft
proposed whenever the chain is still accepted, which is the only case acceptance counts. Attention: step 0 is
causal within the sample; step k also sees the row's own keys of steps 1..k (the diagonal blocks speculators
builds), which is what SGLang's draft sees in its KV cache while chaining from one verified position. On GPUs the
masks are block-sparse (``flex``: only the blocks a step can see are computed); elsewhere dense (SDPA).

A micro-batch may hold several packed rows of equal length (``rows``; ``data.collate_rows`` pads them): they are
concatenated on the row axis and run as a batch of ``rows`` sequences, so attention stays within a row (its cost grows
with the row's length, not the micro-batch's) while one forward covers them all (fewer, larger kernels). On the H200
four rows of 4,096 ran at 62.8 K tokens/s beside another job, against 66.2 K for one row (records
gpu-drafter-pipeline-4 and -3): no gain measured yet.

This runs speculators' ``Eagle3DraftModel`` modules (``fc``, ``fc_norm``, ``layers``, ``norm``, ``lm_head``,
``rotary_emb``) in the order of its own ``forward``, but returns each step's logits: speculators' forward scores
against a teacher restricted to the draft vocabulary, which cannot see a target token outside it (it would
overstate acceptance and cannot mask such rows, as SpecForge's loss does).
"""
from __future__ import annotations

import warnings

import torch
from transformers import DynamicCache


def causal_doc_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Boolean [B, 1, S, S] mask for SDPA (True: attend) from doc ids [S] (B = 1) or [B, S]: row t sees rows <= t of
    its own sample."""
    d = doc_ids if doc_ids.dim() == 2 else doc_ids[None]
    idx = torch.arange(d.shape[1], device=d.device)
    return ((idx[:, None] >= idx[None, :]) & (d[:, :, None] == d[:, None, :]))[:, None]


def extend_mask_for_step(mask: torch.Tensor, s: int) -> torch.Tensor:
    """The mask of the next TTT step: ``mask`` [B, 1, S, KV] with S new key columns where query t sees only its own
    new key (speculators' ``extend_dense_mask_for_draft_tokens``, for B sequences)."""
    idx = torch.arange(s, device=mask.device)
    diag = (idx[:, None] == idx[None, :]).expand(mask.shape[0], 1, s, s)
    return torch.cat([mask, diag.to(mask.dtype)], dim=-1)


def shifted(x: torch.Tensor, k: int, fill=0) -> torch.Tensor:
    """x[t + k] at row t (``fill`` past the end)."""
    if k == 0:
        return x
    return torch.cat([x[k:], x.new_full((min(k, x.shape[0]),) + tuple(x.shape[1:]), fill)])[: x.shape[0]]


def _pad_rows(x: torch.Tensor, to: int, fill) -> torch.Tensor:
    """[rows, s, ...] padded with ``fill`` to [rows, to, ...]."""
    if x.shape[1] == to:
        return x
    return torch.cat([x, x.new_full((x.shape[0], to - x.shape[1]) + tuple(x.shape[2:]), fill)], dim=1)


def draft_steps(model, aux: torch.Tensor, input_ids: torch.Tensor, doc_ids: torch.Tensor,
                position_ids: torch.Tensor, steps: int, rows: int = 1, pad_to: int = 0):
    """Yield the logits [N, draft_vocab] of each chained step over ``rows`` packed rows of N / rows tokens each,
    concatenated (N rows of the data's alignment in all).

    aux [N, n_aux * H], input_ids [N] (x_{t+1} at row t), doc_ids [N], position_ids [N]. A drafter built with
    ``flex.IMPL`` attention runs ``flex``'s block-sparse masks instead of dense ones; its rows are padded (padding is
    a sample of its own, never in the logits) to ``pad_to`` rounded up to ``flex.BLOCK``, so that every micro-batch
    of a run has the same shapes (one compiled kernel)."""
    from eagle3kit.drafter import flex

    warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
    n = aux.shape[0]
    if rows < 1 or n % rows:
        raise ValueError(f"{n} rows do not split into {rows} packed rows of equal length")
    s = n // rows
    # x_{t+1+k}; at the end of a packed row this reads the next row's first tokens, which only such rows' own later
    # steps see (their keys are their own), and their loss never counts (``objective.valid_rows``)
    ids_of_step = [shifted(input_ids, k).view(rows, s) for k in range(steps)]
    hidden = aux.view(rows, s, -1).to(model.fc.weight.dtype)
    doc, pos = doc_ids.view(rows, s), position_ids.view(rows, s)
    sparse = flex.uses_flex(model)
    if sparse:
        sp = -(-max(s, pad_to) // flex.BLOCK) * flex.BLOCK
        hidden, doc, pos = _pad_rows(hidden, sp, 0), _pad_rows(doc, sp, -1), _pad_rows(pos, sp, 0)
        ids_of_step = [_pad_rows(i, sp, 0) for i in ids_of_step]
        masks, cache = flex.step_masks(doc, steps), flex.StepCache(steps)
    else:
        sp, mask, cache = s, causal_doc_mask(doc), DynamicCache()
    if getattr(model, "fc_norm", None) is not None:
        chunks = hidden.chunk(len(model.fc_norm), dim=-1)
        hidden = torch.cat([n(c) for n, c in zip(model.fc_norm, chunks)], dim=-1)
    hidden = model.fc(hidden)
    for k in range(steps):
        with torch.no_grad():
            embeds = model.embed_tokens(ids_of_step[k]).to(hidden.dtype)
        h = torch.cat([embeds, hidden], dim=-1)
        pos_emb = model.rotary_emb(h, pos)
        cache_position = torch.arange(k * sp, (k + 1) * sp, device=aux.device)
        for layer in model.layers:
            h = layer(h, attention_mask=masks[k] if sparse else mask, position_ids=pos, past_key_values=cache,
                      cache_position=cache_position, position_embeddings=pos_emb)
        hidden = model.norm(h) if model.config.norm_output else h
        out = hidden if model.config.norm_output else model.norm(h)
        yield model.lm_head(out[:, :s]).reshape(n, -1)
        if not sparse:
            mask = extend_mask_for_step(mask, s)
        pos = pos + 1


class TTTModule(torch.nn.Module):
    """The drafter with the TTT forward as its ``forward`` (what DDP wraps, so its gradient hooks fire)."""

    def __init__(self, drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, aux, input_ids, doc_ids, position_ids, steps: int, rows: int = 1, pad_to: int = 0):
        return list(draft_steps(self.drafter, aux, input_ids, doc_ids, position_ids, steps, rows, pad_to))
