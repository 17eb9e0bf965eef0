"""Regeneration: replace each assistant turn with the target's own answer (greedy), as EAGLE-3 training recommends,
so that the drafter learns the target's distribution rather than the data set's authors'.

Generators take the conversation so far (ending with a user turn) and return the reply text:
``TransformersGenerator`` (CPU reference) and ``SGLangGenerator`` (a running server's ``/generate``).
"""
from __future__ import annotations

import itertools
import threading


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
    """Greedy replies from running SGLang servers (capture servers too: their hooks ignore these rids), the
    requests spread over ``urls`` in turn (data-parallel servers). ``urls`` may be a callable that gives them on the
    first reply needed (so that a resumed run whose replies are all cached starts no server)."""

    def __init__(self, urls, tokenizer, timeout: float = 600):
        self._urls, self._resolved = urls, None
        if not callable(urls):
            self._resolve()
        self.tok, self.timeout = tokenizer, timeout
        self._turn = itertools.count()  # next() on a count is atomic under the GIL
        self._lock = threading.Lock()

    def _resolve(self) -> None:
        urls = self._urls() if callable(self._urls) else self._urls
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("SGLangGenerator needs at least one server url")
        self._resolved = urls

    @property
    def urls(self) -> list[str]:
        if self._resolved is None:
            with self._lock:
                if self._resolved is None:
                    self._resolve()
        return self._resolved

    def __call__(self, messages, max_new_tokens: int) -> str:
        import requests

        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = self.tok(text, add_special_tokens=False).input_ids
        url = self.urls[next(self._turn) % len(self.urls)]
        r = requests.post(url + "/generate", timeout=self.timeout, json={
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
