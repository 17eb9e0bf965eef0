"""Render a conversation with the target's chat template into token ids and a loss mask (1 on assistant tokens:
the reply and its end-of-turn marker; 0 on system, user and template tokens).

Works for any template whose rendering of ``messages[:k]`` is a prefix of the rendering of ``messages[:k+1]``
(true of ChatML, Llama-3, Zephyr and most others); a template that is not gets a clear error.
"""
from __future__ import annotations

from dataclasses import dataclass


class TemplateError(ValueError):
    pass


class ConversationRefused(TemplateError):
    """The chat template raised on this conversation (templates that check the roles' order do): one conversation's
    problem, which extraction counts as a skip, not the template's."""


@dataclass
class Rendered:
    input_ids: list[int]
    loss_mask: list[int]
    text: str

    @property
    def n_tokens(self) -> int:
        return len(self.input_ids)


def _render(tok, messages, add_generation_prompt=False) -> str:
    from jinja2 import TemplateError as JinjaError

    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except JinjaError as e:
        raise ConversationRefused(f"the chat template refused it ({str(e)[:80]})") from None


def assistant_spans(tok, messages) -> tuple[str, list[tuple[int, int]]]:
    """The full text and the character spans of assistant turns."""
    if not getattr(tok, "chat_template", None):
        raise TemplateError("the tokenizer has no chat template: set tokenizer.chat_template or use a chat model")
    full = _render(tok, messages)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tok, messages[:k], add_generation_prompt=True)
        upto = _render(tok, messages[:k + 1])
        if not full.startswith(upto) or not upto.startswith(before):
            raise TemplateError(f"the chat template does not render turn by turn (turn {k} is not a prefix of the "
                                f"whole conversation); loss masks need a prefix-stable template")
        spans.append((len(before), len(upto)))
    return full, spans


def render(tok, messages, max_tokens: int | None = None) -> Rendered:
    text, spans = assistant_spans(tok, messages)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    if "offset_mapping" not in enc:  # a Python (not fast) tokenizer gives no offsets (Kimi-K2.5's tiktoken one)
        mask = _mask_by_prefixes(tok, text, spans, ids)
    else:
        mask, j = [], 0
        for a, b in enc["offset_mapping"]:
            while j < len(spans) and spans[j][1] <= a:
                j += 1
            mask.append(int(j < len(spans) and b > spans[j][0] and a < spans[j][1]))
    if max_tokens is not None:
        ids, mask = ids[:max_tokens], mask[:max_tokens]
    return Rendered(list(ids), mask, text)


def _mask_by_prefixes(tok, text: str, spans, ids) -> list[int]:
    """The loss mask without character offsets: each assistant span's token bounds are the token counts of the text
    before its start and up to its end, provided those prefixes tokenize as the start of the whole (chat templates
    put special tokens at the turns' edges, where tokenizers do not merge across); otherwise refused."""
    mask = [0] * len(ids)
    for a, b in spans:
        bounds = []
        for cut in (a, b):
            head = tok(text[:cut], add_special_tokens=False)["input_ids"]
            if list(ids[:len(head)]) != list(head):
                raise TemplateError(f"the tokenizer gives no character offsets and the text up to character {cut} (an "
                                    f"assistant turn's edge) does not tokenize as the start of the whole: the loss "
                                    f"mask cannot be placed. Fix: use the target's fast tokenizer (tokenizer.json)")
            bounds.append(len(head))
        mask[bounds[0]:bounds[1]] = [1] * (bounds[1] - bounds[0])
    return mask


def mask_spans(mask: list[int]) -> list[list[int]]:
    """Run-length form of a 0/1 mask: [[start, stop], ...] of the 1s (how the manifest stores it)."""
    out, start = [], None
    for i, v in enumerate(mask + [0]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            out.append([start, i])
            start = None
    return out


def spans_to_mask(spans, n: int) -> list[int]:
    mask = [0] * n
    for a, b in spans:
        mask[a:b] = [1] * (b - a)
    return mask
