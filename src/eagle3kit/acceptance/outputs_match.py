"""How far servers' replies agree: each speculative server's against plain's (greedy speculative decoding should give
the plain target's tokens; bf16 verify forwards and plain decode part at near-ties), plain's and main's against the
replies stored in the data set, and the share of timed tokens past the end of a reply. Of the online experiment's
batch-1 replies (``experiment.run`` keeps them, first round)."""
from __future__ import annotations

import statistics

from eagle3kit.acceptance import online


def replies(r: dict, eos: set) -> list:
    """Batch 1's replies of one server's first round, each cut at its first end-of-sequence token (``eos``)."""
    return [online.reply_end(ids, eos) for ids in r["by_concurrency"][1]["rounds"][0].get("_outputs") or []]


def outputs_match_plain(results: dict, eos: set = frozenset()) -> dict:
    """Greedy speculative decoding should give the plain target's tokens; bf16 verify forwards and plain decode
    part at near-ties, so besides whole-reply identity: the mean share of each reply before the first difference.
    Replies are compared as far as their first end-of-sequence token (``eos``: the timed requests go on past it).
    Returns {server: ``match``'s figures} of batch 1's replies."""
    plain = results["servers"].get("plain")
    if not plain:
        return {}
    base = replies(plain, eos)
    out = {}
    for name, r in results["servers"].items():
        if name == "plain" or "by_concurrency" not in r:
            continue
        m = match(base, replies(r, eos))
        if m:
            out[name] = m
    return out


def tokens_past_eos(results: dict, eos: set) -> dict:
    """Per server, the share of batch 1's timed tokens (first round) that came after the reply's first
    end-of-sequence token: the part of the equal work that no stopping request would have done."""
    out = {}
    for name, r in results["servers"].items():
        outs = [ids for ids in (r.get("by_concurrency", {}).get(1, {}).get("rounds") or [{}])[0].get("_outputs") or []
                if ids]
        total = sum(len(ids) for ids in outs)
        if total:
            out[name] = sum(len(ids) - len(online.reply_end(ids, eos)) for ids in outs) / total
    return out


def match(base: list, outs: list) -> dict:
    """Two lists of replies (token ids or texts), pair by pair: "identical" (share of pairs), "identical_prompts" (how
    many), "prompts" (pairs compared), "common_prefix" (mean share of a reply before the first difference); {}
    without pairs."""
    pairs = [(a, b) for a, b in zip(base, outs) if a and b]
    if not pairs:
        return {}
    same = sum(a == b for a, b in pairs)
    return {"identical": same / len(pairs), "identical_prompts": same, "prompts": len(pairs),
            "common_prefix": statistics.fmean(common_prefix(a, b) / max(len(a), len(b)) for a, b in pairs)}


def outputs_match_stored(results: dict, stored: list[str], decode, eos: set = frozenset()) -> dict:
    """How far batch 1's replies (plain's and main's, first round) follow the replies stored in the data set for the
    same conversations (``online.first_reply_texts``), compared as text (``decode``: token ids to text). The offline
    walk over "the same replies" (``offline_walk_same_replies``) walks the stored ones: where online decoding leaves
    them, the two count different text (gpu-drafter-pipeline-13: that walk 8.9 % below online, -12: 1.7 %)."""
    out = {}
    for name in ("plain", "main"):
        r = results["servers"].get(name, {})
        if "by_concurrency" not in r:
            continue
        texts = [decode(ids).strip() if ids else "" for ids in replies(r, eos)]
        m = match([t.strip() for t in stored], texts)
        if m:
            out[name] = m
    return out


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
