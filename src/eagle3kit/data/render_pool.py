"""Rendering many conversations: one process, or a pool of worker processes on a host with the cores for it.

A chat template renders ~100-150 conversations a second on one core, so 600 K conversations would take over an hour
in one process. The workers import only this module and the tokenizer's (not torch): a pool starts in seconds."""
from __future__ import annotations

import os

from eagle3kit.data.render import ConversationRefused, render

PARALLEL_FROM = 2000  # conversations from which rendering runs in a pool (when cores allow)


def render_one(tokenizer, conv, max_tokens: int, min_loss_tokens: int):
    """One conversation's (input_ids, loss_mask) and None, or None and why it becomes no sample."""
    if not any(m.get("role") == "assistant" for m in conv["messages"]):  # e.g. regeneration cut at the context
        return None, "no assistant reply"
    try:
        r = render(tokenizer, conv["messages"], max_tokens=max_tokens)
    except ConversationRefused as e:  # templates that check the roles' order raise on one: a skip, counted
        return None, str(e)
    if sum(r.loss_mask) < min_loss_tokens:
        return None, f"fewer than {min_loss_tokens} reply token(s) within max_tokens={max_tokens}"
    return (r.input_ids, r.loss_mask), None


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container or launcher can narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def workers_for(n_convs: int) -> int:
    """Processes that render ``n_convs`` conversations: one below PARALLEL_FROM or on <= 2 cores (a pool's start
    costs more than it saves there), else one per core up to 16."""
    cores = usable_cores()
    return 1 if n_convs < PARALLEL_FROM or cores <= 2 else min(cores, 16)


_tokenizer = None  # a worker's tokenizer, set once per worker process


def _init(tokenizer) -> None:
    global _tokenizer
    _tokenizer = tokenizer


def _chunk(args):
    convs, max_tokens, min_loss_tokens = args
    return [render_one(_tokenizer, c, max_tokens, min_loss_tokens) for c in convs]


def render_all(tokenizer, convs: list, max_tokens: int, min_loss_tokens: int, workers: int | None = None) -> list:
    """``render_one`` of each conversation, in order; ``workers`` processes (None: ``workers_for``)."""
    return list(iter_render(tokenizer, convs, max_tokens, min_loss_tokens, workers))


def iter_render(tokenizer, convs: list, max_tokens: int, min_loss_tokens: int, workers: int | None = None):
    """``render_all`` one result at a time, in order, as the workers give them: a caller that keeps each sample
    compactly never holds the whole data set as lists of Python ints (~44 bytes a token)."""
    workers = workers_for(len(convs)) if workers is None else workers
    if workers <= 1:
        for c in convs:
            yield render_one(tokenizer, c, max_tokens, min_loss_tokens)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # forkserver: workers start from a clean process (the caller may hold threads: a server feeder, torch's)
    size = max(1, min(256, len(convs) // (workers * 8)))
    jobs = [(convs[a:a + size], max_tokens, min_loss_tokens) for a in range(0, len(convs), size)]
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("forkserver"), initializer=_init,
                               initargs=(tokenizer,))
    try:
        for part in pool.map(_chunk, jobs):
            yield from part
    finally:  # a caller that stops early (an error) does not wait for the rest to render
        pool.shutdown(wait=True, cancel_futures=True)
