"""The online experiment of notebook 05: every drafter and setting served by SGLang on one GPU, measured against
the plain target with the same prompts in the same run, plus the load proof and the doctor's check in SGLang.

Servers (all started at once, then timed in interleaved rounds, batch 1 prompt by prompt across them,
``online.measure_servers``; see ``online.shared_gpu_args``):
  plain                     the target alone (SGLang's defaults otherwise)
  main                      the trained drafter at (steps, topk, draft tokens) = serving (default 3, 1, 4)
  steps<n>                  the same drafter, chain of n steps (n, 1, n + 1), the sweep
  tree<s>x<k>x<t>           the same drafter as a tree (SGLang's own default for Llama targets is 5, 4, 8)
  <control>                 other drafters (trained on other data) at the serving setting
  offbyone                  the main drafter exported with layer ids off by one (negative control), draft hooks on
  untrained                 a drafter of the main one's shape with untrained layers (``breakeven.untrained_like``) at
                            the serving setting: the cycle at accept length ~1 in the same run, so what accepting
                            adds to a cycle is measured (``cycle_marginal_ms_per_accepted_token``), not assumed
  proof                     the main drafter, CUDA graphs off, draft hooks on: load proof and fed layers
  plain-<v>, main-<v>       plain and main with variant <v>'s extra server arguments (e.g. another attention
                            backend), batch 1: does it lower the break-even? A variant of speculative flags only
                            (``--speculative-*``, e.g. ``--speculative-draft-attention-backend``) has no plain-<v>: plain serves
                            the same without speculation, so main-<v> is held against plain itself
"""
from __future__ import annotations

import json
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eagle3kit.acceptance import online
from eagle3kit.acceptance.outputs_match import outputs_match_plain, outputs_match_stored, tokens_past_eos

PARTIAL = "partial.json"  # in run()'s work folder: the plan and every server measured so far


SETTING_SERVER = re.compile(r"steps\d+|tree\d+x\d+x\d+")  # the chain sweep's and the trees' servers, by name


@dataclass
class OnlinePlan:
    target: str
    drafter: str  # the main drafter's SGLang export
    controls: dict = field(default_factory=dict)  # name -> SGLang export
    serving: tuple = (3, 1, 4)
    sweep_steps: tuple = (1, 2, 3, 4, 5, 6, 7)
    trees: tuple = ((5, 4, 8),)
    offbyone: bool = True
    untrained: bool = False  # the untrained drafter at the serving setting (one more server): what accepting costs
    proof: bool = True
    concurrencies: tuple = (1, 8, 32)
    prompts_per_conc: dict = field(default_factory=lambda: {1: 16, 8: 64, 32: 128})
    max_new_tokens: int = 256
    rounds: int = 2
    server_args: tuple = ("--attention-backend", "triton", "--sampling-backend", "pytorch")
    port: int = 31000  # the first server's port; the others take the next ones (one per server)
    variants: dict = field(default_factory=dict)  # name -> extra server args for plain and main (batch 1), e.g.
    # {"flashinfer": ["--attention-backend", "flashinfer"]}; a variant of speculative flags only (e.g. {"adaptive":
    # ["--speculative-adaptive"]}) is main served otherwise, timed at every concurrency as main is

    def __post_init__(self):  # names become metric prefixes (<name>_speedup): found before any server starts
        for kind, names in (("variant", self.variants), ("control", self.controls)):
            bad = [n for n in names if not str(n).isidentifier()]
            if bad:
                raise ValueError(f"{kind} names {bad} must be identifiers (letters, digits, _), e.g. "
                                 f"{str(bad[0]).replace('-', '_')!r}: they name the metrics")
        # a name another server's metrics already use would overwrite them (online_speedup, steps3_speedup, ...)
        # or the start of a summary figure's name: a control 'breakeven' would write breakeven_accept_length
        taken = {"online", "plain", "main", "proof", "offbyone", "negative_control", "engine_control", "untrained",
                 "breakeven", "breakeven_marginal", "offline", "offline_walk", "cycle", "doctor", "export", "fed_layer"}
        for name in [*self.variants, *self.controls]:
            if name in taken or SETTING_SERVER.fullmatch(name):
                raise ValueError(f"variant or control name {name!r} is taken by another server's metrics: rename it")
        if "fp8" in self.variants:  # fp8_accept_rel_diff is the fp8 storage control's cost
            raise ValueError("variant name 'fp8' is the fp8 storage control's: rename the variant (e.g. 'kv_fp8')")
        both = set(self.controls) & (set(self.variants) | {f"{v}_plain" for v in self.variants})
        if both:
            raise ValueError(f"names {sorted(both)} are given to a variant and a control (or a variant's plain server):"
                             f" their metrics would overwrite each other; rename one")


def servings(plan: OnlinePlan, work: Path) -> list[online.Serving]:
    from eagle3kit.acceptance.drafthook import draft_hooks

    s, t, d = plan.serving
    out = [online.Serving("plain"), online.Serving("main", plan.drafter, s, t, d)]
    out += [online.Serving(f"steps{n}", plan.drafter, n, 1, n + 1) for n in plan.sweep_steps if (n, 1, n + 1) != (s, t, d)]
    out += [online.Serving(f"tree{a}x{b}x{c}", plan.drafter, a, b, c) for a, b, c in plan.trees]
    out += [online.Serving(name, path, s, t, d) for name, path in plan.controls.items()]
    if plan.offbyone:
        out.append(online.Serving("offbyone", str(work / "offbyone"), s, t, d, hooks=draft_hooks(work / "hooks-offbyone")))
    if plan.untrained:
        out.append(online.Serving("untrained", str(work / "untrained"), s, t, d))
    for v, args in plan.variants.items():
        if not speculative_only(args):
            out.append(online.Serving(f"plain-{v}", extra_args=list(args)))
        out.append(online.Serving(f"main-{v}", plan.drafter, s, t, d, extra_args=list(args)))
    if plan.proof:
        out.append(online.Serving("proof", plan.drafter, s, t, d, extra_args=["--disable-cuda-graph"],
                                  hooks=draft_hooks(work / "hooks-proof")))
    return out


def speculative_only(args) -> bool:
    """True when every flag of a variant's server arguments is a speculative one: without speculation the target
    would be served exactly as ``plain``, so a second plain server would only measure noise."""
    flags = [a for a in args if str(a).startswith("--")]
    return bool(flags) and all(str(a).startswith("--speculative-") for a in flags)


def control_verdicts(controls: dict) -> dict:
    """The doctor on each control's export, before it is served: ``<name>_doctor_ok`` (and its findings). A mistake
    the export records (a post-norm final slot, layer ids other than the training's) must be flagged; one it cannot
    see (another engine's states, fp8 storage, original replies) passes, and only serving measures its cost."""
    from eagle3kit.doctor import diagnose

    out = {}
    for name, path in controls.items():
        try:
            d = diagnose(path)
            out[f"{name}_doctor_ok"], out[f"{name}_doctor_findings"] = d.ok, str(d)
        except (OSError, ValueError) as e:
            out[f"{name}_doctor_ok"], out[f"{name}_doctor_findings"] = False, f"not diagnosed: {e}"
    return out


def export_offbyone(drafter: str, dest: Path) -> list[int]:
    """The main drafter with its SGLang layer ids shifted by +1 (the classic mistake)."""
    from eagle3kit.drafter.export import export_drafter

    cfg = json.loads((Path(drafter) / "config.json").read_text())
    ids = [k + 1 for k in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    export_drafter(Path(drafter), dest, "sglang", sglang_layer_ids=ids)
    return ids


def run(plan: OnlinePlan, prompts: list[list[int]], work, log=print, on_proof=None, stored=None, decode=None,
        eos_ids=None) -> dict:
    """Start, send the proof requests, measure, stop. Returns {"servers": per-server measurements, "failed": ...}.
    ``on_proof(results)``: called once the proof and off-by-one servers have answered their requests (their draft
    hooks' records are on disk), before the timed rounds, so the proof is made and recorded even when a time limit
    ends the rounds (it came after them, and was lost with them in gpu-drafter-pipeline-9). Its errors are logged,
    never raised: the measurements go on. ``stored``, ``decode``: the data set's replies to batch 1's prompts and a
    token decoder, for ``outputs_match_stored``. ``eos_ids``: the target's end-of-sequence ids
    (``online.eos_token_ids``): timed replies run past them (equal work, ``online.sampling_params``), so the texts are
    compared as far as the first of them, and each server's share of timed tokens past it is kept."""
    from eagle3kit.capture.server import stop_all

    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    if plan.offbyone:
        export_offbyone(plan.drafter, work / "offbyone")
    if plan.untrained:
        from eagle3kit.acceptance.breakeven import untrained_like

        untrained_like(plan.drafter, plan.target, work / "untrained")
    specs = servings(plan, work)
    t0 = time.time()
    started = online.start_servers(plan.target, specs, work / "logs", plan.port,
                                   common_args=[*plan.server_args, *online.shared_gpu_args()])
    servers, failed = started["servers"], started["failed"]
    log(f"{len(servers) - len(failed)} of {len(servers)} servers healthy after {time.time() - t0:.0f} s; failed: "
        f"{sorted(failed)}")
    need = max(plan.prompts_per_conc.values())
    if len(prompts) < need:
        prompts = (prompts * (need // max(len(prompts), 1) + 1))[:need]
    by_conc = {c: prompts[:plan.prompts_per_conc[c]] for c in plan.concurrencies}
    results = {"servers": {}, "failed": failed, "startup_seconds": time.time() - t0}
    try:
        spec_by_name = {s.name: s for s in specs}
        order = ["plain", "main"] + [s.name for s in specs if s.name not in ("plain", "main")]
        timed = {}
        for name in order:
            if name in failed or name not in servers:
                continue
            srv = servers[name]
            if name in ("proof", "offbyone"):  # their draft hook records a few requests of ours, one at a time
                _proof_requests(srv.url, by_conc[1][:4])
                results["servers"].setdefault(name, {})["prompts"] = {f"{i}": p for i, p in enumerate(by_conc[1][:4])}
                if name == "proof":  # CUDA graphs off: not a speed figure
                    continue
            # every setting's speed is a ratio users act on: each gets the same rounds as plain (batch 1 only: cheap);
            # plain and main also at every concurrency
            v = _variant_of(name)  # main served with speculative flags only: a serving option, as main
            every = name in ("plain", "main") or (v is not None and name == f"main-{v}"
                                                   and speculative_only(plan.variants[v]))
            timed[name] = (srv.url, by_conc if every else {1: by_conc[1]})
        if on_proof is not None:
            try:
                on_proof(results)
            except Exception as e:  # noqa: BLE001 - the proof is redone after the rounds; the rounds go on
                log(f"proof before the rounds failed: {type(e).__name__}: {e}")

        def keep(measured):  # after each round: the results so far, on disk (an interrupted run keeps them)
            for name, m in measured.items():
                spec = spec_by_name[name]
                results["servers"].setdefault(name, {}).update(
                    setting=[spec.steps, spec.topk, spec.draft_tokens] if spec.drafter else None, drafter=spec.drafter,
                    by_concurrency=m)
            _save_partial(work, plan, results)

        t1 = time.time()
        lost: dict = {}  # servers that failed during the rounds: counted as failed, their whole rounds kept
        online.measure_servers(timed, plan.max_new_tokens, plan.rounds, after_round=keep, lost=lost)
        for name, why in lost.items():
            failed[name] = f"during the timed rounds: {why}"
            log(f"{name} lost {failed[name]}")
        _save_partial(work, plan, results)
        for name in timed:
            b1 = results["servers"].get(name, {}).get("by_concurrency", {}).get(1)
            if not b1:
                continue
            acc = [r["accept_length"] for r in b1["rounds"] if "accept_length" in r]
            log(f"{name:>14}: conc 1 {b1['output_tokens_per_s_median']:8.1f} tok/s"
                + (f", accept {statistics.fmean(acc):.3f}" if acc else ""))
        log(f"{len(timed)} servers, {plan.rounds} interleaved rounds: {time.time() - t1:.0f} s")
    finally:
        stop_all(servers.values())
    eos = set(eos_ids or ())
    results["outputs_match_plain"] = outputs_match_plain(results, eos)
    if eos:
        results["tokens_past_eos"] = tokens_past_eos(results, eos)
    if stored and decode is not None:
        try:  # a side figure: it never costs the measurements above
            results["outputs_match_stored"] = outputs_match_stored(results, stored, decode, eos)
        except Exception as e:  # noqa: BLE001
            log(f"stored replies not compared: {type(e).__name__}: {e}")
    for r in results["servers"].values():
        for m in r.get("by_concurrency", {}).values():
            for rr in m["rounds"]:
                rr.pop("_outputs", None)
    return results


def _save_partial(work: Path, plan: OnlinePlan, results: dict) -> None:
    """The plan and the results so far (replies left out), written atomically: ``record_partial`` reads them."""
    def rounds_without_replies(m):
        return {**m, "rounds": [{k: v for k, v in rr.items() if k != "_outputs"} for rr in m["rounds"]]}

    servers = {name: {**r, "by_concurrency": {c: rounds_without_replies(m) for c, m in r["by_concurrency"].items()}}
               if "by_concurrency" in r else r for name, r in results["servers"].items()}
    tmp = work / f".{PARTIAL}.tmp"
    tmp.write_text(json.dumps({"plan": asdict(plan), "results": {**results, "servers": servers}}, indent=1, default=str))
    tmp.replace(work / PARTIAL)


def load_partial(work) -> tuple[OnlinePlan, dict] | None:
    """(plan, results) as ``_save_partial`` left them (JSON's string keys back to concurrencies), or None."""
    p = Path(work) / PARTIAL
    if not p.exists():
        return None
    saved = json.loads(p.read_text())
    plan = OnlinePlan(**saved["plan"])
    plan.serving = tuple(plan.serving)
    plan.prompts_per_conc = {int(k): v for k, v in plan.prompts_per_conc.items()}
    results = saved["results"]
    for r in results["servers"].values():
        if "by_concurrency" in r:
            r["by_concurrency"] = {int(c): m for c, m in r["by_concurrency"].items()}
    return plan, results


def record_partial(step, target: str | None = None) -> dict:
    """After an interrupted online run (a time limit, Ctrl-C): the figures of every server measured before it, merged
    into the step's ``metrics.json`` with ``online_partial`` true and ``online_servers_measured``, and the proof and
    the doctor's check when ``proof.json`` was written before the rounds (``run``'s ``on_proof``). Nothing is recorded when the notebook
    already recorded the complete summary (``online_required_servers_failed`` present) or nothing was measured.
    Offline figures: those the step recorded before the online part (notebook 05's first cells). ``target``: the
    target here when the record was brought back from the machine that ran it (``embedded:smollm2``)."""
    from eagle3kit.metrics import update_json

    step = Path(step)
    loaded = load_partial(step / "online")
    mfile = step / "metrics.json"
    recorded = json.loads(mfile.read_text()) if mfile.exists() else {}
    if loaded is None or "online_required_servers_failed" in recorded:
        return {}
    plan, results = loaded
    if target:  # the run's target folder was on another machine (a record brought back): the same model here
        from eagle3kit.target import resolve_target

        plan.target = str(resolve_target(target))
    measured = [n for n, r in results["servers"].items() if "by_concurrency" in r]
    if not measured:
        return {}
    proof = step / "proof.json"  # made before the rounds (notebook 05's on_proof), so a cut run has it too
    m = summarize(plan, results, json.loads(proof.read_text()) if proof.exists() else {}, {"main": recorded})
    for k in ("online_servers_failed", "online_required_servers_failed"):  # the summary's mark of a complete run
        m.pop(k, None)
    m.update(online_partial=True, online_servers_measured=len(measured),
             online_servers_planned=len(servings(plan, step / "online")))
    update_json(mfile, m)
    return m


REQUIRED = ("plain", "main", "proof", "offbyone")  # without them the experiment shows nothing


def _variant_of(name: str) -> str | None:
    return name.split("-", 1)[1] if name.startswith(("plain-", "main-")) else None


def _metric_prefix(name: str) -> str:
    """A server's name as the start of a metric name: a variant's servers by the variant (main-adaptive: adaptive,
    plain-fi: fi_plain), every other server by its own name."""
    v = _variant_of(name)
    return name if v is None else v if name.startswith("main-") else f"{v}_plain"


def _proof_requests(url: str, prompts) -> None:
    """A few requests with the draft hook's rid prefix, one at a time (the hook records their draft prefill).
    The radix cache is flushed before each: a cached prefix (the chat template's shared system prompt) would make
    SGLang extend only the uncached suffix, so the record would not be the whole prompt at positions 0..T-1."""
    import requests

    from eagle3kit.acceptance.drafthook import RID_PREFIX

    with requests.Session() as s:
        for i, ids in enumerate(prompts):
            online.flush(url)
            s.post(url + "/generate", timeout=600, json={"input_ids": list(ids), "rid": f"{RID_PREFIX}{i}",
                                                        "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}})


def prove(plan: OnlinePlan, results: dict, work, device: str = "cpu") -> dict:
    """Load proof (params, logits) and the doctor's check for the proof and off-by-one servers' records."""
    from safetensors.torch import load_file

    from eagle3kit.acceptance import proof
    from eagle3kit.acceptance.drafthook import RID_PREFIX
    from eagle3kit.target import resolve_target

    work = Path(work)
    target = resolve_target(plan.target)
    out = {}
    for name, export, hooks in (("proof", plan.drafter, work / "hooks-proof"),
                                ("offbyone", work / "offbyone", work / "hooks-offbyone")):
        if name not in results["servers"] or not (hooks / "draft_params.safetensors").exists():
            out[name] = {"error": f"no draft records in {hooks}" + ((hooks / "errors.txt").read_text()[-1500:]
                                                                   if (hooks / "errors.txt").exists() else "")}
            continue
        params = load_file(str(hooks / "draft_params.safetensors"))
        recs = proof.records(hooks)
        prompts = {f"{RID_PREFIX}{i}": p for i, p in results["servers"][name]["prompts"].items()}
        r = {"hook_records": len(recs)}
        for part, fn in (("prompts", lambda: proof.attach_prompts(recs, prompts)),
                         ("params", lambda: proof.compare_params(params, export, target)),
                         ("logits", lambda: proof.compare_logits(recs, export, params.get("lm_head.weight"), device)),
                         ("doctor", lambda: proof.verify_doctor(export, recs, target, device))):
            try:
                got = fn()
                if part != "prompts":
                    r.update(got)
            except Exception as e:  # noqa: BLE001 - keep what the other parts show
                import traceback

                r[f"{part}_error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
        out[name] = r
    return out


def _accept(results: dict, name: str, conc: int = 1):
    r = results["servers"].get(name, {}).get("by_concurrency", {}).get(conc)
    acc = [x["accept_length"] for x in r["rounds"] if "accept_length" in x] if r else []
    return statistics.fmean(acc) if acc else None


SPEEDUP_SPREADS = re.compile(r"round\d+|rounds_min|rounds_max|medians_ratio|pooled|ci95_low|ci95_high")  # of a
# speedup <key>: <key>_<these> (``_speedup_spreads``)


def _speedup_spreads(key: str, plain: dict, spec: dict, *, batch1: bool) -> dict:
    """``<key>`` is the median of the rounds' paired ratios (``online.paired_speedup``); beside it
    ``<key>_round<i>``: round i's ratio to plain's round of the same moment, ``<key>_rounds_min/max``: their range
    (the speedup's own spread, ``online.paired_speedups``), ``<key>_medians_ratio``: the two servers' medians' ratio
    (what records before the paired median reported); at batch 1 also ``<key>_pooled`` (every prompt and round
    pooled) and ``<key>_ci95_low/high``, its interval over the prompts (``online.speedup_interval``); nothing without
    rounds."""
    paired = online.paired_speedups(plain, spec)
    out = {f"{key}_rounds_min": min(paired), f"{key}_rounds_max": max(paired)} if paired else {}
    out.update({f"{key}_round{i}": x for i, x in enumerate(paired)})
    if paired and plain.get("output_tokens_per_s_median"):
        out[f"{key}_medians_ratio"] = spec["output_tokens_per_s_median"] / plain["output_tokens_per_s_median"]
    pooled = online.pooled_speedup(plain, spec) if batch1 else None
    ci = online.speedup_interval(plain, spec) if batch1 else None
    if pooled is not None:
        out[f"{key}_pooled"] = pooled
    if ci:
        out[f"{key}_ci95_low"], out[f"{key}_ci95_high"] = ci
    return out


def speedup_report(m: dict, key: str = "online_speedup") -> str:
    """One line of a speedup as 05 prints it: the median of the paired rounds, every round's ratio, the medians'
    ratio for comparison; then, apart, how many prompts gave the same text as plain and as the stored replies (the
    timing is of equal work whatever the text, ``online.sampling_params``)."""
    if key not in m:
        return f"{key}: not measured"
    rounds = [m[k] for k in sorted((k for k in m if re.fullmatch(rf"{key}_round\d+", k)),
                                   key=lambda k: int(k.rsplit("round", 1)[1]))]
    text = f"{key} {m[key]:.3f}: median of {len(rounds)} paired rounds ({' '.join(f'{x:.3f}' for x in rounds)})"
    if f"{key}_medians_ratio" in m:
        text += f"; the medians' ratio {m[f'{key}_medians_ratio']:.3f}"
    if key == "online_speedup":  # main's replies: the text, apart from the equal-work timing
        same = [f"{m[f'main_outputs_identical_to_{w}_prompts']} of {m[f'main_outputs_compared_with_{w}']} prompts "
                f"identical to {w}" for w in ("plain", "stored") if f"main_outputs_compared_with_{w}" in m]
        if "main_tokens_past_eos_share" in m:
            same.append(f"{m['main_tokens_past_eos_share']:.1%} of main's timed tokens past the end of its reply")
        if same:
            text += "\ntext (apart from the timing, which is of equal work): " + "; ".join(same)
    return text


def _best_setting(results: dict, m: dict, plan: "OnlinePlan") -> dict:
    """What to serve with: the setting with the highest speedup at batch 1 among main, the chain sweep, the trees and
    main under each variant (not the controls, not the untrained drafter), named with its (steps, topk, draft tokens)
    and a variant's flags. Its speedup is against the run's fastest plain server at batch 1 (plain, or a variant's
    plain when its flags make plain decoding faster: the strongest baseline a user would keep), named in
    ``online_best_baseline``. With no variant's plain faster the baseline is plain: the figure is a setting's
    ``<key>_speedup``, or for main under a variant with a plain of its own ``<v>_speedup_vs_plain`` (its
    ``<v>_speedup`` is against that variant's plain)."""
    srv = results["servers"]
    plains = [n for n in srv if n == "plain" or (n.startswith("plain-") and _variant_of(n) in plan.variants)]
    tps = {n: srv[n].get("by_concurrency", {}).get(1, {}).get("output_tokens_per_s_median") or 0.0 for n in srv}
    if not plains or not max(tps[n] for n in plains):
        return {}
    base = max(plains, key=lambda n: (tps[n], n == "plain"))  # a tie goes to SGLang's defaults
    best = None
    for name, r in srv.items():
        v = _variant_of(name) if name.startswith("main-") else None
        if not (name == "main" or SETTING_SERVER.fullmatch(name) or v in plan.variants) or not tps.get(name):
            continue
        setting = ",".join(map(str, r.get("setting") or list(plan.serving)))
        label = f"{name} ({setting})" + ("".join(f" {a}" for a in plan.variants[v]) if v else "")
        sp = online.paired_speedup(srv[base]["by_concurrency"][1], r["by_concurrency"][1])
        if sp is not None and (best is None or sp > best[2]):
            best = (name, label, sp)
    if best is None:
        return {}
    name, label, sp = best
    key = "online" if name == "main" else _metric_prefix(name)
    out = {"online_best_setting": label, "online_best_baseline": base, "online_best_speedup": sp}
    accept = m.get(f"{key}_accept_length")
    if accept is not None:
        out["online_best_accept_length"] = accept
    # its rounds against the baseline's of the same moment, its interval over the prompts
    out.update(_speedup_spreads("online_best_speedup", srv[base]["by_concurrency"][1], srv[name]["by_concurrency"][1],
                                batch1=True))
    return out


def proof_metrics(plan: OnlinePlan, proofs: dict) -> dict:
    """Flat metrics of ``prove``'s results: the load proof (the proof server) and the doctor's check against what
    SGLang fed the draft (proof and off-by-one), with the target family whose rule SGLang applied."""
    from eagle3kit.layers import sglang_convention
    from eagle3kit.target import TargetInfo, resolve_target

    m: dict = {}
    for name, p in proofs.items():
        pre = "" if name == "proof" else f"{name}_"
        for k, v in p.items():
            if k.endswith("error") and isinstance(v, str):
                m[f"{pre}{k}"] = v[:300]
        for k in ("export_params_checked", "export_params_unloaded", "export_logits_max_rel_err",
                  "export_logits_all_rows_max_rel_err", "export_logits_argmax_agreement"):
            if k in p and name == "proof":
                m[k] = p[k]
        if "doctor_verified" in p:
            m[f"{pre}doctor_verified"] = bool(p["doctor_verified"])
            m[f"{pre}doctor_ok"] = bool(p["doctor_ok"])
            m[f"{pre}fed_layer_ids"] = ",".join(map(str, p["fed_layer_ids"]))
            m[f"{pre}fed_layer_max_rel_err"] = max(p["fed_layer_rel_err"])
    try:
        arch = (json.loads((Path(plan.drafter) / "config.json").read_text()).get("architectures") or [""])[0]
    except (OSError, ValueError, TypeError):
        arch = ""
    m["drafter_architecture"] = arch
    if arch == "Eagle3DeepseekV2ForCausalLM":  # the MLA head (#46): its logits proof under its own names
        for k in ("max_rel_err", "all_rows_max_rel_err", "argmax_agreement"):
            if f"export_logits_{k}" in m:
                m[f"mla_logits_{k}"] = m[f"export_logits_{k}"]
    info = TargetInfo.read(resolve_target(plan.target))  # model_type: a wrapper's language model's (Kimi: deepseek_v3)
    family = sglang_convention(info.model_type).removeprefix("sglang_")  # the rule SGLang applied: llama or deepseek
    m["doctor_target_model_type"] = info.model_type
    m["doctor_target_architecture"] = info.architecture
    m["doctor_verified_families"] = family if m.get("doctor_verified") and m.get("offbyone_doctor_verified", True) \
        else ""
    return m


def control_offline(controls, offline: dict, steps: int) -> dict:
    """Each control's offline tau at ``steps`` on the held-out split and its change against the main drafter's
    (``<name>_offline_rel_diff``; fp8's is #11's storage goal, within 2 %): tens of thousands of rows, finer than the
    prompts served (gpu-drafter-pipeline-10: fp8 -0.3 %, a second training seed -1.5 %, both within the online
    intervals)."""
    key = f"offline_tau_{steps}"
    main = offline.get("main", {}).get(key)
    m = {}
    for name in controls:
        tau = offline.get(name, {}).get(key)
        if tau is not None:
            m[f"{name}_offline_tau"] = tau
            if main:
                m[f"{name}_offline_rel_diff"] = tau / main - 1
    return m


def fit_metrics(key: str, measured: dict, accept, plain_fit) -> dict:
    """``online.request_fit`` of one server's batch-1 requests under ``key``: ``<key>_request_fixed_ms``,
    ``<key>_cycle_marginal_ms`` (and their standard errors); with plain's fit and the accept length, the ratio with the
    fixed costs left out, what long replies tend to: ``<key>_breakeven_marginal`` (a cycle in plain steps) and
    ``<key>_speedup_marginal``. With the one-token probe (``online.first_token_ms``): ``<key>_first_token_ms`` (and
    ``_server_ms``), the part of the fixed cost that is the prefill path."""
    out = {f"{key}_{k}": v for k, v in (online.first_token_ms(measured or {}) or {}).items()}
    f = online.request_fit(measured or {})
    if not f:
        return out
    out.update({f"{key}_request_fixed_ms": f["request_fixed_ms"], f"{key}_request_fixed_ms_se": f["request_fixed_ms_se"],
                f"{key}_cycle_marginal_ms": f["cycle_marginal_ms"], f"{key}_cycle_marginal_ms_se": f["cycle_marginal_ms_se"]})
    if plain_fit and plain_fit["cycle_marginal_ms"] > 0 and f["cycle_marginal_ms"] > 0:
        out[f"{key}_breakeven_marginal"] = f["cycle_marginal_ms"] / plain_fit["cycle_marginal_ms"]
        if accept:
            out[f"{key}_speedup_marginal"] = accept * plain_fit["cycle_marginal_ms"] / f["cycle_marginal_ms"]
    return out


def accepting_cost(m: dict) -> dict:
    """What each accepted token adds to the speculative cycle, from main and the untrained drafter at the same setting
    in the same run: ``cycle_ms_per_accepted_token`` = (main's cycle - untrained's) / (main's accept length -
    untrained's), and ``cycle_steps_per_accepted_token``, the same in plain decode steps: over whole requests, so each
    request's fixed cost, carried by fewer cycles when more is accepted, is in it; ``cycle_marginal_ms_per_accepted_token``
    from the fits (``online.request_fit``) leaves it out. 0 would mean a cycle costs the same whatever the drafter
    accepts: gpu-drafter-pipeline-13's fits (3.3-3.7 ms a cycle) against gpu-breakeven-1's untrained cycles (3.3-3.6)
    say about that, across runs. Nothing when either is missing or they accept within 0.1 token."""
    need = ("online_cycle_ms", "untrained_cycle_ms", "online_accept_length", "untrained_accept_length")
    if not all(m.get(k) for k in need):
        return {}
    da = m["online_accept_length"] - m["untrained_accept_length"]
    if da < 0.1:
        return {}
    per = (m["online_cycle_ms"] - m["untrained_cycle_ms"]) / da
    out = {"cycle_ms_per_accepted_token": per}
    if m.get("plain_ms_per_token"):
        out["cycle_steps_per_accepted_token"] = per / m["plain_ms_per_token"]
    if m.get("online_cycle_marginal_ms") and m.get("untrained_cycle_marginal_ms"):  # the fixed costs left out
        out["cycle_marginal_ms_per_accepted_token"] = (m["online_cycle_marginal_ms"]
                                                       - m["untrained_cycle_marginal_ms"]) / da
    return out


def summarize(plan: OnlinePlan, results: dict, proofs: dict, offline: dict) -> dict:
    """Flat metrics of the online experiment. ``offline``: name -> offline metrics (``offline_tau_{n}``) of that
    drafter on the held-out split ("main" and the controls; "main_first_replies": the main drafter on the first
    replies of the conversations whose prompts batch 1 served, ``offline.first_replies``)."""
    m: dict = {"online_servers_failed": len(results.get("failed", {})),
               "online_required_servers_failed": len(set(results.get("failed", {})) & set(REQUIRED)),
               "online_startup_seconds": results.get("startup_seconds", 0.0)}
    srv = results["servers"]
    s, t, d = plan.serving
    m["online_serving"] = f"{s},{t},{d}"  # main's setting, which the unsuffixed figures are of
    plain_fit = online.request_fit(srv.get("plain", {}).get("by_concurrency", {}).get(1, {}))  # once, for every server
    for name, r in srv.items():  # a server whose accept length SGLang's counts could not give: why, not a figure
        errs = [x["accept_length_error"] for c in r.get("by_concurrency", {}).values() for x in c.get("rounds", [])
                if "accept_length_error" in x]
        if errs:
            m[f"{'online' if name == 'main' else _metric_prefix(name)}_accept_length_error"] = errs[0]
    if "plain" in srv and "main" in srv:
        for conc in plan.concurrencies:
            if conc not in srv["main"]["by_concurrency"]:
                continue
            sm = online.summarize(srv["plain"]["by_concurrency"], srv["main"]["by_concurrency"], conc)
            sfx = "" if conc == 1 else f"_c{conc}"
            m[f"online_speedup{sfx}"] = sm["speedup"]
            m.update(_speedup_spreads(f"online_speedup{sfx}", srv["plain"]["by_concurrency"][conc],
                                      srv["main"]["by_concurrency"][conc], batch1=conc == 1))
            m[f"plain_tokens_per_s{sfx}"] = sm["plain_tokens_per_s"]
            m[f"spec_tokens_per_s{sfx}"] = sm["spec_tokens_per_s"]
            if sm["accept_length"] is not None:
                m[f"online_accept_length{sfx}"] = sm["accept_length"]
            n1 = plan.prompts_per_conc.get(1, 0)
            same = online.accept_on_first(srv["main"]["by_concurrency"][conc], n1) if conc != 1 and n1 else None
            if same is not None:  # the prompts batch 1 took, at this concurrency: prompts or concurrency?
                m[f"online_accept_length{sfx}_on_batch1_prompts"] = same
            for who in ("plain", "main"):
                rounds = srv[who]["by_concurrency"][conc]["rounds"]
                for i, r in enumerate(rounds):
                    m[f"{who}_tokens_per_s{sfx}_round{i}"] = r["output_tokens_per_s"]
                m[f"{who}_tokens_per_s{sfx}_spread"] = online.spread(srv[who]["by_concurrency"][conc])
            if conc == 1 and sm.get("breakeven_accept_length"):
                m["breakeven_accept_length"] = sm["breakeven_accept_length"]
            if "cycle_ms" in sm:  # the break-even's parts: how long a cycle takes, how long plain takes a token
                m["plain_ms_per_token"], m["online_cycle_ms"] = sm["plain_ms_per_token"], sm["cycle_ms"]
        ci = online.accept_interval(srv["main"]["by_concurrency"][1])
        if ci:  # how far batch 1's prompts pin the accept length down
            m["online_accept_length_ci95_low"], m["online_accept_length_ci95_high"] = ci
        r1 = srv["main"]["by_concurrency"][1]["rounds"]
        sa = [r["server_accept_length"] for r in r1 if r.get("server_accept_length") is not None]
        if sa:
            m["online_accept_length_server"] = statistics.fmean(sa)
        m["online_sglang_spec_accept_length"] = statistics.fmean(r.get("sglang_spec_accept_length_mean", 0) for r in r1)
        if plain_fit:
            m["plain_request_fixed_ms"], m["plain_step_marginal_ms"] = (plain_fit["request_fixed_ms"],
                                                                        plain_fit["cycle_marginal_ms"])
        for k, v in (online.first_token_ms(srv["plain"]["by_concurrency"].get(1, {})) or {}).items():
            m[f"plain_{k}"] = v  # plain's prefill path, against each speculative server's
        fm = fit_metrics("online", srv["main"]["by_concurrency"][1], m.get("online_accept_length"), plain_fit)
        m.update(fm)
        if "online_breakeven_marginal" in fm:
            m["breakeven_marginal_accept_length"] = fm["online_breakeven_marginal"]
    main_off = offline.get("main", {})
    if f"offline_tau_{s}" in main_off:
        m["offline_tau"] = main_off[f"offline_tau_{s}"]
        if m.get("online_accept_length"):
            m["offline_online_rel_gap"] = abs(m["offline_tau"] - m["online_accept_length"]) / m["online_accept_length"]
    if f"offline_walk_accept_length_{s}" in main_off:  # serving's own count offline: the like-for-like comparison
        m["offline_walk_accept_length"] = main_off[f"offline_walk_accept_length_{s}"]
        if m.get("online_accept_length"):
            m["offline_walk_online_rel_gap"] = (abs(m["offline_walk_accept_length"] - m["online_accept_length"])
                                                / m["online_accept_length"])
    same = offline.get("main_first_replies", {}).get(f"offline_walk_accept_length_{s}",
                                                      main_off.get("offline_walk_same_replies"))  # or as 05 recorded it
    if same is not None:  # the stored first replies of the conversations batch 1 served, walked
        m["offline_walk_same_replies"] = same
        if m.get("online_accept_length"):
            m["offline_walk_same_replies_online_rel_gap"] = abs(same - m["online_accept_length"]) / m["online_accept_length"]
    plain1 = srv.get("plain", {}).get("by_concurrency", {}).get(1, {}).get("output_tokens_per_s_median")
    for b, args in plan.variants.items():  # the same comparison within a variant's servers (batch 1)
        p, q = (srv.get(f"{w}-{b}", {}).get("by_concurrency", {}) for w in ("plain", "main"))
        if speculative_only(args):  # served plain as plain is
            p = srv.get("plain", {}).get("by_concurrency", {})
        for conc in sorted(set(p) & set(q)):  # batch 1; every concurrency for a speculative-only variant
            sm, sfx = online.summarize(p, q, conc), "" if conc == 1 else f"_c{conc}"
            m[f"{b}_plain_tokens_per_s{sfx}"] = sm["plain_tokens_per_s"]
            m[f"{b}_spec_tokens_per_s{sfx}"] = sm["spec_tokens_per_s"]
            m[f"{b}_speedup{sfx}"] = sm["speedup"]
            m.update(_speedup_spreads(f"{b}_speedup{sfx}", p[conc], q[conc], batch1=conc == 1))
            if conc == 1 and not speculative_only(args) and "plain" in srv and 1 in srv["plain"]["by_concurrency"]:
                # against SGLang's defaults too: a flag that speeds main may slow or speed plain itself
                m[f"{b}_speedup_vs_plain"] = online.summarize(srv["plain"]["by_concurrency"], q, 1)["speedup"]
                m.update(_speedup_spreads(f"{b}_speedup_vs_plain", srv["plain"]["by_concurrency"][1], q[1],
                                          batch1=True))
            if sm["accept_length"] is not None:
                m[f"{b}_accept_length{sfx}"] = sm["accept_length"]
                if conc == 1:
                    m[f"{b}_breakeven_accept_length"] = sm.get("breakeven_accept_length") or 0.0
                if "cycle_ms" in sm:  # against its own plain's step (plain's itself for a speculative-only one)
                    m[f"{b}_cycle_ms"], m[f"{b}_plain_ms_per_token"] = sm["cycle_ms"], sm["plain_ms_per_token"]
    for name, r in srv.items():
        if name in ("plain", "main", "proof") or _variant_of(name) or "by_concurrency" not in r:
            continue
        a = _accept(results, name)
        key = {"offbyone": "negative_control"}.get(name, name)
        if a is not None:
            m[f"{key}_accept_length"] = a
        ci = online.accept_interval(r["by_concurrency"][1])
        if ci:
            m[f"{key}_accept_length_ci95_low"], m[f"{key}_accept_length_ci95_high"] = ci
        if "main" in srv and not SETTING_SERVER.fullmatch(name):  # a control (a mistake) at main's setting
            cost = online.accept_difference_interval(srv["main"]["by_concurrency"].get(1, {}), r["by_concurrency"][1])
            if cost:  # main minus this drafter on the same prompts: above 0 when the cost exceeds the prompts' spread
                m[f"{key}_accept_cost_ci95_low"], m[f"{key}_accept_cost_ci95_high"] = cost
        tps = r["by_concurrency"][1]["output_tokens_per_s_median"]
        m[f"{key}_tokens_per_s_spread"] = online.spread(r["by_concurrency"][1])
        sp = online.paired_speedup(srv["plain"]["by_concurrency"][1], r["by_concurrency"][1]) if plain1 else None
        if sp is not None:
            m[f"{key}_speedup"] = sp
            m.update(_speedup_spreads(f"{key}_speedup", srv["plain"]["by_concurrency"][1], r["by_concurrency"][1],
                                      batch1=True))
            if a is not None and tps:  # what this setting's cycle costs, in accepted tokens (steps, tree, control)
                m[f"{key}_breakeven_accept_length"] = online.breakeven(a, sp)
                m[f"{key}_cycle_ms"] = online.cycle_ms(a, tps)
            m.update(fit_metrics(key, r["by_concurrency"][1], a, plain_fit))
    m.update(accepting_cost(m))
    m.update(control_offline(plan.controls, offline, s))
    if "engine" in plan.controls and "engine_accept_length" in m:
        m["engine_control_accept_length"] = m["engine_accept_length"]
    if m.get("fp8_accept_length") and m.get("online_accept_length"):
        m["fp8_accept_rel_diff"] = (m["fp8_accept_length"] - m["online_accept_length"]) / m["online_accept_length"]
    for n in plan.sweep_steps:
        if f"offline_tau_{n}" in main_off:
            m[f"offline_tau_steps{n}"] = main_off[f"offline_tau_{n}"]
    if (t, d) == (1, s + 1) and f"steps{s}_accept_length" not in m and "online_accept_length" in m:  # main is a chain
        m[f"steps{s}_accept_length"] = m["online_accept_length"]
        m[f"steps{s}_speedup"] = m.get("online_speedup", 0.0)
        if "online_cycle_ms" in m:
            m[f"steps{s}_cycle_ms"] = m["online_cycle_ms"]
        for k in [k for k in m if SPEEDUP_SPREADS.fullmatch(k.removeprefix("online_speedup_"))]:
            m[f"steps{s}_speedup_{k[len('online_speedup_'):]}"] = m[k]
    m.update(_best_setting(results, m, plan))
    m.update(proof_metrics(plan, proofs))
    for name, match in results.get("outputs_match_plain", {}).items():
        m[f"{_metric_prefix(name)}_outputs_identical_to_plain"] = match["identical"]
        m[f"{_metric_prefix(name)}_common_prefix_with_plain"] = match["common_prefix"]
        if "prompts" in match:  # how many of batch 1's prompts gave the same text: apart from the timing, which
            m[f"{_metric_prefix(name)}_outputs_identical_to_plain_prompts"] = match["identical_prompts"]  # is of
            m[f"{_metric_prefix(name)}_outputs_compared_with_plain"] = match["prompts"]  # equal work
    for name, match in results.get("outputs_match_stored", {}).items():  # batch 1's replies against the data set's
        m[f"{name}_outputs_identical_to_stored"] = match["identical"]
        m[f"{name}_common_prefix_with_stored"] = match["common_prefix"]
        if "prompts" in match:
            m[f"{name}_outputs_identical_to_stored_prompts"] = match["identical_prompts"]
            m[f"{name}_outputs_compared_with_stored"] = match["prompts"]
    for name, share in results.get("tokens_past_eos", {}).items():  # timed tokens no stopping request would make
        m[f"{_metric_prefix(name)}_tokens_past_eos_share"] = share
    return m
