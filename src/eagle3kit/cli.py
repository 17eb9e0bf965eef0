"""``eagle3kit`` command line: run (the notebook pipeline), extract, verify, export, doctor, materialize."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _extract(a):
    from eagle3kit.pipeline import run_extraction

    summary = run_extraction(target=a.target, data=a.data, out_dir=a.out, engine=a.engine, urls=a.urls,
                             aux_layer_ids=a.layers, max_samples=a.max_samples, max_tokens=a.max_tokens,
                             storage=a.storage, concurrency=a.concurrency, world_size=a.world_size, rank=a.rank,
                             final_normed=a.final_normed, server_args=a.server_args, seed=a.seed,
                             heldout_percent=a.heldout_percent, regenerate=a.regenerate,
                             regenerate_max_new_tokens=a.regenerate_max_new_tokens)
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

    rep = verify(a.out)
    for p in rep.problems[:50]:
        print(f"{p['key']}: {p['problem']}")
    print(f"checked {rep.checked}, ok {rep.ok}, problems {len(rep.problems)}")
    return 0 if rep.passed else 1


def _export(a):
    from eagle3kit import export

    fn = {"speculators": export.to_speculators, "specforge": export.to_specforge}[a.format]
    print(json.dumps(fn(a.out, a.dest, split=a.split), indent=1))
    return 0


def _doctor(a):
    from eagle3kit.layers import check
    from eagle3kit.target import TargetInfo, resolve_target

    info = TargetInfo.read(resolve_target(a.target))
    drafter = json.loads(Path(a.drafter_config).read_text())
    d = check(a.capture_layers + [info.num_layers], drafter, info.model_type, info.num_layers)
    print(d)
    return 0 if d.ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="eagle3kit", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="execute the pipeline notebooks of a params YAML with papermill")
    r.add_argument("params")
    r.add_argument("--only", nargs="+", metavar="STEP", help="run only these steps")
    r.add_argument("--set", dest="overrides", action="append", default=[], metavar="[STEP.]KEY=VALUE")
    r.add_argument("--notebooks", help="folder of the notebooks (default: ../notebooks beside params/)")
    r.add_argument("--run-dir", help="write into this folder instead of outputs/<experiment>/<timestamp>")

    e = sub.add_parser("extract", help="capture hidden states of a conversation data set")
    e.add_argument("--target", default="embedded:smollm2")
    e.add_argument("--data", default="embedded:sharegpt")
    e.add_argument("--out", required=True)
    e.add_argument("--engine", choices=["transformers", "sglang"], default="transformers")
    e.add_argument("--urls", nargs="*", default=[], help="capture servers (sglang engine); none: start one")
    e.add_argument("--layers", nargs="+", type=int, default=None, help="aux layers, input_of_layer convention")
    e.add_argument("--max-samples", type=int, default=None)
    e.add_argument("--max-tokens", type=int, default=2048)
    e.add_argument("--storage", choices=["bf16", "fp8"], default="bf16")
    e.add_argument("--concurrency", type=int, default=64)
    e.add_argument("--world-size", type=int, default=1)
    e.add_argument("--rank", type=int, default=0)
    e.add_argument("--final-normed", action="store_true", help="also store the normed final state (SpecForge)")
    e.add_argument("--regenerate", action="store_true",
                   help="replace assistant turns with the target's own greedy replies first (kept for resumes)")
    e.add_argument("--regenerate-max-new-tokens", type=int, default=256)
    e.add_argument("--seed", type=int, default=0, help="seed of the train/held-out split")
    e.add_argument("--heldout-percent", type=float, default=5.0)
    e.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                   help="SGLang flags for the server started here (sglang engine, no --urls); last on the line")

    v = sub.add_parser("verify", help="check an extracted data set (checksums, tokens, shapes, finiteness)")
    v.add_argument("out")

    x = sub.add_parser("export", help="write an extracted data set in a trainer's layout")
    x.add_argument("format", choices=["speculators", "specforge"])
    x.add_argument("out")
    x.add_argument("dest")
    x.add_argument("--split", default="train")

    d = sub.add_parser("doctor", help="check capture layers against a drafter config for SGLang")
    d.add_argument("--target", default="embedded:smollm2")
    d.add_argument("--capture-layers", nargs="+", type=int, required=True, help="input_of_layer ids (aux)")
    d.add_argument("--drafter-config", required=True)

    m = sub.add_parser("materialize", help="write the embedded model as a Hugging Face directory; print its path")
    m.add_argument("name", nargs="?", default="smollm2")

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
        return {"extract": _extract, "verify": _verify, "export": _export, "doctor": _doctor}[a.cmd](a)
    except (ParamsError, StepFailed, ValueError, RuntimeError, FileNotFoundError) as err:
        print(f"eagle3kit {a.cmd}: {err}", file=sys.stderr)
        return 2 if isinstance(err, (ParamsError, ValueError)) else 1


if __name__ == "__main__":
    sys.exit(main())
