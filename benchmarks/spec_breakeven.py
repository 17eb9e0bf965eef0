"""The break-even accept length of SGLang's speculative decoding at batch 1, per setting, with an untrained drafter
(prints a table, writes metrics.json; GPU). See ``eagle3kit.acceptance.breakeven``: speculation pays when a drafter's
accept length exceeds ``cycle ms / plain ms per token``; an untrained drafter's cycle costs what a trained one's does
(gpu-drafter-pipeline-13's marginal cycles, 3.3-3.7 ms, against 3.3-3.6 here), the requests' fixed costs apart.
Measured (gpu-breakeven-1, -sync): longer chains lower it a little (2.43 at 7 steps, 2.64 at 3), a tree raises it
(2.91 at 5,4,8); --enable-torch-compile does not lower it; --disable-overlap-schedule slows plain, not the cycle.

Servers, all started at once on the one GPU with a fixed KV pool each (``online.shared_gpu_args``, as notebook 05):
for each variant (``--variants '{"base": [], "fi": ["--attention-backend", "flashinfer"]}'``: SGLang flags given to
that variant's plain server and its speculative ones alike) plain SGLang and one EAGLE3 server per setting
(``--settings 3,1,4 5,1,6 7,1,8 5,4,8``: steps,topk,draft tokens), the same untrained drafter in all. Each round
times batch 1 prompt by prompt across every server (``online.measure_interleaved``), from flushed caches, after one
untimed warm pass; ``--rounds`` rounds. Prompts: the first user turns of embedded ShareGPT conversations in the
target's chat template, greedy, ``--max-new-tokens`` each (several: prompt i takes them in turn, so that each
server's requests fit as fixed cost + marginal cycles, ``online.request_fit``; the untrained drafter's replies all
ran to their limit in gpu-breakeven-1, and one length gives no fit). Every round's break-even is kept, with the median and the
spread. After each round's timed pass the same prompts go once more for one new token each (``measure_servers``'
probe): each server's prefill path (``first_token_ms_<server>``, its plain's beside it, and SGLang's own
``e2e_latency`` of those requests), apart from the timed requests. In SGLang 0.5.14 a plain server's prefill runs on
the piecewise CUDA graph and an EAGLE target's eagerly (then the draft's eager extend); the variant
``{"bcg": ["--cuda-graph-backend-prefill", "breakable"]}`` graphs both, and the probe shows what that is worth.

usage: python benchmarks/spec_breakeven.py --out DIR [--target embedded:smollm2] [--draft-vocab 16384]
           [--settings 3,1,4 ...] [--variants JSON] [--prompts 16] [--rounds 3] [--max-new-tokens 64 256]
           [--server-args ...]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--target", default="embedded:smollm2")
    p.add_argument("--draft-vocab", type=int, default=16384, help="draft vocabulary size (params/gpu-smollm2-drafter)")
    p.add_argument("--settings", nargs="+", default=["3,1,4", "5,1,6", "7,1,8", "5,4,8"])
    p.add_argument("--variants", default='{"base": []}', help="JSON: name -> SGLang flags of that variant's servers")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, nargs="+", default=[64, 256])
    p.add_argument("--base-port", type=int, default=31400)
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[])
    a = p.parse_args(argv)

    from transformers import AutoTokenizer

    from eagle3kit.acceptance import breakeven, online
    from eagle3kit.capture.server import stop_all
    from eagle3kit.plots import table
    from eagle3kit.target import resolve_target

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    try:  # refused before anything starts, with the fix
        try:
            variants = json.loads(a.variants)
        except ValueError as e:
            raise ValueError(f"--variants {a.variants!r} is not JSON ({e}); give e.g. '{{\"base\": []}}'") from None
        if not isinstance(variants, dict) or not all(isinstance(v, list) for v in variants.values()):
            raise ValueError(f"--variants {a.variants!r}: give a JSON object of name -> list of SGLang flags")
        settings = [breakeven.parse_setting(s) for s in a.settings]
        servings = breakeven.plan(out / "untrained-drafter", settings, variants)
    except ValueError as e:
        print(f"spec_breakeven: {e}", file=sys.stderr)
        return 2
    path = resolve_target(a.target)
    breakeven.untrained_drafter(path, out / "untrained-drafter", a.draft_vocab)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = online.chat_prompts(tok, a.prompts)
    (out / "settings.json").write_text(json.dumps({**vars(a), "servers": [f"{s.name}: {s.label()}" for s in servings],
                                                   "prompt_tokens": [len(x) for x in prompts]}, indent=1))
    t0 = time.time()
    started = online.start_servers(path, servings, out / "logs", a.base_port,
                                   common_args=[*online.shared_gpu_args(), *a.server_args])
    servers = started["servers"]
    try:
        failed = started["failed"]
        for name, why in failed.items():
            print(f"{name} did not start: {why}", file=sys.stderr)
        servings = breakeven.measurable(servings, failed)  # a variant that breaks costs itself, not the run
        if not any(s.drafter for s in servings):
            print("spec_breakeven: no speculative server with a healthy plain one; nothing to time", file=sys.stderr)
            return 1
        print(f"{len(servers) - len(failed)} servers healthy after {time.time() - t0:.0f} s", flush=True)
        metrics, lost = {}, {}  # lost: servers that failed during the rounds (their whole rounds kept)

        def after_round(done):  # what the rounds so far give (a run cut by its time limit keeps whole rounds)
            metrics.clear()
            m, rows = breakeven.summarize(done, servings)
            metrics.update(m, rounds_done=min((len(c[1]["rounds"]) for c in done.values() if 1 in c), default=0),
                           servers_failed=sorted(failed), servers_lost=dict(lost))
            (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
            (out / "table.txt").write_text(table(rows))

        measured = online.measure_servers({s.name: (servers[s.name].url, {1: prompts}) for s in servings},
                                          a.max_new_tokens, a.rounds, after_round, lost=lost)
        for name, why in lost.items():
            print(f"{name} lost during the rounds: {why}", file=sys.stderr)
        for by in measured.values():  # the replies' token ids: not wanted in the record
            for m in by.values():
                for r in m["rounds"]:
                    r.pop("_outputs", None)
        (out / "measured.json").write_text(json.dumps(measured, indent=1, default=str))
        print((out / "table.txt").read_text())
        print(json.dumps({k: v for k, v in metrics.items() if not k.endswith("_rounds")}, indent=1))
        return 1 if failed or lost else 0  # what ran was measured; a server that did not start or was lost fails the run
    finally:
        stop_all(servers.values())


if __name__ == "__main__":
    sys.exit(main())
