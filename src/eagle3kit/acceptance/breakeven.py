"""The break-even accept length of SGLang's speculative decoding before any drafter is trained.

At batch 1 a speculative server emits ``accept_length`` tokens per verify cycle, so it beats plain decoding when
``accept_length > cycle time / plain decode step time``: the break-even. That ratio is the cost of the cycle (draft
steps, verify, the draft's extend, the scheduler's work around them). An untrained drafter of the shape eagle3kit
trains (one layer, the target's width, the draft vocabulary) runs the same kernels as a trained one; it accepts
about 1 token a cycle, which the figure divides out: break-even = accept length x plain tokens/s / speculative
tokens/s, per round, the two servers timed prompt by prompt in turn (``online.measure_interleaved``).

Over whole requests the figure also carries each request's fixed cost (HTTP, prefill, the draft's prefill, waking
an idle scheduler), which a trained drafter spreads over fewer cycles: on the H200 with SmolLM2-135M the untrained
cycles (gpu-breakeven-1) came to 2.4-2.9 plain steps and gpu-drafter-pipeline-13's trained ones to 2.9-3.4, yet that
run's requests fitted as fixed cost + cycles (``online.request_fit``) gave marginal cycles of 3.3-3.7 ms, the
untrained ones', and fixed costs of 35-54 ms against plain's 21. Hence replies of several lengths and the fit's
figures beside the ratio (``breakeven_marginal_<server>``); notebook 05's ``untrained`` server compares the cycles in
one run (``experiment.accepting_cost``). Where the fixed cost comes from is measured apart: one-token requests per
server and round (``online.first_token_ms``: ``first_token_ms_<server>`` against ``plain_first_token_ms_<server>``),
the prefill path alone, which SGLang 0.5.14 runs eagerly for an EAGLE target and on a CUDA graph for plain.

So a user learns, for a target and SGLang's settings (steps, topk, draft tokens, attention backend, graphs), the
least accept length a drafter needs before speculation pays, in minutes and before capturing anything, and which
settings lower it (#11), without training a drafter per trial. ``benchmarks/spec_breakeven.py`` runs it on the GPU.
"""
from __future__ import annotations

import re
import statistics
from pathlib import Path

from eagle3kit.acceptance import online
from eagle3kit.acceptance.online import Serving, breakeven, cycle_ms

SETTING = re.compile(r"^(\d+),(\d+),(\d+)$")


def untrained_drafter(target_path, dest, draft_vocab_size: int, aux_layer_ids=None) -> Path:
    """An SGLang draft directory of eagle3kit's drafter shape for ``target_path`` with untrained layers (speculators'
    initialisation; embeddings and the draft ``lm_head`` from the target, as training starts): what a trained one
    costs per cycle in SGLang. Its draft vocabulary is the ``draft_vocab_size`` lowest token ids (their count is
    what costs, not which they are). ``aux_layer_ids``: input-of-layer ids (default: SGLang's own default layers)."""
    import torch

    from eagle3kit.drafter import vocab as V
    from eagle3kit.drafter.export import to_sglang
    from eagle3kit.drafter.model import build
    from eagle3kit.layers import sglang_default_aux
    from eagle3kit.target import TargetInfo

    info = TargetInfo.read(Path(target_path))
    aux = [int(k) for k in aux_layer_ids] if aux_layer_ids else sglang_default_aux(info.num_layers)
    vocab = V.build(torch.zeros(info.vocab_size, dtype=torch.int64), min(int(draft_vocab_size), info.vocab_size))
    model = build(target_path, aux, vocab)
    return to_sglang(model, vocab, dest, target_path, aux,
                     provenance={"untrained": True, "purpose": "the speculative cycle's cost (acceptance.breakeven)"})


def untrained_like(drafter, target_path, dest) -> Path:
    """``untrained_drafter`` of the shape of ``drafter`` (an eagle3kit SGLang export): its draft vocabulary's size and
    its capture layers, from its ``eagle3kit.json``. Served beside it at the same setting, the pair times the cycle
    at two accept lengths in one run (``experiment.accepting_cost``)."""
    import json

    from eagle3kit.target import resolve_target

    meta_path = Path(drafter) / "eagle3kit.json"
    try:
        meta = json.loads(meta_path.read_text())
        vocab, layers = int(meta["draft_vocab_size"]), [int(k) for k in meta["capture_layer_ids"][:-1]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{meta_path}: not an eagle3kit SGLang export's record ({e}); the untrained drafter copies "
                         f"its draft vocabulary and layers from it: export the drafter with eagle3kit") from None
    return untrained_drafter(resolve_target(target_path), dest, vocab, layers)


def parse_setting(text: str) -> tuple[int, int, int]:
    """``"steps,topk,draft_tokens"`` as SGLang's ``--speculative-num-steps/-eagle-topk/-num-draft-tokens`` take
    them; a chain (topk 1) drafts ``steps + 1`` tokens."""
    m = SETTING.match(text.strip())
    if not m:
        raise ValueError(f"setting {text!r}: give steps,topk,draft_tokens, e.g. 3,1,4 (a chain) or 5,4,8 (a tree)")
    steps, topk, tokens = map(int, m.groups())
    if steps < 1 or topk < 1 or tokens < 2:
        raise ValueError(f"setting {text!r}: steps and topk at least 1, draft tokens at least 2")
    if topk == 1 and tokens != steps + 1:
        raise ValueError(f"setting {text!r}: a chain (topk 1) of {steps} steps verifies {steps + 1} draft tokens; "
                         f"give {steps},1,{steps + 1}")
    return steps, topk, tokens


def plan(drafter, settings, variants: dict) -> list[Serving]:
    """The servers to time: for each variant (name -> extra SGLang flags, given to its plain server and its
    speculative ones alike, e.g. ``{"base": [], "fi": ["--attention-backend", "flashinfer"]}``), plain and one
    speculative server per setting. Names: ``plain-<variant>``, ``<variant>-<steps>-<topk>-<tokens>``."""
    if not variants:
        raise ValueError("no variant: give at least one, e.g. {'base': []}")
    out = []
    for v, flags in variants.items():
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", v):
            raise ValueError(f"variant {v!r}: letters and digits only (it names servers and metrics)")
        out.append(Serving(f"plain-{v}", None, extra_args=list(flags)))
        for s in settings:
            steps, topk, tokens = parse_setting(s) if isinstance(s, str) else s
            out.append(Serving(f"{v}-{steps}-{topk}-{tokens}", str(drafter), steps, topk, tokens, list(flags)))
    return out


def measurable(servings: list[Serving], failed) -> list[Serving]:
    """The servings still worth timing when ``failed`` (names) did not start: each healthy one whose variant's plain
    server is healthy too (a speculative server is only measured against its own variant's plain one). A flag that
    breaks one variant (e.g. a compile failure) then costs that variant, not the whole run."""
    failed = set(failed)
    plain_ok = {s.name[len("plain-"):] for s in servings if s.drafter is None and s.name not in failed}
    return [s for s in servings if s.name not in failed and _variant(s) in plain_ok]


def _variant(s: Serving) -> str:
    return s.name[len("plain-"):] if s.drafter is None else s.name.split("-")[0]


def breakeven_rounds(plain: dict, spec: dict) -> list[dict]:
    """Per round (batch 1, as ``online.measure_servers`` gives one concurrency of two servers timed in turn): plain's
    milliseconds a token, the speculative cycle's milliseconds (accept length tokens each), and their ratio, the
    break-even accept length."""
    rows = []
    for p, s in zip(plain.get("rounds", []), spec.get("rounds", [])):
        acc, p_tps, s_tps = s.get("accept_length"), p["output_tokens_per_s"], s["output_tokens_per_s"]
        if not acc or not p_tps or not s_tps:
            continue
        rows.append({"plain_ms_per_token": 1000.0 / p_tps, "cycle_ms": cycle_ms(acc, s_tps), "accept_length": acc,
                     "breakeven_accept_length": breakeven(acc, s_tps / p_tps)})
    return rows


def summarize(measured: dict, servings: list[Serving]) -> tuple[dict, list[dict]]:
    """Flat metrics and one table row per speculative server from ``online.measure_servers``' result at batch 1:
    the break-even against its own variant's plain server, its median over rounds, every round, and its spread ((max -
    min) / median); the cycle's and plain's milliseconds (medians); the untrained drafter's accept length (about 1).
    ``breakeven_vs_fastest_plain_<server>`` and ``breakeven_best``: the cycle against the fastest plain server of
    the run among the variants with a speculative server measured, whichever variant it is. A flag that slows plain
    decoding lowers its own variant's ratio without making speculation any faster (gpu-breakeven-sync:
    --disable-overlap-schedule, 1.89 against its own plain, 2.40 against the default plain); the best setting is the
    one that beats the best plain."""
    metrics, table, keys = {}, [], []
    plains = {s.name[len("plain-"):]: s.name for s in servings if s.drafter is None}
    for s in servings:
        if s.drafter is None:
            continue
        variant = _variant(s)
        plain, spec = measured.get(plains[variant], {}).get(1), measured.get(s.name, {}).get(1)
        rows = breakeven_rounds(plain or {}, spec or {})
        if not rows:
            continue
        be = [r["breakeven_accept_length"] for r in rows]
        med = statistics.median(be)
        key = s.name.replace("-", "_")
        metrics.update({f"breakeven_{key}": med, f"breakeven_{key}_rounds": be,
                        f"breakeven_{key}_spread": (max(be) - min(be)) / med if med else 0.0,
                        f"cycle_ms_{key}": statistics.median(r["cycle_ms"] for r in rows),
                        f"plain_ms_per_token_{key}": statistics.median(r["plain_ms_per_token"] for r in rows),
                        f"untrained_accept_length_{key}": statistics.fmean(r["accept_length"] for r in rows)})
        pft, sft = online.first_token_ms(plain or {}), online.first_token_ms(spec or {})
        both = all(ft and "first_token_ms" in ft for ft in (sft, pft))  # the prefill path alone (one-token
        for who, ft in (("", sft), ("plain_", pft)):  # requests), eager under EAGLE, on a graph in plain: the pair,
            for k, v in (ft or {}).items():  # and a failed probe said, not left out silently
                if both or k == "first_token_error":
                    metrics[f"{who}{k}_{key}"] = v
        pf, sf = online.request_fit(plain or {}), online.request_fit(spec or {})
        if pf and sf and pf["cycle_marginal_ms"] > 0 and sf["cycle_marginal_ms"] > 0:  # fixed costs left out: what
            metrics.update({f"cycle_marginal_ms_{key}": sf["cycle_marginal_ms"],  # long replies tend to
                            f"cycle_marginal_ms_se_{key}": sf["cycle_marginal_ms_se"],
                            f"request_fixed_ms_{key}": sf["request_fixed_ms"],
                            f"request_fixed_ms_se_{key}": sf["request_fixed_ms_se"],
                            f"plain_request_fixed_ms_{key}": pf["request_fixed_ms"],
                            f"plain_step_marginal_ms_{key}": pf["cycle_marginal_ms"],
                            f"breakeven_marginal_{key}": sf["cycle_marginal_ms"] / pf["cycle_marginal_ms"]})
        keys.append(key)
        table.append({"variant": variant, "setting": f"({s.steps},{s.topk},{s.draft_tokens})",
                      "plain ms/token": metrics[f"plain_ms_per_token_{key}"], "cycle ms": metrics[f"cycle_ms_{key}"],
                      "break-even": med, "rounds": " ".join(f"{x:.2f}" for x in be),
                      "untrained accept": metrics[f"untrained_accept_length_{key}"],
                      **({"marginal break-even": metrics[f"breakeven_marginal_{key}"],
                          "fixed ms (plain)": f"{metrics[f'request_fixed_ms_{key}']:.0f} "
                                              f"({metrics[f'plain_request_fixed_ms_{key}']:.0f})"}
                         if f"breakeven_marginal_{key}" in metrics else {}),
                      **({"first token ms (plain)": f"{metrics[f'first_token_ms_{key}']:.1f} "
                                                    f"({metrics[f'plain_first_token_ms_{key}']:.1f})"}
                         if f"first_token_ms_{key}" in metrics else {})})
    if table:  # against the fastest plain server of the run: the strongest baseline a user would serve instead
        fastest = min(table, key=lambda r: r["plain ms/token"])
        for key, r in zip(keys, table):
            r["vs fastest plain"] = r["cycle ms"] / fastest["plain ms/token"]
            metrics[f"breakeven_vs_fastest_plain_{key}"] = r["vs fastest plain"]
        best = min(table, key=lambda r: r["vs fastest plain"])
        metrics.update(breakeven_best=best["vs fastest plain"], breakeven_best_setting=f"{best['variant']} {best['setting']}",
                       fastest_plain=f"plain-{fastest['variant']}", fastest_plain_ms_per_token=fastest["plain ms/token"])
    return metrics, table
