"""Regeneration: replace each assistant turn with the target's own answer (greedy), as EAGLE-3 training recommends,
so that the drafter learns the target's distribution rather than the data set's authors'.

Generators take the conversation so far (ending with a user turn) and return the reply text:
``TransformersGenerator`` (CPU reference) and ``SGLangGenerator`` (a running server's ``/generate``).
"""
from __future__ import annotations

import itertools
import threading
import time


class ContextFull(Exception):
    """The conversation so far already fills the context: later turns would be cut off the sample anyway."""


class TransformersGenerator:
    def __init__(self, tokenizer, model, max_context: int | None = None):
        self.tok, self.model, self.max_context = tokenizer, model, max_context

    def __call__(self, messages, max_new_tokens: int) -> str:
        import torch

        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = self.tok(text, add_special_tokens=False, return_tensors="pt").input_ids.to(self.model.device)
        if self.max_context and ids.shape[1] >= self.max_context:
            raise ContextFull(f"{ids.shape[1]} tokens")
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                      do_sample=False)
        return self.tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


class SGLangGenerator:
    """Greedy replies from running SGLang servers (capture servers too: their hooks ignore these rids), the
    requests spread over ``urls`` in turn (data-parallel servers). ``urls`` may be a callable that gives them on the
    first reply needed (so that a resumed run whose replies are all cached starts no server)."""

    def __init__(self, urls, tokenizer, timeout: float = 600, max_context: int | None = None):
        self._urls, self._resolved = urls, None
        self.max_context = max_context
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

    def prepare(self) -> None:
        """Resolve the servers now (start them, when ``urls`` is a callable): a time budget then counts replies, not
        the servers' start (about 2 min for SmolLM2 on the H200, its CUDA graphs captured)."""
        _ = self.urls

    def add_url(self, url: str) -> None:
        """Spread the next requests over one more server (a helper that became healthy meanwhile)."""
        with self._lock:
            if self._resolved is None:
                self._resolve()
            self._resolved = [*self._resolved, url]

    def __call__(self, messages, max_new_tokens: int) -> str:
        import requests

        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = self.tok(text, add_special_tokens=False).input_ids
        if self.max_context and len(ids) >= self.max_context:
            raise ContextFull(f"{len(ids)} tokens")
        url = self.urls[next(self._turn) % len(self.urls)]
        r = requests.post(url + "/generate", timeout=self.timeout, json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}})
        if r.status_code == 400:  # SGLang refuses a prompt longer than its context: end the conversation there
            raise ContextFull(f"server refused {len(ids)} tokens: {r.text[:200]}")
        r.raise_for_status()
        return r.json()["text"].strip()


def regenerate(conversations, generate, max_new_tokens: int = 512, concurrency: int = 1, deadline: float | None = None):
    """New conversations whose assistant turns are the target's replies to the preceding turns, yielded as each is
    finished (so that a caller keeps it at once: a crash loses no finished conversation, where waiting for the order
    held back every reply behind one long conversation, 0 of 2,754 written after 100 s on 2026-12-01).
    ``deadline`` (a ``time.monotonic()`` value): no conversation starts after it; those started are finished. As
    conversations start in order, the ones yielded are then a prefix of ``conversations`` (not in that order)."""
    def one(conv):
        if deadline is not None and time.monotonic() >= deadline:
            return None
        messages, cut = [], None
        for m in conv["messages"]:
            if m["role"] == "assistant":
                try:
                    messages.append({"role": "assistant", "content": generate(messages, max_new_tokens)})
                except ContextFull as e:  # the sample is cut at the context anyway: keep the turns so far
                    cut = str(e)
                    messages = messages[:-1] if messages and messages[-1]["role"] == "user" else messages
                    break
            else:
                messages.append(m)
        return {**conv, "messages": messages, "regenerated": True, **({"cut_at_context": cut} if cut else {})}
    if concurrency <= 1:
        for conv in conversations:
            r = one(conv)
            if r is None:  # past the deadline: so is every later one
                return
            yield r
        return
    from concurrent.futures import ThreadPoolExecutor, as_completed

    pool = ThreadPoolExecutor(concurrency)  # its threads take the conversations in order (a FIFO queue)
    try:
        for f in as_completed([pool.submit(one, conv) for conv in conversations]):
            r = f.result()
            if r is not None:  # None: not started, past the deadline
                yield r
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class HelperServers:
    """More servers for the replies on the same GPU: regeneration is bound by one SGLang scheduler's CPU (one core at
    100 % while the H200 showed 35 % use, 2026-12-01), so ``n`` more schedulers decode more conversations per minute.
    ``make(i)`` gives helper i (an unstarted ``SGLangServer``). Helper i's process starts ``(i + 1) * stagger``
    seconds after ``start()``, beside the capture server that starts at once: a server sizes its KV pool from the
    memory free when it loads, so servers started at the same moment can count the same memory twice; 20 s apart,
    each has allocated its pool before the next one looks (SmolLM2 on the H200: pool allocated 36 s after start).
    Starting them one after the other instead cost a minute each (CUDA graph capture: 57 and 64 s, 2026-12-01).
    Each joins ``on_healthy(url)`` as it becomes healthy. A helper that fails to start is reported (``failed``) and
    left out; it never stops the run. ``stop()`` stops them all, one still starting too."""

    def __init__(self, n: int, make, on_healthy, log=print, stagger: float = 20.0):
        self.n, self.make, self.on_healthy, self.log, self.stagger = n, make, on_healthy, log, stagger
        self.servers, self.healthy, self.failed = [], [], []
        self._stop = threading.Event()
        self._thread = None

    def start(self) -> "HelperServers":
        if self.n > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="regeneration-helpers", daemon=True)
            self._thread.start()
        return self

    def _fail(self, i: int, e: Exception) -> None:
        if not self._stop.is_set():
            self.failed.append(f"helper {i}: {type(e).__name__}: {str(e)[:300]}")
            self.log(f"regeneration helper {i} did not start ({type(e).__name__}); going on without it")

    def _run(self) -> None:
        started = []
        for i in range(self.n):
            if self._stop.wait(self.stagger):  # True: stop() came
                return
            try:
                srv = self.make(i)
                self.servers.append(srv)
                srv.start()
            except Exception as e:  # noqa: BLE001 - a helper is optional: reported, never fatal
                self._fail(i, e)
                continue
            if self._stop.is_set():  # stop() came while this one started
                srv.stop()
                return
            started.append((i, srv))
        for i, srv in started:
            try:
                seconds = srv.wait_healthy()
            except Exception as e:  # noqa: BLE001
                self._fail(i, e)
                continue
            if self._stop.is_set():
                return
            self.healthy.append(srv.url)
            self.on_healthy(srv.url)
            self.log(f"regeneration helper {i} serving at {srv.url}, {seconds:.0f} s after its start")

    def stop(self) -> None:
        from eagle3kit.capture.server import stop_all

        self._stop.set()
        stop_all(list(self.servers))  # at once: one shared grace, not one each
        if self._thread is not None:
            self._thread.join(timeout=60)
        stop_all(list(self.servers))  # one that the thread started while the first pass stopped the others
