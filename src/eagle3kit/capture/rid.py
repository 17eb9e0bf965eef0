"""Request ids: how a capture knows which request a prefill row belongs to, and how long the prompt is.

The client sends ``rid = <prefix><key>.<n_tokens>``. The hook keeps rows of rids with the prefix only (SGLang's
warmup request has a random uuid rid, health checks ``HEALTH_CHECK_<uuid>``), and the token count tells it when
the chunks of a chunked prefill cover the whole prompt.
"""
from __future__ import annotations

import re

RID_PREFIX = "e3k-"
KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,199}$")


class RidError(ValueError):
    pass


def check_key(key: str) -> str:
    if not KEY_RE.match(key):
        raise RidError(f"capture key {key!r} must be 1-200 characters of letters, digits, '_', '.', '-' "
                       f"(it names files), starting with a letter or digit")
    return key


def make_rid(key: str, n_tokens: int, prefix: str = RID_PREFIX) -> str:
    if n_tokens <= 0:
        raise RidError(f"capture {key!r}: a prompt needs at least one token, got {n_tokens}")
    return f"{prefix}{check_key(key)}.{int(n_tokens)}"


def parse_rid(rid, prefix: str = RID_PREFIX):
    """(key, n_tokens) for our rids; None for anybody else's (warmup, health check, other clients).

    Raises RidError for a rid that carries our prefix but not the ``<key>.<n_tokens>`` form.
    """
    if not isinstance(rid, str) or not rid.startswith(prefix):
        return None
    body = rid[len(prefix):]
    key, _, n = body.rpartition(".")
    if not key or not n.isdigit() or int(n) <= 0:
        raise RidError(f"rid {rid!r} has the capture prefix {prefix!r} but not the form {prefix}<key>.<n_tokens>")
    return check_key(key), int(n)


def rid_kind(rid) -> str:
    """A label for rows the capture ignores, for the status counters."""
    if isinstance(rid, str) and rid.startswith("HEALTH_CHECK"):
        return "health_check"
    return "other"
