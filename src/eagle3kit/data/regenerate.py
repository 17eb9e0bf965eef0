"""Regeneration: replace each assistant turn with the target's own answer (greedy), as EAGLE-3 training recommends,
so that the drafter learns the target's distribution rather than the data set's authors'.

Generators take the conversation so far (ending with a user turn) and return the reply text:
``TransformersGenerator`` (CPU reference) and ``SGLangGenerator`` (a running server's ``/generate``).
"""
from __future__ import annotations


class TransformersGenerator:
    def __init__(self, tokenizer, model):
        self.tok, self.model = tokenizer, model

    def __call__(self, messages, max_new_tokens: int) -> str:
        import torch

        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = self.tok(text, add_special_tokens=False, return_tensors="pt").input_ids.to(self.model.device)
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                      do_sample=False)
        return self.tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


class SGLangGenerator:
    """Greedy replies from a running SGLang server (a capture server too: its hook ignores these rids)."""

    def __init__(self, url: str, tokenizer, timeout: float = 600):
        self.url, self.tok, self.timeout = url, tokenizer, timeout

    def __call__(self, messages, max_new_tokens: int) -> str:
        import requests

        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = self.tok(text, add_special_tokens=False).input_ids
        r = requests.post(self.url + "/generate", timeout=self.timeout, json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}})
        r.raise_for_status()
        return r.json()["text"].strip()


def regenerate(conversations, generate, max_new_tokens: int = 512, concurrency: int = 1):
    """New conversations whose assistant turns are the target's replies to the preceding turns, yielded in order
    as each is ready (so that a caller can keep them before the next one is generated)."""
    def one(conv):
        messages = []
        for m in conv["messages"]:
            if m["role"] == "assistant":
                messages.append({"role": "assistant", "content": generate(messages, max_new_tokens)})
            else:
                messages.append(m)
        return {**conv, "messages": messages, "regenerated": True}
    if concurrency <= 1:
        yield from map(one, conversations)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(concurrency) as pool:
        yield from pool.map(one, conversations)
