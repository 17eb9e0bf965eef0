"""Acceptance and speed in SGLang itself: the target served with the exported drafter (EAGLE3) and without.

Per request, SGLang 0.5.14 reports ``spec_verify_ct`` (verify forwards) and ``spec_num_correct_drafts``
(``spec_accepted_drafts`` in some builds); each verify emits the accepted drafts plus one bonus token, so
accept length = (correct + verify) / verify, token-weighted over requests (SGLang's own ``spec_accept_length`` is
completion_tokens / verify_ct, which also counts the token the prefill produced). The server-wide figure
(``/server_info`` internal_states[0].avg_spec_accept_length) is read too, after ``/flush_cache`` reset it: SGLang folds
it in at every ``--decode-log-interval`` decode batches (40 by default), so it leaves out up to 39 of a round's last
verifies. The speculative servers keep that default, as plain does: ``--decode-log-interval 1`` (exact server-wide
figure) formats and writes a log line on every verify, work plain was not charged (a variant measures it).

Speed: output tokens per second (of wall time at 8 and 32 requests; at batch 1 of the server's own requests' time,
timed prompt by prompt across the servers), the same prompts, greedy, against the same target served without
speculation in the same run, each request asking for the same number of new tokens on every server
(``sampling_params``: ``ignore_eos``, so each server does the same work whatever text it produced). At batch 1 the break-even accept length is the cost of one speculative iteration in
plain decode steps: ``accept_length / speedup`` (speculation pays above it).

Many servers on one GPU: SGLang sizes its KV pool from the memory free when it starts, so servers started together
race for it; ``shared_gpu_args`` gives each a fixed pool (``--max-total-tokens``) under a permissive
``--mem-fraction-static`` and ``--sleep-on-idle`` (idle schedulers do not spin); the plain baseline gets the same.
"""
from __future__ import annotations

import json
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Serving:
    """One server to measure: the plain target (drafter None) or the target with an EAGLE3 drafter."""
    name: str
    drafter: str | None = None
    steps: int = 3
    topk: int = 1
    draft_tokens: int = 4
    extra_args: list = field(default_factory=list)
    hooks: list | None = None  # extra --forward-hooks specs (drafthook)

    def args(self) -> list[str]:
        if self.drafter is None:
            return list(self.extra_args)
        return ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(self.drafter),
                "--speculative-num-steps", str(self.steps), "--speculative-eagle-topk", str(self.topk),
                "--speculative-num-draft-tokens", str(self.draft_tokens), *self.extra_args]

    def label(self) -> str:
        return "plain" if self.drafter is None else f"{self.name} ({self.steps},{self.topk},{self.draft_tokens})"


def shared_gpu_args(max_total_tokens: int = 131072) -> list[str]:
    return ["--mem-fraction-static", "0.97", "--max-total-tokens", str(max_total_tokens), "--sleep-on-idle"]


def start_servers(target, servings: list[Serving], log_dir, base_port: int = 31000, common_args=(),
                  startup_timeout: float = 900, stagger: float = 2.0) -> dict:
    """Start every server at once (imports dominate a start; they overlap) and wait until all are healthy.
    Returns {name: SGLangServer}; a server that fails to start is reported by name with its log's tail."""
    from eagle3kit.capture.server import ServerError, SGLangServer, stop_all

    names = [s.name for s in servings]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # a second server of one name would replace the first in the dict and be left running, unstopped
        raise ValueError(f"servers {twice} are given twice (a setting or tree listed twice?): list each once")
    servers, failed = {}, {}
    try:
        for i, s in enumerate(servings):
            srv = SGLangServer(target, port=base_port + i, extra_args=[*common_args, *s.args()],
                               log_path=Path(log_dir) / f"sglang-{s.name}.log", hooks=s.hooks,
                               startup_timeout=startup_timeout)
            try:
                servers[s.name] = srv.start()
            except ServerError as e:  # its port taken: this server is reported failed, the others start
                failed[s.name] = str(e)
                continue
            time.sleep(stagger)
        for name, srv in servers.items():
            try:
                srv.wait_healthy()
            except Exception as e:  # noqa: BLE001 - report every failed server, keep the others
                failed[name] = str(e)[-2000:]
    except BaseException:  # Ctrl-C / SIGTERM while starting: the servers run in their own sessions, stop them
        stop_all(servers.values())
        raise
    return {"servers": servers, "failed": failed}


def sampling_params(max_new_tokens: int) -> dict:
    """What every timed request asks for, plain and speculative alike: greedy, exactly ``max_new_tokens`` new tokens
    (``ignore_eos``: a reply does not end at the end-of-sequence token). Equal work: the servers' replies part at
    near-ties (bf16 verify forwards against plain decode steps), and a reply that ended early would time less work
    on one server than on the other; the text the replies would have had is compared apart, cut at their first
    end-of-sequence token (``reply_end``)."""
    return {"max_new_tokens": int(max_new_tokens), "temperature": 0.0, "ignore_eos": True}


def reply_end(ids, eos_ids) -> list:
    """``ids`` up to (not including) the first of ``eos_ids``: the reply a request that stops at the end-of-sequence
    token would have given (timed requests go on past it, ``sampling_params``)."""
    ids = list(ids or [])
    return next((ids[:i] for i, t in enumerate(ids) if t in eos_ids), ids)


def eos_token_ids(target_dir, tokenizer=None) -> set[int]:
    """The token ids that end a reply for the target in ``target_dir``: ``eos_token_id`` (one or a list) of its
    ``generation_config.json`` and ``config.json`` (what SGLang stops at), and the tokenizer's where one is given."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        try:
            v = json.loads((Path(target_dir) / name).read_text()).get("eos_token_id")
        except (OSError, ValueError):
            continue
        ids.update(int(x) for x in (v if isinstance(v, list) else [v]) if x is not None)
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def generate(session, url: str, ids, max_new_tokens: int, timeout: float = 600) -> dict:
    t0 = time.perf_counter()
    r = session.post(url + "/generate", timeout=timeout, json={
        "input_ids": list(ids), "sampling_params": sampling_params(max_new_tokens)})
    r.raise_for_status()
    out = r.json()
    m = out.get("meta_info", {})
    correct = m.get("spec_num_correct_drafts", m.get("spec_accepted_drafts"))
    return {"completion_tokens": int(m.get("completion_tokens", 0)), "verify_ct": m.get("spec_verify_ct"),
            "correct_drafts": correct, "sglang_accept_length": m.get("spec_accept_length"),
            "seconds": time.perf_counter() - t0, "server_seconds": m.get("e2e_latency"),
            "output_ids": out.get("output_ids")}


def measure(url: str, prompts, concurrency: int, max_new_tokens: int = 256) -> dict:
    """Send every prompt, ``concurrency`` in flight; tokens/s over the wall time; accept length (token-weighted)."""
    import requests

    local = threading.local()

    def one(ids):
        if not hasattr(local, "s"):
            local.s = requests.Session()
        return generate(local.s, url, ids, max_new_tokens)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, prompts))
    return _summary(results, concurrency, time.perf_counter() - t0)


def measure_interleaved(urls: dict, prompts: dict, max_new_tokens=256) -> dict:
    """Batch 1 on several servers in one pass, prompt by prompt: prompt i goes to every server in turn (the first one
    rotating with i, from the order of ``urls``) before prompt i + 1 goes to any. ``urls``, ``prompts``: name -> url,
    name -> prompts. Returns name -> ``measure``'s figures, each server's time the sum of its requests' times.

    Why: this host's batch-1 speed drifts by up to 2x within seconds (gpu-drafter-pipeline-12: plain's three rounds
    558, 785 and 834 tokens/s, main's 348, 733 and 512, timed a server's 16 prompts at a time, ~5 s each), so two
    servers timed 5-40 s apart compare two moments, not two servers. Interleaved, a server's prompt and plain's same
    prompt run within one pass of the servers over that prompt (~3 s with 8 servers at ~0.4 s a request) and a drift
    reaches both alike. ``max_new_tokens``: a number, or a list of them that prompt i takes in turn (``i % len``):
    replies of several lengths let ``request_fit`` tell a request's fixed cost from a cycle's. A server whose request
    fails (it died, or a request outlived its timeout) gets no more requests and ``{"error": ...}`` for its figures;
    the others go on.

    Each request now finds its server idle through the other servers' requests (``--sleep-on-idle``): a fixed wake-up
    cost per request would pull every ratio towards 1; the next GPU record's per-request seconds against the earlier
    back-to-back rounds' will tell."""
    import requests

    names = list(urls)
    lengths = [int(x) for x in max_new_tokens] if isinstance(max_new_tokens, (list, tuple)) else [int(max_new_tokens)]
    sessions = {n: requests.Session() for n in names}
    got: dict = {n: [] for n in names}
    dead: dict = {}
    try:
        for i in range(max((len(p) for p in prompts.values()), default=0)):
            k = i % len(names)
            for n in names[k:] + names[:k]:
                if i < len(prompts[n]) and n not in dead:
                    try:
                        got[n].append(generate(sessions[n], urls[n], prompts[n][i], lengths[i % len(lengths)]))
                    except Exception as e:  # noqa: BLE001 - this server's figures are lost, not the others'
                        dead[n] = f"prompt {i}: {_reason(e)}"
    finally:
        for sess in sessions.values():
            sess.close()
    return {n: {"error": dead[n]} if n in dead else _summary(r, 1, sum(x["seconds"] for x in r)) for n, r in got.items()}


def _reason(e: Exception) -> str:
    """A failed request's reason as the results keep it."""
    return f"{type(e).__name__}: {str(e)[:300]}"


def _summary(results: list, concurrency: int, wall: float) -> dict:
    """measure's figures of ``generate``'s results (in prompt order) and the seconds they took (the wall time, or at
    batch 1 interleaved the sum of the requests' times)."""
    toks = sum(r["completion_tokens"] for r in results)
    out = {"requests": len(results), "concurrency": concurrency, "output_tokens": toks, "seconds": wall,
           "output_tokens_per_s": toks / wall if wall else 0.0}
    if concurrency == 1:  # per request, in prompt order: (output tokens, seconds), for the speedup's interval
        out["per_request_time"] = [[r["completion_tokens"], r["seconds"]] for r in results]
        if results and all(r.get("server_seconds") is not None for r in results):  # SGLang's own e2e_latency: the
            out["per_request_server_seconds"] = [float(r["server_seconds"]) for r in results]  # rest is HTTP, client
    ver = [r for r in results if r["verify_ct"]]
    if any(r["correct_drafts"] is None for r in ver):  # verifies counted, correct drafts not: no accept length at all
        # (counting them as 0 would report 1.0 as if nothing were accepted)
        out["accept_length_error"] = ("SGLang's meta_info gave spec_verify_ct without spec_num_correct_drafts on "
                                      f"{sum(r['correct_drafts'] is None for r in ver)} of {len(ver)} requests")
        ver = []
    if ver:
        v = sum(r["verify_ct"] for r in ver)
        c = sum(r["correct_drafts"] for r in ver)
        out.update(accept_length=(c + v) / v, verify_ct=v, correct_drafts=c,
                   accept_length_request_mean=statistics.fmean((r["correct_drafts"] + r["verify_ct"]) / r["verify_ct"]
                                                               for r in ver),
                   sglang_spec_accept_length_mean=statistics.fmean(r["sglang_accept_length"] or 0 for r in ver),
                   # per request, in prompt order: (verifies, correct drafts), to compare concurrencies on shared prompts
                   per_request=[[r["verify_ct"] or 0, r["correct_drafts"] or 0] for r in results])
    out["_outputs"] = [r["output_ids"] for r in results]
    return out


def flush(url: str) -> None:
    import requests

    for _ in range(20):  # refused while requests are still finishing
        try:
            if requests.post(url + "/flush_cache", timeout=30).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)


def server_accept_length(url: str) -> float | None:
    import requests

    try:
        info = requests.get(url + "/server_info", timeout=30).json()
    except (requests.RequestException, ValueError):
        return None
    states = info.get("internal_states") or [{}]
    v = states[0].get("avg_spec_accept_length")
    return float(v) if v is not None else None


WARM_TOKENS = 32  # new tokens per request of a concurrency's untimed warm pass


def measure_servers(servers: dict, max_new_tokens, rounds: int = 1, after_round=None, first_token: bool = True,
                    lost: dict | None = None) -> dict:
    """Every server's concurrencies, ``rounds`` times, the servers interleaved. ``servers``: name -> (url,
    prompts_by_conc). Returns name -> {conc: {"rounds", "warm_seconds", median, min, max of output tokens/s}};
    ``after_round`` gets the same, so far, after each round (an interrupted run keeps whole rounds).

    Each concurrency of each server is first run once untimed (its first ``concurrency`` prompts, ``WARM_TOKENS`` new
    tokens each): an EAGLE server's first batch of a new size ran 37-38 % slower than the rounds after it (records
    gpu-drafter-pipeline-3 at concurrency 8, -6 at 8 and 32), which timed its warm-up, not its speed. Then each round
    starts from flushed caches: batch 1 of every server prompt by prompt (``measure_interleaved``: until
    gpu-drafter-pipeline-12 each server's prompts were timed in one stretch, and batch-1 speed swung up to 2x between
    stretches: 0.61-0.93 for one setting's three rounds against plain), then the other concurrencies one server at a
    time, forward on even rounds and backward on odd ones, so a drift during the run reaches every server alike.

    ``first_token``: after batch 1's pass, the caches flushed again, the same prompts once more for one new token
    each, interleaved (a round's ``first_token``: each request's seconds, and SGLang's own ``e2e_latency`` of it):
    the prefill path alone, which ``first_token_ms`` reads. Fitted over whole requests a speculative request cost
    35-54 ms fixed against plain's 21 (gpu-drafter-pipeline-13); in SGLang 0.5.14 the target's prefill runs on the
    piecewise CUDA graph in a plain server and eagerly under EAGLE (``model_runner.py``: "Disable prefill CUDA graph
    for EAGLE target on tc_piecewise"), followed by the draft's eager extend. The probe tells whether that is the
    fixed cost: it is about the time of the requests' prefill, not their decoding.

    A server whose request fails during the rounds (it died; a request outlived its timeout) is timed no more: its
    whole rounds so far are kept, the reason goes to ``lost`` (name -> reason, when a dict is given), and the other
    servers' rounds go on. A run of many servers no longer loses every figure to one of them (an audit's case: a
    tree server dying in round 2 of 3 ended the run with nothing summarised)."""
    lost = {} if lost is None else lost
    warm, rows = {}, {}

    def timed(name, what, fn):  # fn's result, or None with the server lost
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - one server's failure; the others' figures stand
            lost[name] = f"{what}: {_reason(e)}"
            return None

    for name, (url, by_conc) in servers.items():
        for conc, prompts in by_conc.items():
            rows[name, conc] = []
            if name not in lost:
                t0 = time.perf_counter()
                if timed(name, f"warm pass at {conc}", lambda: measure(url, prompts[:conc], conc, WARM_TOKENS)):
                    warm[name, conc] = time.perf_counter() - t0
    names, done = list(servers), {}
    for r in range(rounds):
        order = [n for n in (names if r % 2 == 0 else names[::-1]) if n not in lost]
        one = [n for n in order if 1 in servers[n][1]]
        for name in one:
            flush(servers[name][0])
        if one:
            got = measure_interleaved({n: servers[n][0] for n in one}, {n: servers[n][1][1] for n in one},
                                      max_new_tokens)
            for name in [n for n in one if "error" in got[n]]:
                lost[name] = f"round {r}, batch 1, {got[name]['error']}"
                one.remove(name)
            for name in one:
                got[name]["server_accept_length"] = server_accept_length(servers[name][0])
                rows[name, 1].append(got[name])
            if first_token and one:
                for name in one:  # else every prompt but its last token would be a prefix-cache hit
                    flush(servers[name][0])
                try:
                    probe = measure_interleaved({n: servers[n][0] for n in one}, {n: servers[n][1][1] for n in one}, 1)
                except Exception as e:  # a diagnostic: it never costs the timed figures (kept above) their round
                    probe = {n: {"error": _reason(e)} for n in one}
                for name in one:
                    p = probe[name]
                    rows[name, 1][-1]["first_token"] = {"error": p["error"]} if "error" in p else {
                        "seconds": [t for _, t in p["per_request_time"]],
                        "server_seconds": p.get("per_request_server_seconds")}
        for name in order:
            url, by_conc = servers[name]
            for conc, prompts in by_conc.items():
                if conc == 1 or name in lost:
                    continue
                flush(url)
                m = timed(name, f"round {r}, concurrency {conc}",
                          lambda: measure(url, prompts, conc, _longest(max_new_tokens)))
                if m is not None:
                    m["server_accept_length"] = server_accept_length(url)
                    rows[name, conc].append(m)
        done = _by_server(rows, warm)
        if after_round is not None:
            after_round(done)
    return done


def _longest(max_new_tokens) -> int:
    return max(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else int(max_new_tokens)


def _by_server(rows: dict, warm: dict) -> dict:
    out: dict = {}
    for (name, conc), rr in rows.items():
        if rr:
            tps = [r["output_tokens_per_s"] for r in rr]
            out.setdefault(name, {})[conc] = {"rounds": list(rr), "warm_seconds": warm[name, conc],
                                              "output_tokens_per_s_median": statistics.median(tps),
                                              "output_tokens_per_s_min": min(tps), "output_tokens_per_s_max": max(tps)}
    return out


def spread(measured: dict) -> float:
    """(fastest - slowest round) / median of one concurrency's rounds, as measure_servers gives them."""
    med = measured["output_tokens_per_s_median"]
    return (measured["output_tokens_per_s_max"] - measured["output_tokens_per_s_min"]) / med if med else 0.0


def paired_speedups(plain: dict, spec: dict) -> list[float]:
    """Round i of ``spec`` over round i of ``plain`` (one concurrency's measurements, as measure_servers gives them).
    The rounds interleave the servers, so the two of a pair were timed at nearly the same moment: the range of these
    ratios is the speedup's own spread (gpu-drafter-pipeline-11: 0.99 and 1.13 at (5,1,6), whose medians gave 1.06;
    batch 1 is interleaved prompt by prompt since -12)."""
    p = [r["output_tokens_per_s"] for r in plain.get("rounds", [])]
    q = [r["output_tokens_per_s"] for r in spec.get("rounds", [])]
    return [b / a for a, b in zip(p, q) if a]


def paired_speedup(plain: dict, spec: dict) -> float | None:
    """The speedup of one concurrency: the median over rounds of each round's spec / plain ratio
    (``paired_speedups``), not the ratio of the two servers' medians, which pairs a round of one with another round
    of the other (plain's rounds 100, 200, 300 tokens/s against 150, 150, 250: medians' ratio 0.75, paired median 0.83). None
    without a round measured by both."""
    paired = paired_speedups(plain, spec)
    return statistics.median(paired) if paired else None


def speedup_interval(plain: dict, spec: dict, level: float = 0.95, resamples: int = 2000, seed: int = 0):
    """(low, high): a paired bootstrap interval of the batch-1 speedup over the prompts (prompts drawn with
    replacement, the same for both servers; each prompt's output tokens and seconds summed over the rounds; speedup =
    spec's tokens / seconds over plain's): how far the prompts pin the speedup down. Meaningful at batch 1, where a
    request's seconds are the server's alone and, interleaved (``measure_interleaved``), plain's and the draft's time
    of one prompt were taken within one pass of the servers. It is the interval of the pooled speedup
    (``pooled_speedup``), not of the medians' ratio. None without per-request times."""
    a, b = _per_prompt(plain, "per_request_time"), _per_prompt(spec, "per_request_time")
    n = min(len(a), len(b))
    if not n:
        return None

    def ratio(idx):
        ta, sa = sum(a[i][0] for i in idx), sum(a[i][1] for i in idx)
        tb, sb = sum(b[i][0] for i in idx), sum(b[i][1] for i in idx)
        return (tb / sb) / (ta / sa) if ta and sa and sb else None
    return _bootstrap(ratio, n, level, resamples, seed)


def pooled_speedup(plain: dict, spec: dict) -> float | None:
    """The batch-1 speedup over every prompt and round pooled (spec's tokens / seconds over plain's, on the prompts
    both have): the point ``speedup_interval`` is the interval of. None without per-request times."""
    a, b = _per_prompt(plain, "per_request_time"), _per_prompt(spec, "per_request_time")
    n = min(len(a), len(b))
    ta, sa = sum(x[0] for x in a[:n]), sum(x[1] for x in a[:n])
    tb, sb = sum(x[0] for x in b[:n]), sum(x[1] for x in b[:n])
    return (tb / sb) / (ta / sa) if n and ta and sa and sb else None


def _per_prompt(measured: dict, key: str = "per_request") -> list[tuple]:
    """Per prompt, a round's ``key`` pair summed over the rounds (the same prompts in every round): (verifies, correct
    drafts) for "per_request", (output tokens, seconds) for "per_request_time"."""
    rows = [r[key] for r in measured.get("rounds", []) if r.get(key)]
    n = min(map(len, rows), default=0)
    return [(sum(r[i][0] for r in rows), sum(r[i][1] for r in rows)) for i in range(n)]


def _pooled(per, idx) -> float | None:
    """The accept length of the prompts ``idx`` of ``per`` ((verifies, correct drafts) each), token-weighted."""
    v = sum(per[i][0] for i in idx)
    return 1 + sum(per[i][1] for i in idx) / v if v else None


def _bootstrap(stat, n: int, level: float, resamples: int, seed: int) -> tuple[float, float] | None:
    rng = random.Random(seed)
    vals = sorted(x for x in (stat([rng.randrange(n) for _ in range(n)]) for _ in range(resamples)) if x is not None)
    if not vals:
        return None
    k = int(round((1 - level) / 2 * (len(vals) - 1)))
    return vals[k], vals[len(vals) - 1 - k]


def accept_interval(measured: dict, level: float = 0.95, resamples: int = 2000, seed: int = 0):
    """(low, high): a bootstrap interval of one concurrency's accept length over its prompts (prompts drawn with
    replacement, each with its verifies and correct drafts over the rounds, token-weighted as the accept length
    is): how far the prompts pin the figure down. At batch 1 per-prompt accept lengths range from 1.5 to 3.8 here,
    so 16 prompts leave about +-0.3 (gpu-drafter-pipeline-8: main 2.34 in [2.02, 2.68]). None without per-request
    counts."""
    per = _per_prompt(measured)
    return _bootstrap(lambda idx: _pooled(per, idx), len(per), level, resamples, seed) if per else None


def accept_difference_interval(a: dict, b: dict, level: float = 0.95, resamples: int = 2000, seed: int = 0):
    """(low, high): a paired bootstrap interval of accept length a - b over the prompts both servers decoded (the
    same prompts resampled for both): whether two settings or drafters differ by more than the prompts' spread."""
    pa, pb = _per_prompt(a), _per_prompt(b)
    n = min(len(pa), len(pb))
    if not n:
        return None

    def diff(idx):
        x, y = _pooled(pa, idx), _pooled(pb, idx)
        return None if x is None or y is None else x - y
    return _bootstrap(diff, n, level, resamples, seed)


def summarize(plain: dict, spec: dict, conc: int) -> dict:
    """Speedup (the median of the rounds' paired ratios, ``paired_speedup``) and the break-even accept length; at
    batch 1 also the times it comes from: plain's milliseconds a token and the speculative server's a verify cycle
    (accept length tokens; prefill included in both)."""
    p = plain[conc]["output_tokens_per_s_median"]
    s = spec[conc]["output_tokens_per_s_median"]
    acc = [r["accept_length"] for r in spec[conc]["rounds"] if "accept_length" in r]
    accept = statistics.fmean(acc) if acc else None
    speedup = paired_speedup(plain[conc], spec[conc])
    out = {"speedup": speedup or 0.0, "accept_length": accept, "plain_tokens_per_s": p, "spec_tokens_per_s": s}
    if accept:
        out["breakeven_accept_length"] = breakeven(accept, out["speedup"])
        if conc == 1 and p and s:
            out["plain_ms_per_token"], out["cycle_ms"] = 1000.0 / p, cycle_ms(accept, s)
    return out


def cycle_ms(accept: float, tokens_per_s: float) -> float:
    """One verify cycle's milliseconds at batch 1: ``accept`` tokens per cycle at ``tokens_per_s``."""
    return 1000.0 * accept / tokens_per_s


def accept_on_first(measured: dict, n: int) -> float | None:
    """The accept length of one concurrency's first round over its first ``n`` prompts (token-weighted): at another
    concurrency on the prompts batch 1 used, it tells a concurrency's effect from the prompts' (batch 1 took 8, and
    8 and 32 took 32 and 64 of them: 2.38 against 1.97 and 2.08 in gpu-drafter-pipeline-6)."""
    rows = (measured.get("rounds") or [{}])[0].get("per_request", [])[:n]
    return _pooled(rows, range(len(rows)))


def request_fit(measured: dict) -> dict | None:
    """Batch 1's requests of one server (``measure_servers``' result at concurrency 1, every round) fitted by least
    squares as ``milliseconds = fixed + marginal x cycles``, cycles being its verify cycles (plain: its decode steps,
    output tokens - 1). ``fixed``: what a request costs whatever its length (HTTP, tokenizer, prefill, the draft's
    prefill, waking an idle scheduler); ``marginal``: one more cycle. Tokens/s over whole requests mixes the two: in
    gpu-drafter-pipeline-13 the speculative servers' requests cost 35-54 ms fixed against plain's 21, and their
    marginal cycles (3.3-3.7 ms) were those of an untrained drafter (gpu-breakeven-1: 3.3-3.6), where the cycle
    over whole requests (4.0-4.6 ms) had looked like accepted tokens costing time. None without 3 requests whose
    cycles, and whose reply lengths, differ by at least a quarter of the most: the fit needs replies of several
    lengths (``measure_interleaved``'s list of max_new_tokens, or replies that end early). With replies all of one
    length N a cost per accepted token b is not told from a fixed one: ms = (fixed + b N) + (cycle - b) x cycles, so
    cycles that differ only by what the drafter accepts would put b into the fixed cost and take it from the cycle
    (untrained replies all 256 tokens long, cycles 253 to 255, gave a fixed cost of 60 +- 65 ms). Where lengths
    differ the two are told apart; fitted with a term per output token as well, -13's requests (16 to 256 tokens)
    gave fixed costs within 0.3-7.8 ms of this fit's and 0.02-0.39 +- 0.11-0.24 ms a token, none beyond two standard
    errors: the two-term fit is kept."""
    xs, ys, ns = [], [], []
    for r in measured.get("rounds", []):
        per = r.get("per_request") or []
        for i, (tokens, seconds) in enumerate(r.get("per_request_time", [])):
            ver = per[i][0] if i < len(per) and per[i] and per[i][0] else None
            xs.append(float(ver if ver else max(int(tokens) - 1, 0)))
            ys.append(1000.0 * float(seconds))
            ns.append(float(tokens))
    if len(xs) < 3 or any(max(v) - min(v) < max(2.0, 0.25 * max(v)) for v in (xs, ns)):
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    resid = [y - (my - b * mx) - b * x for x, y in zip(xs, ys)]
    s2 = sum(e * e for e in resid) / (len(xs) - 2)  # the standard errors: how far the requests pin each down
    return {"request_fixed_ms": my - b * mx, "cycle_marginal_ms": b, "fit_requests": len(xs),
            "request_fixed_ms_se": (s2 * (1 / len(xs) + mx * mx / sxx)) ** 0.5, "cycle_marginal_ms_se": (s2 / sxx) ** 0.5}


def first_token_ms(measured: dict) -> dict | None:
    """The median milliseconds of batch 1's one-token requests over every round (``measure_servers``' probe):
    ``first_token_ms`` from the client, ``first_token_server_ms`` by SGLang's own ``e2e_latency`` (tokenizer manager
    in to out; the difference is HTTP and the client). A request's prefill path: the target's prefill, for a
    speculative server also the draft's extend. None without the probe; ``first_token_error`` (the first) where its
    requests failed in every round."""
    client = [t for r in measured.get("rounds", []) for t in (r.get("first_token") or {}).get("seconds") or []]
    if not client:
        errors = [r["first_token"]["error"] for r in measured.get("rounds", []) if "error" in (r.get("first_token") or {})]
        return {"first_token_error": errors[0]} if errors else None
    server = [t for r in measured.get("rounds", []) for t in (r.get("first_token") or {}).get("server_seconds") or []]
    out = {"first_token_ms": 1000.0 * statistics.median(client)}
    if server:
        out["first_token_server_ms"] = 1000.0 * statistics.median(server)
    return out


def breakeven(accept: float, speedup: float) -> float | None:
    """The accept length at which this setting's verify cycle would match plain decoding (speedup 1): accept length
    over speedup (one cycle costs that many plain steps)."""
    return accept / speedup if speedup else None


def _conversations(data_dir: Path) -> list[dict]:
    """The conversations a data set was captured from: the target's regenerated ones where it has them."""
    from eagle3kit.data.conversations import load_conversations

    regen = data_dir / "regenerated.jsonl"
    if regen.exists():
        return [json.loads(line) for line in regen.read_text().splitlines() if line.strip()]
    convs, _ = load_conversations(json.loads((data_dir / "extraction.json").read_text())["data"])
    return convs


def first_reply_texts(data_dir, conv_ids, max_new_tokens: int) -> list[str]:
    """The first assistant reply of each conversation in ``conv_ids`` (in that order) as the data set holds it: the
    target's own greedy reply to the prompt ``heldout_prompts`` renders, regenerated with the same reply budget as
    the online replies (``max_new_tokens``; another budget cuts one reply where the other goes on). A data set that
    was not regenerated, or with another budget, is refused: its replies are not the target's to compare with."""
    data_dir = Path(data_dir)
    try:
        budget = json.loads((data_dir / "extraction.json").read_text()).get("regenerated_max_new_tokens")
    except (OSError, ValueError) as e:
        raise ValueError(f"{data_dir}: no readable extraction.json ({e})") from None
    if budget is None:
        raise ValueError(f"{data_dir}: replies not regenerated by the target (extract --regenerate): its replies are "
                         f"the data's own, not the target's")
    if budget != max_new_tokens:
        raise ValueError(f"{data_dir}: replies regenerated with at most {budget} new tokens, online with "
                         f"{max_new_tokens}: give 05 max_new_tokens={budget} to compare them")
    by_id = {c["id"]: c for c in _conversations(data_dir)}
    missing = [i for i in conv_ids if i not in by_id]
    if missing:
        raise ValueError(f"{data_dir}: conversations {missing[:5]} are not in its conversations (regenerated.jsonl "
                         f"or the extraction's data)")
    first = [next((m.get("content") for m in by_id[i]["messages"] if m.get("role") == "assistant"), "")
             for i in conv_ids]
    return [t if isinstance(t, str) else "" for t in first]  # a reply that is not plain text is not compared


def heldout_prompts(data_dir, tokenizer, n: int, max_prompt_tokens: int = 1024, with_ids: bool = False):
    """The first user turn(s) of held-out conversations (up to the first assistant turn), rendered with the
    target's chat template and its generation prompt: the prompts a served target would see. ``with_ids``:
    (conversation ids, prompts), for ``offline.first_replies`` and ``first_reply_texts``."""
    from eagle3kit.store import read_manifest

    data_dir = Path(data_dir)
    held = [e for e in read_manifest(data_dir).values() if e.get("split") == "heldout"]
    ids_wanted = {e["conv_id"] for e in held}
    convs = [c for c in _conversations(data_dir) if c["id"] in ids_wanted]
    conv_ids, prompts = _first_turn_prompts(convs, tokenizer, n, max_prompt_tokens)
    return (conv_ids, prompts) if with_ids else prompts


def chat_prompts(tokenizer, n: int, max_prompt_tokens: int = 1024, data: str = "embedded:sharegpt") -> list:
    """``n`` prompts as a served target sees them, without a data set: the first user turn(s) of ``data``'s
    conversations in the target's chat template with its generation prompt (``heldout_prompts``' rendering)."""
    from eagle3kit.data.conversations import load_conversations

    convs, _ = load_conversations(data, limit=4 * n + 16)
    _, prompts = _first_turn_prompts(convs, tokenizer, n, max_prompt_tokens)
    if len(prompts) < n:
        raise ValueError(f"{data}: only {len(prompts)} of {n} conversations open with a user turn of at most "
                         f"{max_prompt_tokens} tokens")
    return prompts


def _first_turn_prompts(convs, tokenizer, n: int, max_prompt_tokens: int) -> tuple[list, list]:
    """(conversation ids, token ids) of up to ``n`` conversations: each one's turns before its first assistant turn,
    ending on a user turn, rendered with the chat template and its generation prompt, at most ``max_prompt_tokens``."""
    prompts, conv_ids = [], []
    for c in convs:
        msgs = []
        for m in c["messages"]:
            if m["role"] == "assistant":
                break
            msgs.append(m)
        if not msgs or msgs[-1]["role"] != "user":
            continue
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) <= max_prompt_tokens:
            prompts.append(ids)
            conv_ids.append(c["id"])
        if len(prompts) >= n:
            break
    return conv_ids, prompts
