"""``eagle3kit`` command line: run (the notebook pipeline), extract, verify, derive, train, export, doctor, compare,
trial (of bad input), materialize."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _extract(a):
    from eagle3kit.extract_config import ExtractConfig
    from eagle3kit.pipeline import run_extraction

    summary = run_extraction(ExtractConfig.from_args(a))
    failures = summary.pop("failures_list", [])
    print(json.dumps(summary, indent=1, default=str))
    for f in failures[:5]:
        print(f"failed: {f['key']}: {f['status']}: {f['reason']}", file=sys.stderr)
    if failures:
        print(f"{len(failures)} samples failed (all in {Path(a.out) / 'failures.json'}); a rerun of the same command "
              f"retries them and keeps everything written", file=sys.stderr)
    return 0 if summary["failed"] == 0 and summary["verify_problems"] == 0 else 1


def _verify(a):
    from eagle3kit.store import verify

    if a.reference:
        from eagle3kit.target import check_device

        check_device(a.reference_device, "--reference-device")
    rep = verify(a.out)
    for p in rep.problems[:50]:
        print(f"{p['key']}: {p['problem']}")
    if rep.unlisted:
        print(f"{len(rep.unlisted)} sample files the manifest does not list (not part of the data set; a rerun of the "
              f"extraction captures those samples again): {', '.join(rep.unlisted[:10])}"
              + (" ..." if len(rep.unlisted) > 10 else ""))
    print(f"checked {rep.checked}, ok {rep.ok}, problems {len(rep.problems)}")
    ok = rep.passed
    if a.reference:
        from eagle3kit import plots
        from eagle3kit.spot_check import reference_check

        r = reference_check(a.out, a.reference, a.seed, a.reference_device)
        worst = {}
        for row in r["rows"]:
            w = worst.setdefault(row["layer_id"], {"slot": row["layer_id"], "bound": row.get("bound", 0.0),
                                                   "worst token err": 0.0, "tokens over": 0})
            w["worst token err"] = max(w["worst token err"], row["token_worst_err"])
            w["tokens over"] += row["tokens_over"]
        print(plots.table(list(worst.values())))
        print(f"reference check: {r['checked']} random samples recomputed by the reference engine, "
              f"{len(r['failed'])} failed" + (f": {r['failed'][:10]}" if r["failed"] else ""))
        ok = ok and not r["failed"]
    return 0 if ok else 1


def _export(a):
    from eagle3kit import export

    src = Path(a.out)
    if (src / "train.json").exists() or (src / "eagle3kit.json").exists():  # a drafter: training folder or export
        from eagle3kit.drafter.export import export_drafter

        print(json.dumps(export_drafter(src, a.dest, a.format, checkpoint=a.checkpoint,
                                        sglang_layer_ids=a.override_sglang_layer_ids, force=a.force), indent=1))
        return 0
    if a.format == "sglang":
        raise ValueError(f"{src} is not a drafter (no train.json / eagle3kit.json): `export sglang` writes a trained "
                         f"drafter for SGLang; pass the out_dir of `eagle3kit train`")
    fn = {"speculators": export.to_speculators, "specforge": export.to_specforge}[a.format]
    print(json.dumps(fn(a.out, a.dest, split=a.split, force=a.force), indent=1))
    return 0


def _derive(a):
    from eagle3kit.store import derive

    print(json.dumps(derive(a.out, a.dest, storage=a.storage, final_slot=a.final_slot, force=a.force), indent=1))
    return 0


def _train(a):
    from eagle3kit.drafter.train import TrainConfig, train

    overrides = _key_values(a.set, "--set", "ttt_steps=7")
    live = _key_values(a.live_set, "--live-set", "stream_gb=4")
    for k, v in (("engine", a.engine), ("urls", a.urls), ("server_args", a.server_args)):
        if v is not None:
            live[k] = v
    if live and not a.live:
        raise ValueError(f"{', '.join(sorted(live))}: live settings; add --live to train from live captures")
    if a.live:
        overrides["live"] = {**(overrides.get("live") or {}), **live}
    cfg = TrainConfig.from_dict({"data": a.data, "out_dir": a.out, **overrides})
    summary = train(cfg)
    print(json.dumps(summary, indent=1, sort_keys=True))
    return 0 if summary.get("train_steps", 0) > 0 else 1


def _key_values(items, flag: str, example: str) -> dict:
    """``KEY=VALUE`` items, each value read as YAML (numbers, booleans, lists)."""
    import yaml

    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"{flag} {item!r}: write KEY=VALUE (e.g. {flag} {example})")
        k, v = item.split("=", 1)
        out[k] = yaml.safe_load(v)
    return out


def _compare(a):
    from eagle3kit.acceptance.compare import collect, write_report

    skipped: list = []
    rows = collect(a.runs, skipped=skipped)
    for line in skipped:
        print(f"eagle3kit compare: {line}", file=sys.stderr)
    if len(rows) < len(a.runs):
        raise ValueError(f"{len(a.runs) - len(rows)} of the {len(a.runs)} runs given gave no row (above); "
                         f"give run folders or metrics.json files with acceptance or training figures")
    from eagle3kit.folders import claim, mark

    claim(a.out, "compare", a.force)  # before anything is written: a user's file named compare.txt stays
    print(write_report(rows, Path(a.out)))
    mark(a.out, "compare")
    return 0


def _doctor(a):
    from eagle3kit.layers import check
    from eagle3kit.target import TargetInfo, resolve_target

    if a.drafter:
        from eagle3kit.doctor import diagnose

        d = diagnose(a.drafter, target=a.target, data=a.data)
    else:
        if not (a.drafter_config and a.capture_layers):
            raise ValueError("doctor needs --drafter DIR (an exported drafter), or --drafter-config and --capture-layers")
        info = TargetInfo.read(resolve_target(a.target or "embedded:smollm2"))
        bad = [k for k in a.capture_layers if not 1 <= k < info.num_layers]
        if bad:
            raise ValueError(f"--capture-layers {' '.join(map(str, a.capture_layers))}: {bad} outside the target's "
                             f"aux range; in the input_of_layer convention aux ids run from 1 to {info.num_layers - 1} "
                             f"({info.num_layers} layers; the final slot {info.num_layers} is added by itself)")
        try:
            drafter = json.loads(Path(a.drafter_config).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"--drafter-config {a.drafter_config}: not a readable JSON config ({e})") from None
        d = check(a.capture_layers + [info.num_layers], drafter, info.model_type, info.num_layers)
        if a.data:
            from eagle3kit.doctor import check_data

            d.findings.extend(check_data(a.data, a.target or "embedded:smollm2").findings)
    print(d)
    if a.drafter and d.ok:  # what serves it, once nothing stands in the way
        import shlex

        from eagle3kit.doctor import serving_command

        cmd = serving_command(a.drafter, a.target)
        print(f"serve it with SGLang (add your server's flags: --tp, ...):\n  {shlex.join(cmd)}")
    return 0 if d.ok else 1


def _trial(a):
    from eagle3kit.trial import CASES, run_trial

    cases = [c for c in CASES if not a.only or any(w in c.name for w in a.only)]
    if not cases:
        raise ValueError(f"--only {' '.join(a.only)}: no case's name holds these words, so nothing was run. Fix: "
                         f"words from the case names (`eagle3kit trial` prints them), e.g. --only verify train")
    m = run_trial(a.folder, cases, force=a.force, main=main)
    from eagle3kit.metrics import update_json

    for path in [Path(a.folder) / "metrics.json"] + ([Path(a.metrics)] if a.metrics else []):
        update_json(path, m)
    print(f"{m['bad_inputs_handled']} of {m['bad_inputs_tried']} bad inputs handled (refused with the input named: "
          f"{m['bad_inputs_refused']}, counted and reported: {m['bad_inputs_counted']})"
          + (f"; NOT handled: {m['bad_inputs_unhandled']}" if m["bad_inputs_unhandled"] else ""))
    return 0 if not m["bad_inputs_unhandled"] else 1


def main(argv=None) -> int:
    from eagle3kit.extract_config import ExtractConfig

    p = argparse.ArgumentParser(prog="eagle3kit", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="execute the pipeline notebooks of a params YAML with papermill")
    r.add_argument("params")
    r.add_argument("--only", nargs="+", metavar="STEP", help="run only these steps")
    r.add_argument("--set", dest="overrides", action="append", default=[], metavar="[STEP.]KEY=VALUE")
    r.add_argument("--notebooks", help="folder of the notebooks (default: ../notebooks beside params/)")
    r.add_argument("--run-dir", help="write into this folder instead of outputs/<experiment>/<timestamp>")

    e = sub.add_parser("extract", help="capture hidden states of a conversation data set")
    ExtractConfig.add_arguments(e)  # one option per setting, with its default and help

    v = sub.add_parser("verify", help="check an extracted data set (checksums, tokens, shapes, finiteness)")
    v.add_argument("out")
    v.add_argument("--reference", type=int, default=0, metavar="N",
                   help="also recompute N random samples with the reference engine and check every token")
    v.add_argument("--seed", type=int, default=0, help="--reference: which samples")
    v.add_argument("--reference-device", default="cpu", help="--reference: cpu or cuda")

    x = sub.add_parser("export", help="a trained drafter for SGLang or speculators/vLLM, or a data set for a trainer")
    x.add_argument("format", choices=["sglang", "speculators", "specforge"])
    x.add_argument("out", help="a training out_dir (drafter) or an extracted data set")
    x.add_argument("dest")
    x.add_argument("--split", default="train", help="data sets: which split")
    x.add_argument("--checkpoint", default="best", choices=["best", "final"], help="drafters: which export")
    x.add_argument("--override-sglang-layer-ids", type=int, nargs="+", default=None,
                   help="drafters, sglang: write these layer ids instead of the training layers' (experiments only; "
                        "the doctor flags the result)")
    x.add_argument("--force", action="store_true",
                   help="replace DEST even when it holds files eagle3kit did not write there (default: refused)")

    g = sub.add_parser("derive", help="a data set re-encoded: fp8 storage, or the final slot post-norm (experiment)")
    g.add_argument("out")
    g.add_argument("dest")
    g.add_argument("--storage", choices=["bf16", "fp8"], default=None)
    g.add_argument("--final-slot", choices=["post_norm"], default=None)
    g.add_argument("--force", action="store_true",
                   help="replace DEST even when it holds files eagle3kit did not write there (default: refused)")

    t = sub.add_parser("train", help="train an EAGLE-3 drafter on an extracted data set, or live from captures "
                                     "(--live) (torchrun for several ranks)")
    t.add_argument("--data", required=True, help="eagle3kit data set (or speculators export); with --live, the "
                                                 "conversations (as extract's --data)")
    t.add_argument("--out", required=True)
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any TrainConfig setting, e.g. --set ttt_steps=7 --set loss=kl --set lm_head=frozen")
    t.add_argument("--live", action="store_true", help="capture while training: no hidden state on disk "
                                                       "(eagle3kit.live)")
    t.add_argument("--engine", choices=["transformers", "sglang"], default=None, help="--live: the capture engine")
    t.add_argument("--urls", nargs="*", default=None, help="--live, sglang: running capture servers (their capture "
                                                           "folder: --live-set stream_dir=...)")
    t.add_argument("--live-set", action="append", default=[], metavar="KEY=VALUE",
                   help="any live setting (LiveConfig), e.g. --live-set stream_gb=4 --live-set max_samples=5000")
    t.add_argument("--server-args", nargs=argparse.REMAINDER, default=None,
                   help="--live, sglang: flags of the capture server started here; last on the line")

    c = sub.add_parser("compare", help="accept-length and speedup table and plots of several runs' metrics.json")
    c.add_argument("runs", nargs="+", help="run folders or metrics.json files (searched recursively)")
    c.add_argument("--out", default="outputs/compare")
    c.add_argument("--force", action="store_true",
                   help="write into --out even when it holds files eagle3kit compare did not write (default: refused)")

    d = sub.add_parser("doctor", help="will SGLang feed a drafter what it was trained on? (layers, norms, options)")
    d.add_argument("--drafter", help="an exported drafter folder (config.json + eagle3kit.json)")
    d.add_argument("--target", default=None, help="default: the drafter's recorded target (or embedded:smollm2)")
    d.add_argument("--capture-layers", nargs="+", type=int, help="input_of_layer ids (aux), with --drafter-config")
    d.add_argument("--drafter-config", help="a drafter config.json, with --capture-layers")
    d.add_argument("--data", help="also check a captured data set's final slot (pre-norm)")

    b = sub.add_parser("trial", help="the bad-input trial: every kind of user mistake run through this command line")
    b.add_argument("--folder", default="outputs/trial", help="where its inputs are made and the cases run")
    b.add_argument("--metrics", help="also merge the figures into this metrics.json (a record's)")
    b.add_argument("--only", nargs="+", metavar="WORD", help="only the cases whose name holds one of these words")
    b.add_argument("--force", action="store_true",
                   help="use --folder even when it holds files an earlier trial did not write (they are deleted)")

    y = sub.add_parser("relay", help="on a capture host: move its capture server's samples to a live training on "
                                     "another host (the training's live relay_port)")
    y.add_argument("--capture-dir", required=True, help="the capture server's capture_dir (a RAM filesystem)")
    y.add_argument("--to", required=True, help="the training's host:port (live relay_port; rank r listens on "
                                               "port + r)")
    y.add_argument("--index", type=int, required=True, help="this sender's number, 1 to --of")
    y.add_argument("--of", type=int, required=True, help="how many capture hosts feed that training rank "
                                                         "(live relay_senders)")
    y.add_argument("--timeout", type=float, default=600, help="seconds to wait for the training to be reached")

    m = sub.add_parser("materialize", help="write the embedded model as a Hugging Face directory; print its path")
    m.add_argument("name", nargs="?", default="smollm2")

    for sp in sub.choices.values():  # --help shows every default (the formatter adds it where there is a help text)
        sp.formatter_class = argparse.ArgumentDefaultsHelpFormatter
        for act in sp._actions:  # noqa: SLF001 - argparse has no public list of a parser's options
            if act.help is None and act.option_strings and act.default is not argparse.SUPPRESS:
                act.help = "(default: %(default)s)"
    a = p.parse_args(argv)
    from eagle3kit.params import ParamsError
    from eagle3kit.runner import StepFailed

    try:
        if a.cmd == "run":
            from eagle3kit.runner import run

            out = run(a.params, a.notebooks, a.only, a.overrides, a.run_dir)
            print(f"run finished: {out}")
            return 0
        if a.cmd == "materialize":
            from eagle3kit.target import materialize

            print(materialize(a.name))
            return 0
        if a.cmd == "trial":
            return _trial(a)
        if a.cmd == "relay":
            from eagle3kit.live.relay import RelaySender

            print(RelaySender(a.capture_dir, a.to, a.index, a.of, timeout_s=a.timeout).run())
            return 0
        return {"extract": _extract, "verify": _verify, "export": _export, "doctor": _doctor, "derive": _derive,
                "train": _train, "compare": _compare}[a.cmd](a)
    except (ParamsError, StepFailed, ValueError, RuntimeError, OSError) as err:  # a user's mistake: no traceback
        print(f"eagle3kit {a.cmd}: {err}", file=sys.stderr)
        return 2 if isinstance(err, (ParamsError, ValueError)) else 1
    except KeyboardInterrupt:
        print(f"eagle3kit {a.cmd}: interrupted" + (" (the run folder's status.json says where)" if a.cmd == "run"
                                                   else ""), file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
