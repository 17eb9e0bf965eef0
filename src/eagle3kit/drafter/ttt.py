"""The training-time-test (TTT) forward: ``steps`` chained draft steps over one packed row, as serving chains them.

Row t of a packed batch stands for the draft started after position t of its sample (see ``data.align``): its
aux states ``g_t`` (target layers at position t) and the next token ``x_{t+1}``. Step 0 projects ``g_t`` with
``fc``; step k > 0 feeds the previous step's own output (pre-norm, or post-norm with ``norm_output``) with the
embedding of token ``x_{t+1+k}``: on the target's greedy path (regenerated data) that is the token the draft
proposed whenever the chain is still accepted, which is the only case acceptance counts. Attention: step 0 is
causal within the sample; step k also sees the row's own keys of steps 1..k (the diagonal blocks speculators
builds), which is what SGLang's draft sees in its KV cache while chaining from one verified position.

This runs speculators' ``Eagle3DraftModel`` modules (``fc``, ``fc_norm``, ``layers``, ``norm``, ``lm_head``,
``rotary_emb``) in the order of its own ``forward``, but returns each step's logits: speculators' forward scores
against a teacher restricted to the draft vocabulary, which cannot see a target token outside it (it would
overstate acceptance and cannot mask such rows, as SpecForge's loss does).
"""
from __future__ import annotations

import warnings

import torch
from transformers import DynamicCache

from speculators.models.eagle3.attention import extend_dense_mask_for_draft_tokens


def causal_doc_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Boolean [1, 1, S, S] mask for SDPA (True: attend): row t sees rows <= t of its own sample."""
    idx = torch.arange(doc_ids.shape[0], device=doc_ids.device)
    return ((idx[:, None] >= idx[None, :]) & (doc_ids[:, None] == doc_ids[None, :]))[None, None]


def shifted(x: torch.Tensor, k: int, fill=0) -> torch.Tensor:
    """x[t + k] at row t (``fill`` past the end)."""
    if k == 0:
        return x
    return torch.cat([x[k:], x.new_full((min(k, x.shape[0]),) + tuple(x.shape[1:]), fill)])[: x.shape[0]]


def draft_steps(model, aux: torch.Tensor, input_ids: torch.Tensor, doc_ids: torch.Tensor,
                position_ids: torch.Tensor, steps: int):
    """Yield the logits [S, draft_vocab] of each chained step over one packed row of S rows.

    aux [S, n_aux * H], input_ids [S] (x_{t+1} at row t), doc_ids [S], position_ids [S]."""
    warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
    s = aux.shape[0]
    hidden = aux[None].to(model.fc.weight.dtype)
    if getattr(model, "fc_norm", None) is not None:
        chunks = hidden.chunk(len(model.fc_norm), dim=-1)
        hidden = torch.cat([n(c) for n, c in zip(model.fc_norm, chunks)], dim=-1)
    hidden = model.fc(hidden)
    mask = causal_doc_mask(doc_ids)
    cache = DynamicCache()
    pos = position_ids[None]
    for k in range(steps):
        ids = shifted(input_ids, k)[None]
        with torch.no_grad():
            embeds = model.embed_tokens(ids).to(hidden.dtype)
        h = torch.cat([embeds, hidden], dim=-1)
        pos_emb = model.rotary_emb(h, pos)
        cache_position = torch.arange(k * s, (k + 1) * s, device=aux.device)
        for layer in model.layers:
            h = layer(h, attention_mask=mask, position_ids=pos, past_key_values=cache, cache_position=cache_position,
                      position_embeddings=pos_emb)
        if model.config.norm_output:
            hidden = model.norm(h)
            logits = model.lm_head(hidden)
        else:
            hidden = h
            logits = model.lm_head(model.norm(h))
        yield logits[0]
        mask = extend_dense_mask_for_draft_tokens(mask, s)
        pos = pos + 1


class TTTModule(torch.nn.Module):
    """The drafter with the TTT forward as its ``forward`` (what DDP wraps, so its gradient hooks fire)."""

    def __init__(self, drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, aux, input_ids, doc_ids, position_ids, steps: int):
        return list(draft_steps(self.drafter, aux, input_ids, doc_ids, position_ids, steps))
