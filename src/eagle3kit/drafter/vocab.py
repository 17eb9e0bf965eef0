"""The draft vocabulary: the ``N`` most frequent target tokens among loss-masked (assistant) tokens.

Layout exactly as speculators (``train/vocab_mapping.py``) and SpecForge write it and SGLang 0.5.14 reads it
(``llama_eagle3.py``: ``hot_token_id = d2t + arange(N)``):
  ids  the chosen target ids, ascending; ties in frequency broken by the lower id; padded with the lowest unused
       ids when fewer than N tokens occur
  d2t  int64 [N]  offsets: target id = draft id + d2t[draft id]
  t2d  bool  [V]  True for target ids in the draft vocabulary
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftVocab:
    ids: torch.Tensor  # int64 [N], ascending target ids
    vocab_size: int  # the target's V

    @property
    def size(self) -> int:
        return int(self.ids.numel())

    @property
    def d2t(self) -> torch.Tensor:
        return self.ids - torch.arange(self.size, dtype=torch.int64)

    @property
    def t2d(self) -> torch.Tensor:
        m = torch.zeros(self.vocab_size, dtype=torch.bool)
        m[self.ids] = True
        return m

    def target_to_draft(self) -> torch.Tensor:
        """int64 [V]: the draft index of each target id, -1 where it has none."""
        out = torch.full((self.vocab_size,), -1, dtype=torch.int64)
        out[self.ids] = torch.arange(self.size, dtype=torch.int64)
        return out

    def coverage(self, freq: torch.Tensor) -> float:
        """The share of loss-masked tokens (by ``freq``) that the draft vocabulary can propose."""
        total = float(freq.sum())
        return float(freq[self.ids].sum()) / total if total else 0.0

    def state(self) -> dict:
        return {"ids": self.ids.clone(), "vocab_size": self.vocab_size}

    @classmethod
    def from_state(cls, state: dict) -> "DraftVocab":
        return cls(state["ids"].to(torch.int64), int(state["vocab_size"]))

    @classmethod
    def from_d2t(cls, d2t: torch.Tensor, vocab_size: int) -> "DraftVocab":
        ids = d2t.to(torch.int64) + torch.arange(d2t.numel(), dtype=torch.int64)
        if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size or (ids[1:] <= ids[:-1]).any()):
            raise ValueError("d2t does not describe ascending target ids inside the vocabulary")
        return cls(ids, vocab_size)


def count_tokens(token_ids: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Add the loss-masked tokens of one sample to ``out`` (int64 [V])."""
    out = torch.zeros(vocab_size, dtype=torch.int64) if out is None else out
    ids = token_ids[loss_mask.to(torch.bool)].to(torch.int64)
    if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token ids outside the target vocabulary [0, {vocab_size}): the data set was made for "
                         f"another tokenizer")
    out += torch.bincount(ids, minlength=vocab_size)
    return out


def build(freq: torch.Tensor, size: int) -> DraftVocab:
    """The ``size`` most frequent ids (ties: lower id first), padded with the lowest unused ids, ascending."""
    vocab_size = int(freq.numel())
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft_vocab_size {size}: choose 1..{vocab_size} (the target's vocabulary)")
    order = torch.sort(-freq.to(torch.int64), stable=True).indices  # stable: lower id first within a tie
    seen = order[:min(size, int((freq > 0).sum()))].tolist()
    if len(seen) < size:
        chosen = set(seen)
        seen += [i for i in range(vocab_size) if i not in chosen][:size - len(seen)]
    return DraftVocab(torch.tensor(sorted(seen), dtype=torch.int64), vocab_size)
