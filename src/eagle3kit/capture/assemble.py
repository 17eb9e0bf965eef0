"""Pure logic between a batched prefill and per-request captures (no SGLang, no GPU).

``select_rows``: which rows of a packed EXTEND batch belong to which of our requests.
``Reassembler``: joins the chunks of one request by prefix offset; a request whose first captured row is not
token 0 (a prefix-cache hit skipped those tokens) or whose chunks leave a gap is reported incomplete, never written.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import torch

from eagle3kit.capture.rid import RID_PREFIX, RidError, parse_rid, rid_kind


@dataclass(frozen=True)
class RowSpan:
    """Rows [start, stop) of the packed batch hold tokens [offset, offset + stop - start) of request ``key``."""
    rid: str
    key: str
    expected: int  # prompt length the client announced
    offset: int  # extend_prefix_len: tokens before this chunk (cached or earlier chunks)
    start: int
    stop: int


@dataclass
class Selection:
    spans: list[RowSpan]
    ignored: Counter = field(default_factory=Counter)  # rows of other rids, by kind
    bad_rids: list[tuple[str, str]] = field(default_factory=list)  # (rid, why)

    @property
    def n_rows(self) -> int:
        return sum(s.stop - s.start for s in self.spans)


def select_rows(rids, extend_seq_lens, extend_prefix_lens, prefix: str = RID_PREFIX) -> Selection:
    """Split a packed prefill (requests concatenated in ``rids`` order) into our requests' row spans."""
    if not (len(rids) == len(extend_seq_lens) == len(extend_prefix_lens)):
        raise ValueError(f"batch metadata disagree: {len(rids)} rids, {len(extend_seq_lens)} lengths, "
                         f"{len(extend_prefix_lens)} prefix lengths")
    sel = Selection(spans=[])
    start = 0
    for rid, n, pre in zip(rids, extend_seq_lens, extend_prefix_lens):
        n, pre = int(n), int(pre)
        try:
            parsed = parse_rid(rid, prefix)
        except RidError as e:
            sel.bad_rids.append((str(rid), str(e)))
            parsed = None
        if parsed is None:
            sel.ignored[rid_kind(rid)] += 1
        else:
            sel.spans.append(RowSpan(rid, parsed[0], parsed[1], pre, start, start + n))
        start += n
    return sel


def gather_index(sel: Selection, total_rows: int):
    """None when our spans are the whole batch in order (no gather needed), else the row indices to take."""
    if sel.spans and sel.spans[0].start == 0 and sel.spans[-1].stop == total_rows and sel.n_rows == total_rows:
        return None
    return torch.cat([torch.arange(s.start, s.stop) for s in sel.spans]) if sel.spans else torch.empty(0, dtype=torch.long)


@dataclass
class Piece:
    span: RowSpan
    tensors: dict  # name -> CPU tensor with this chunk's rows first


@dataclass
class Outcome:
    key: str
    rid: str
    status: str  # "ok" | "incomplete"
    tensors: dict | None = None
    reason: str = ""
    chunks: int = 0


class Reassembler:
    """Joins chunks per request; at most ``max_pending`` partial requests are held (oldest evicted as incomplete)."""

    def __init__(self, max_pending: int = 4096):
        self.pending: OrderedDict[str, list[Piece]] = OrderedDict()
        self.max_pending = max_pending

    def add(self, piece: Piece) -> list[Outcome]:
        s = piece.span
        out: list[Outcome] = []
        have = self.pending.get(s.rid)
        covered = sum(p.span.stop - p.span.start for p in have) if have else 0
        if have is None and s.offset != 0:
            return [Outcome(s.key, s.rid, "incomplete", reason=(
                f"prefix-cache hit: the first captured token is {s.offset}, tokens [0, {s.offset}) were served from "
                f"the cache and have no hidden states (send a unique extra_key or run with --disable-radix-cache)"))]
        if have is not None and s.offset != covered:
            self.pending.pop(s.rid)
            return [Outcome(s.key, s.rid, "incomplete", chunks=len(have) + 1, reason=(
                f"chunk at offset {s.offset} does not continue the {covered} tokens captured so far"))]
        pieces = (have or []) + [piece]
        covered += s.stop - s.start
        if covered > s.expected:
            self.pending.pop(s.rid, None)
            return [Outcome(s.key, s.rid, "incomplete", chunks=len(pieces), reason=(
                f"{covered} tokens captured but the rid announced {s.expected}"))]
        if covered == s.expected:
            self.pending.pop(s.rid, None)
            names = pieces[0].tensors.keys()
            joined = {n: torch.cat([p.tensors[n] for p in pieces]) if len(pieces) > 1 else pieces[0].tensors[n]
                      for n in names}
            return [Outcome(s.key, s.rid, "ok", tensors=joined, chunks=len(pieces))]
        self.pending[s.rid] = pieces
        self.pending.move_to_end(s.rid)
        while len(self.pending) > self.max_pending:
            rid, old = self.pending.popitem(last=False)
            out.append(Outcome(old[0].span.key, rid, "incomplete", chunks=len(old),
                               reason="evicted: more partial requests pending than max_pending"))
        return out
