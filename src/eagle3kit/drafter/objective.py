"""Teacher targets, the loss of each TTT step, and chained acceptance counts.

Alignment (``data.align``): row t holds the target's final state at position t+1, whose logits ``z_{t+1}``
choose token x_{t+2}. Step k of the draft at row t predicts x_{t+2+k}: its teacher is row t+k, and the row
counts (is *valid*) when the token it starts from (x_{t+1}) and the token it predicts (x_{t+2+k}) are both
loss-masked (assistant) tokens of the same sample: exactly the tokens a served draft proposes.

Acceptance as SGLang counts it under greedy decoding: step k is accepted when the draft's argmax, mapped to a
target id through ``d2t``, equals the target's argmax over its *full* vocabulary and every earlier step was
accepted. ``cond_acc_k`` = accepted at k given accepted up to k-1; ``tau(n) = 1 + sum_{k<n} prod_{i<=k}
cond_acc_i`` (the 1 is the bonus token the verifier always adds, which SGLang's accept length includes).

Losses over the draft vocabulary (the target's distribution renormalised to it, as speculators and SpecForge do):
  ``kl``         forward KL(target || draft), every valid row (speculators' default)
  ``ce_masked``  soft cross-entropy -sum p log q, rows whose target argmax lies outside the draft vocabulary
                 left out (SpecForge / EAGLE-3's recipe)
Step k's loss is weighted ``step_decay ** k`` (speculators 1.0, SpecForge/EAGLE 0.8).
"""
from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass, field
from functools import cached_property

import torch

from eagle3kit.drafter.ttt import shifted

LOSSES = ("kl", "ce_masked")


@dataclass
class Teacher:
    token: torch.Tensor  # int64 [S]: the target's greedy token at each row (full vocabulary)
    draft_index: torch.Tensor  # int64 [S]: its index in the draft vocabulary, -1 when outside
    logp: torch.Tensor  # float32 [S, N]: log-softmax of the target logits over the draft vocabulary

    @cached_property
    def p(self) -> torch.Tensor:
        """The target's probabilities over the draft vocabulary, once for every TTT step."""
        return self.logp.exp()

    @cached_property
    def neg_entropy(self) -> torch.Tensor:
        """sum_v p log p per row: KL(p || q) = this - sum_v p log q."""
        return (self.p * self.logp).sum(-1)


@torch.no_grad()
def teacher(head, final: torch.Tensor, vocab_ids: torch.Tensor, t2d_index: torch.Tensor, chunk: int = 2048,
            token: torch.Tensor | None = None) -> Teacher:
    """Target targets from the final pre-norm states [S, H] (row by chunk: [chunk, V] logits at a time). ``token``:
    the greedy tokens of these rows, known from an earlier pass over the same rows (an evaluation's batches are the
    same each time): only the draft vocabulary's columns of the head are then computed (``head.draft_logits``; N of
    the V columns: 512 of 49,152 in the CPU tests, 32 K of Kimi's 164 K)."""
    tokens, logps = [], []
    for a in range(0, final.shape[0], chunk):
        if token is None:
            z = head.logits(final[a:a + chunk]).float()
            tokens.append(z.argmax(-1))
            z = z.index_select(1, vocab_ids)
        else:
            z = head.draft_logits(final[a:a + chunk], vocab_ids).float()
        logps.append(torch.log_softmax(z, dim=-1))
    token = torch.cat(tokens) if token is None else token
    return Teacher(token, t2d_index[token], torch.cat(logps))


class TeacherTokens:
    """The target's greedy token at every row of the samples trained on, kept on the device after a sample's first
    batch (4 bytes a row, up to ``max_bytes``): a later epoch's batch of known samples computes only the draft
    vocabulary's columns of the target's head (``teacher(token=...)``), not all V of them (the CPU demo's largest
    matmul: 2,048 rows x 49,152 columns a step, every epoch). A row is (sample index, position): ``sample_ids`` and
    ``position_ids`` of ``data.collate``; a sample's rows are a prefix of it (a batch may cut it shorter)."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.bytes = max_bytes, 0
        self.rows: dict[int, torch.Tensor] = {}

    @staticmethod
    def _segments(batch: dict) -> list[tuple[int, int, int]]:
        """(sample id, first row, rows) of each sample's run in the batch (-1: padding, or no id)."""
        sid, pos = batch["sample_ids"], batch["position_ids"]
        start = torch.ones_like(sid, dtype=torch.bool)
        start[1:] = (sid[1:] != sid[:-1]) | (pos[1:] == 1)
        first = start.nonzero().flatten().tolist()
        ids = sid[first].tolist()
        ends = first[1:] + [sid.shape[0]]
        return [(i, a, b - a) for i, a, b in zip(ids, first, ends)]

    def lookup(self, batch: dict, device) -> torch.Tensor | None:
        """The batch's tokens when every sample in it is known (padding gets 0, which no loss sees), else None."""
        if "sample_ids" not in batch or not self.rows:
            return None
        parts = []
        for i, _, n in self._segments(batch):
            if i < 0:
                parts.append(torch.zeros(n, dtype=torch.int32, device=device))
                continue
            known = self.rows.get(i)
            if known is None or known.shape[0] < n:
                return None
            parts.append(known[:n])
        return torch.cat(parts).to(torch.int64)

    def store(self, batch: dict, tokens: torch.Tensor) -> None:
        if "sample_ids" not in batch:
            return
        for i, a, n in self._segments(batch):
            known = self.rows.get(i)
            if i < 0 or (known is not None and known.shape[0] >= n) or self.bytes + 4 * n > self.max_bytes:
                continue
            self.bytes += 4 * n - (0 if known is None else 4 * known.shape[0])
            self.rows[i] = tokens[a:a + n].to(torch.int32).clone()


@torch.no_grad()
def greedy_tokens(head, final: torch.Tensor, chunk: int = 2048) -> torch.Tensor:
    """The target's greedy token (full vocabulary) at each of the rows [S, H], ``chunk`` rows of logits at a time."""
    return torch.cat([head.logits(final[a:a + chunk]).argmax(-1) for a in range(0, final.shape[0], chunk)])


KNOWN_MAX_BYTES = 256 << 20
_known: collections.OrderedDict = collections.OrderedDict()  # (head, rows' digest) -> greedy tokens, on the CPU
_known_bytes = [0]


def known_greedy_tokens(head, final: torch.Tensor) -> torch.Tensor:
    """``greedy_tokens``, remembered for this process by the head's source and the rows' bytes (up to
    ``KNOWN_MAX_BYTES``, oldest dropped first): a later training on the same data set in the same process (a
    notebook run again, the tests' many short trainings) does not run the full head over the same held-out and
    validation batches again; on a CPU that is seconds a training. A head of no known source is never remembered, nor
    are rows on a GPU: their copy to the host for the digest would cost more than the matmul."""
    if getattr(head, "source", None) is None or KNOWN_MAX_BYTES <= 0 or final.device.type != "cpu":
        return greedy_tokens(head, final)
    rows = final.detach().contiguous()
    key = (head.source, head.final_normed, str(head.weight.dtype), str(rows.dtype), tuple(rows.shape),
           hashlib.blake2b(rows.cpu().view(torch.uint8).numpy(), digest_size=16).digest())
    got = _known.get(key)
    if got is None:
        got = _known[key] = greedy_tokens(head, rows).cpu()
        _known_bytes[0] += got.numel() * got.element_size()
        while _known_bytes[0] > KNOWN_MAX_BYTES and len(_known) > 1:
            _, old = _known.popitem(last=False)
            _known_bytes[0] -= old.numel() * old.element_size()
    else:
        _known.move_to_end(key)
    return got.to(final.device)


def valid_rows(loss_mask: torch.Tensor, doc_ids: torch.Tensor, k: int) -> torch.Tensor:
    """Rows whose step k is a draft SGLang would make: x_{t+1} and x_{t+2+k} loss-masked, same sample."""
    m = loss_mask.to(torch.bool)
    return m & shifted(m, k + 1, False) & (shifted(doc_ids, k + 1, -1) == doc_ids)


def step_loss(logits: torch.Tensor, t: Teacher, valid: torch.Tensor, k: int, kind: str):
    """(mean loss of step k over its rows, number of rows as a 0-dim tensor), without a host sync: every row is
    scored and the rows that do not count are weighted 0 (boolean indexing would wait for the GPU each step).

    Row r's teacher is row r + k. The [rows, vocab] work is what a step's memory traffic is made of (the dtype casts,
    products and softmax led the H200's profile once the attention was sparse), so: the teacher's probabilities and
    sum p log p are computed once for all steps (``Teacher``), aligned by slicing (no shifted copy), the bf16 logits
    go into the fp32 log-softmax without a separate cast, and sum_v p log q is an elementwise product and a sum: as a
    batched dot (``bmm`` of [m,1,V] by [m,V,1]) its backward, a k=1 batched GEMM, took 1.88 ms a TTT step on the H200,
    37 % of the step's device time (``gpu-drafter-pipeline-11/trainbench``), where the product and its
    gradient are two memory-bound passes. The last k rows have no teacher row; they never count (``valid_rows``) and
    score 0."""
    if kind not in LOSSES:
        raise ValueError(f"loss {kind!r}: choose one of {LOSSES}")
    rows = valid if kind == "kl" else valid & (shifted(t.draft_index, k, -1) >= 0)
    q_log = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    m = max(q_log.shape[0] - k, 0)
    cross = (t.p[k:k + m] * q_log[:m]).sum(-1)  # sum_v p log q
    cross = torch.cat([cross, cross.new_zeros(q_log.shape[0] - m)])
    per_row = shifted(t.neg_entropy, k) - cross if kind == "kl" else -cross
    n = rows.sum()
    return torch.where(rows, per_row, 0.0).sum() / n.clamp(min=1), n


@dataclass
class ChainCounts:
    """Sums over rows (additive across batches and ranks): per step k, valid rows, rows accepted through k
    (``full``), rows whose earlier steps were accepted (``cond_total``) and of those accepted at k (``cond``)."""
    steps: int
    valid: list = field(default_factory=list)
    full: list = field(default_factory=list)
    cond_total: list = field(default_factory=list)
    cond: list = field(default_factory=list)
    loss_sum: list = field(default_factory=list)
    loss_rows: list = field(default_factory=list)
    baseline_hits: float = 0.0  # step 0 rows whose target token is the most frequent training token
    greedy_path: float = 0.0  # step 0 rows where the data's next token is the target's greedy token

    def __post_init__(self):
        for name in ("valid", "full", "cond_total", "cond", "loss_sum", "loss_rows"):
            if not getattr(self, name):
                setattr(self, name, [0.0] * self.steps)

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor(self.valid + self.full + self.cond_total + self.cond + self.loss_sum + self.loss_rows
                            + [self.baseline_hits, self.greedy_path], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, steps: int, t: torch.Tensor) -> "ChainCounts":
        v = t.tolist()
        parts = [v[i * steps:(i + 1) * steps] for i in range(6)]
        return cls(steps, *parts, baseline_hits=v[6 * steps], greedy_path=v[6 * steps + 1])

    def add(self, other: "ChainCounts") -> None:
        summed = ChainCounts.from_tensor(self.steps, self.as_tensor() + other.as_tensor())
        self.__dict__.update(summed.__dict__)

    def metrics(self, prefix: str = "") -> dict:
        """acc_k (accepted through k), cond_acc_k, loss_k, tau_n for n = 1..steps, and the baselines."""
        out = {}
        cum = 1.0
        tau = 1.0
        for k in range(self.steps):
            cond = self.cond[k] / self.cond_total[k] if self.cond_total[k] else 0.0
            out[f"{prefix}acc_pos{k}"] = self.full[k] / self.valid[k] if self.valid[k] else 0.0
            out[f"{prefix}cond_acc_pos{k}"] = cond
            if self.loss_rows[k]:
                out[f"{prefix}loss_pos{k}"] = self.loss_sum[k] / self.loss_rows[k]
            cum *= cond
            tau += cum
            out[f"{prefix}tau_{k + 1}"] = tau
        rows0 = self.valid[0]
        out[f"{prefix}baseline_acc_pos0"] = self.baseline_hits / rows0 if rows0 else 0.0
        out[f"{prefix}greedy_path_fraction"] = self.greedy_path / rows0 if rows0 else 0.0
        out[f"{prefix}rows"] = int(rows0)
        return out


def step_correct(logits: torch.Tensor, t: Teacher, k: int, vocab_ids: torch.Tensor) -> torch.Tensor:
    """Rows whose step-k draft (argmax mapped to the target's vocabulary) is the target's greedy token there: what
    SGLang's greedy verify accepts."""
    return vocab_ids[logits.argmax(-1)] == shifted(t.token, k, -1)


def chain_count_tensor(step_logits, t: Teacher, loss_mask, doc_ids, input_ids, vocab_ids: torch.Tensor,
                       most_frequent: int, losses=None) -> torch.Tensor:
    """The acceptance counts of one packed row in ``ChainCounts.as_tensor``'s layout, on the logits' device and
    without a host sync (sum them over batches, read once); ``losses``: optional (loss, rows) per step to add in."""
    valid_n, full, cond_total, cond, loss_sum, loss_rows = ([] for _ in range(6))
    zero = step_logits[0].new_zeros((), dtype=torch.float64)
    accepted = None
    extra = [zero, zero]
    for k, logits in enumerate(step_logits):
        valid = valid_rows(loss_mask, doc_ids, k)
        correct = step_correct(logits, t, k, vocab_ids)
        before = valid if accepted is None else valid & accepted
        accepted = correct if accepted is None else accepted & correct
        valid_n.append(valid.sum())
        full.append((accepted & valid).sum())
        cond_total.append(before.sum())
        cond.append((before & correct).sum())
        if losses is not None:
            loss, n = losses[k]
            loss_sum.append(torch.as_tensor(loss, dtype=torch.float64, device=zero.device) * n)
            loss_rows.append(torch.as_tensor(n, device=zero.device))
        else:
            loss_sum.append(zero)
            loss_rows.append(zero)
        if k == 0:
            extra = [((t.token == most_frequent) & valid).sum(), ((shifted(input_ids, 1, -1) == t.token) & valid).sum()]
    parts = valid_n + full + cond_total + cond + loss_sum + loss_rows + extra
    return torch.stack([x.to(device=zero.device, dtype=torch.float64) for x in parts])


def chain_counts(step_logits, t: Teacher, loss_mask, doc_ids, input_ids, vocab_ids: torch.Tensor,
                 most_frequent: int, losses=None) -> ChainCounts:
    """Acceptance counts of one packed row (``chain_count_tensor`` read back)."""
    return ChainCounts.from_tensor(len(step_logits), chain_count_tensor(step_logits, t, loss_mask, doc_ids, input_ids,
                                                                        vocab_ids, most_frequent, losses).cpu())


@torch.no_grad()
def serving_walk(step_logits, t: Teacher, loss_mask, doc_ids, vocab_ids: torch.Tensor) -> torch.Tensor:
    """What serving would accept along each held-out reply: [steps, 2] float64 (tokens, verify rounds) for chains of
    n = 1..steps drafts. A round starts at a position of a reply, accepts the run of consecutive correct drafts from
    there (at most n) plus the bonus token, and the next round starts right after them, as SGLang's chain decoding
    does. tokens / rounds is SGLang's accept length (1 + correct drafts / verify rounds). Unlike tau, which averages
    every position alike, the walk visits hard stretches (one token per round) more often than easy ones, so it is
    the offline figure to hold against the online accept length."""
    steps = len(step_logits)
    run, accepted = torch.zeros_like(t.token), None
    for k, logits in enumerate(step_logits):
        correct = step_correct(logits, t, k, vocab_ids) & valid_rows(loss_mask, doc_ids, k)
        accepted = correct if accepted is None else accepted & correct
        run += accepted.long()
    start = valid_rows(loss_mask, doc_ids, 0).cpu().tolist()
    run = run.cpu().tolist()
    out = torch.zeros(steps, 2, dtype=torch.float64)
    for n in range(1, steps + 1):
        tokens = rounds = 0
        nxt = 0
        for r, ok in enumerate(start):
            if ok and r >= nxt:
                a = min(run[r], n)
                tokens, rounds, nxt = tokens + a + 1, rounds + 1, r + a + 1
        out[n - 1, 0], out[n - 1, 1] = tokens, rounds
    return out
