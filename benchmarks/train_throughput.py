"""Drafter training throughput: eagle3kit's trainer, and speculators 0.9.0's own Trainer on the same data (ratio).

A  eagle3kit.drafter.train.train(): a TrainConfig (RECIPE + --set), ``--steps`` optimizer steps.
A' the same training step on a few batches already on the device (no loader, no evaluation): what the step's own
   work sustains, so A / A' says how much the input path costs; with a torch.profiler table of its slowest
   operations (logs/compute-rN-profile.txt, by device time and by host time).
B  speculators' Trainer on the same train split exported by ``eagle3kit export speculators``: its ArrowDataset,
   multipack DataLoader (shift_batch), AdamW / autocast step loop (``Trainer.train_epoch``), on the same network
   (speculators' Eagle3DraftModel as eagle3kit builds it: one layer, the target's hidden size, the same draft
   vocabulary), same TTT steps, decay, lr and token budget (its ``total_seq_len``). Its own recipe stays: KL over the
   draft vocabulary, flex attention and a torch.compile'd forward on a GPU, batches padded to the budget, no
   gradient accumulation. Its default GPU loss (fused Triton) fails inside the compiled forward under torch 2.11
   (dynamo AssertionError, seen on the H200): the round then runs again with its eager loss
   (``--loss-implementation eager``); the error is kept in settings.speculators.fused_loss_error.

Tokens counted, alike in both: the aligned positions of the samples a step consumed (a sample of L tokens gives
L - 1: every position with a preceding state), loss-masked or not, never padding. A: rows of the packed batch;
B: ``document_ids != -1`` after shift_batch. Time per optimizer step, waiting for data included (A: train_log.jsonl,
without evaluation, checkpoints, export; B: end of one step to the end of the next, GPU synchronized). The first
``--warmup`` steps of each round (worker start, warm-up, B's compile) are left out of the figure.
Each pass runs in its own process, A then B, ``--rounds`` times (on ``--device cpu`` forked from a process that
imported torch, transformers, eagle3kit and speculators once: those imports take ~15 s of a CPU pass; on a GPU each
pass starts a fresh interpreter, so that nothing touched CUDA before the fork); one that fails or outlasts
``--timeout-s`` is reported (``train_error`` / ``speculators_error``), never hangs the run. On ``--device cpu`` B needs two patches in
its process (settings: cpu_patches): speculators' Trainer moves model and batches to ``get_local_rank()`` (an int,
i.e. cuda:N), set to "cpu", and its step timer calls torch.accelerator.synchronize(), made a no-op.

A/B: ``--ab k=v`` runs A and A' a second time in each round with those settings over ``--set`` (eagle3kit-ab,
compute-ab), e.g. ``--ab attention=sdpa``: the dense TTT attention against the block-sparse flex default on a GPU.

usage: python benchmarks/train_throughput.py --data DATASET_DIR --out OUT_DIR [--steps 30] [--rounds 2]
           [--tokens-per-batch 4096] [--device cuda|cpu] [--workers 3] [--set k=v ...] [--ab k=v ...]
           [--passes eagle3kit,compute,speculators]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# pass A's TrainConfig (B follows it): the GPU drafter recipe (params/gpu-smollm2-drafter.yaml, 04_train), one
# micro-batch per optimizer step (speculators' Trainer has no accumulation); --set overrides any TrainConfig field
RECIPE = {"draft_vocab_size": 16384, "ttt_steps": 5, "step_decay": 0.8, "loss": "ce_masked", "lm_head": "trained",
          "lr": 1e-3, "grad_accum": 1}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="an eagle3kit data set (eagle3kit extract --out)")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per pass")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens-per-batch", type=int, default=4096, help="A: tokens_per_batch; B: total_seq_len")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--warmup", type=int, default=2, help="first steps of each round left out of the figure")
    p.add_argument("--workers", type=int, default=3, help="DataLoader workers of both passes")
    p.add_argument("--max-minutes", type=float, default=0.0, help="per pass and round; 0: --steps decides")
    p.add_argument("--timeout-s", type=int, default=300, help="a pass running longer is killed and reported")
    p.add_argument("--spec-attn", default="auto", help="B's draft attention: auto (GPU simple_flex_attention, "
                   "CPU sdpa), simple_flex_attention, sdpa, eager")
    p.add_argument("--spec-loss", default="auto", help="B's loss implementation: auto (GPU fused, and eager if fused "
                   "fails; CPU eager), fused, eager")
    p.add_argument("--set", action="append", default=[], metavar="k=v", help="TrainConfig field (JSON value)")
    p.add_argument("--ab", action="append", default=[], metavar="k=v", help="a second configuration of eagle3kit's "
                   "passes (these TrainConfig fields over --set), run in the same rounds, interleaved: "
                   "eagle3kit-ab, compute-ab (e.g. --ab attention=sdpa against the default flex on a GPU)")
    p.add_argument("--passes", default="eagle3kit,compute,speculators", help="which passes run (comma-separated): "
                   "eagle3kit (A), compute (A'), speculators (B)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.device is None:
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    return a


def train_config(a, out_dir, ab: bool = False):
    from eagle3kit.drafter.train_config import TrainConfig

    sets = {}
    for kv in a.set + (a.ab if ab else []):
        k, _, v = kv.partition("=")
        try:
            sets[k] = json.loads(v)
        except json.JSONDecodeError:
            sets[k] = v
    return TrainConfig.from_dict({**RECIPE, **sets, "data": str(a.data), "out_dir": str(out_dir), "device": a.device,
                                  "max_steps": a.steps, "tokens_per_batch": a.tokens_per_batch, "workers": a.workers,
                                  "eval_every": a.steps, "save_every": a.steps, "max_minutes": a.max_minutes,
                                  "progress": False})


def figure(tokens: list[int], seconds: list[float], warmup: int) -> dict:
    w = warmup if len(tokens) > warmup else 0
    return {"tokens_per_s": sum(tokens[w:]) / sum(seconds[w:]), "steps": len(tokens), "warmup_steps_left_out": w,
            "tokens": sum(tokens[w:]), "seconds": sum(seconds[w:]),
            "tokens_per_s_all_steps": sum(tokens) / sum(seconds),  # the first steps included
            "fastest_step_tokens_per_s": max(n / t for n, t in zip(tokens[w:], seconds[w:]))}  # input never waited


def pass_a(a, out: Path, ab: bool = False) -> dict:
    """eagle3kit's train(); per-step time and data wait from train_log.jsonl, rows from the packing plan."""
    from eagle3kit.drafter import data as D
    from eagle3kit.drafter.train import train

    cfg = train_config(a, out, ab)
    summary = train(cfg)
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    src = D.CaptureSource(cfg.data, "train")
    lengths = [src.length(i) for i in range(len(src))]
    per_step, tpb = cfg.grad_accum * cfg.rows_per_batch, cfg.tokens_per_batch  # packed rows per optimizer step
    per_epoch = len(D.plan(lengths, tpb, cfg.seed, 0)) // per_step  # as train(): batch j of epoch e
    rows = []
    for s in range(len(log)):
        epoch, k = divmod(s, per_epoch)
        step = D.epoch_plan(lengths, tpb, cfg.seed, epoch, per_epoch * per_step)[k * per_step:(k + 1) * per_step]
        rows.append(sum(min(max(lengths[i] - 1, 0), tpb) for b in step for i in b))
    if sum(rows) != summary["train_tokens_seen"] or not all(r["tokens_per_s"] > 0 for r in log):
        # samples were skipped: the plan's rows are not what was trained; fall back to train()'s overall figure
        return {"tokens_per_s": summary["train_tokens_per_s"], "steps": summary["train_steps"],
                "note": "overall figure of metrics.json (first steps included): samples were skipped"}
    res = figure(rows, [r["seconds"] for r in log], a.warmup)
    w = res["warmup_steps_left_out"]
    wait = sum(r["data_wait_s"] for r in log[w:]) / max(sum(r["seconds"] for r in log[w:]), 1e-9)
    return {**res, "train_py_tokens_per_s": summary["train_tokens_per_s"], "data_wait_fraction": wait}


def compute_alone(a, out: Path, ab: bool = False) -> dict:
    """A': eagle3kit's optimizer step (forward_batch, backward, clipping, AdamW) on batches loaded once."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from eagle3kit.drafter import data as D
    from eagle3kit.drafter.train import forward_batch
    from eagle3kit.drafter.training_setup import setup
    from eagle3kit.drafter.ttt import TTTModule

    cfg = train_config(a, out, ab)
    run = setup(cfg)
    src = run.train_src
    batches = D.plan([src.length(i) for i in range(len(src))], cfg.tokens_per_batch, cfg.seed, 0)[:8 * cfg.rows_per_batch]
    loaded = [{k: v.to(run.device) for k, v in b.items()}
              for _, b, _ in D.loader(src, batches, run.info.n_states, run.info.hidden_size, cfg.tokens_per_batch,
                                      workers=0, rows=cfg.rows_per_batch) if b is not None]
    params = [p for p in run.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    module = TTTModule(run.model)
    run.model.train()
    cuda = run.device.type == "cuda"

    def step(b) -> int:
        loss, _ = forward_batch(run, module, b, cfg.ttt_steps)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(run.device)
        return D.real_rows(b)

    tokens, seconds = [], []
    for i in range(a.steps):
        t0 = time.perf_counter()
        tokens.append(step(loaded[i % len(loaded)]))
        seconds.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for i in range(3):
            step(loaded[i % len(loaded)])
    ka = prof.key_averages()
    table = Path(a.out) / "logs" / f"{a.child}-r{a.round}-profile.txt"
    table.write_text(("by device time\n" + ka.table(sort_by="self_cuda_time_total", row_limit=25) + "\n" if cuda else "")
                     + "by host time\n" + ka.table(sort_by="self_cpu_time_total", row_limit=25) + "\n")
    return {**figure(tokens, seconds, a.warmup), "batches_on_device": len(loaded), "profile": table.name}


def loader_alone(a) -> dict:
    """eagle3kit's batch loader without training (same plan, workers, pinning): can it feed the GPU?"""
    from eagle3kit.drafter import data as D

    cfg = train_config(a, Path(a.out) / "loader")
    src = D.CaptureSource(cfg.data, "train")
    info = src.info()
    batches = D.plan([src.length(i) for i in range(len(src))], cfg.tokens_per_batch, cfg.seed, 0)
    batches = batches[: max(a.steps * cfg.grad_accum * cfg.rows_per_batch, 8)]
    t0, rows = time.perf_counter(), 0
    for _, b, _ in D.loader(src, batches, info.n_states, info.hidden_size, cfg.tokens_per_batch, workers=cfg.workers,
                            pin=a.device.startswith("cuda"), rows=cfg.rows_per_batch):
        rows += 0 if b is None else D.real_rows(b)
    dt = time.perf_counter() - t0
    return {"tokens_per_s": rows / dt, "tokens": rows, "seconds": dt, "batches": len(batches), "workers": cfg.workers}


def pass_b(a, out: Path, data: Path) -> dict:
    """speculators' Trainer on the speculators export of the same train split."""
    import torch

    import speculators.train.distributed as sdist
    from eagle3kit.drafter import data as D
    from eagle3kit.drafter import vocab as V
    from eagle3kit.drafter.model import build
    from eagle3kit.drafter.training_setup import count_frequencies
    from eagle3kit.target import TargetInfo, resolve_target
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset
    from speculators.train.dataloader import _setup_dataloader
    from speculators.train.trainer import Trainer, TrainerConfig

    cfg = train_config(a, out)
    cuda = torch.device(cfg.device).type == "cuda"
    torch.manual_seed(cfg.seed)
    src = D.CaptureSource(cfg.data, "train")
    info = src.info()
    target = resolve_target(info.target)
    tinfo = TargetInfo.read(target)
    vocab = V.build(count_frequencies(src, tinfo.vocab_size), min(cfg.draft_vocab_size, tinfo.vocab_size))  # A's
    aux = info.layer_ids[:-1]
    attn = a.spec_attn if a.spec_attn != "auto" else ("simple_flex_attention" if cuda else "sdpa")
    model = build(target, aux, vocab, cfg.num_layers, cfg.fc_norm, cfg.norm_output,
                  train_lm_head=cfg.lm_head == "trained", ttt_steps=cfg.ttt_steps, attn_implementation=attn)
    dtype = torch.bfloat16 if cuda else torch.float32  # CPU: no autocast there (the Trainer autocasts "cuda")
    ds = ArrowDataset(max_len=cfg.tokens_per_batch, datapath=str(data), on_missing="raise", split="train",
                      hidden_states_dtype=dtype)
    loader = _setup_dataloader(ds, cfg.tokens_per_batch, tinfo.hidden_size, num_workers=cfg.workers,
                               num_target_layers=len(aux), prefetch_factor=4, preprocess=shift_batch, seed=cfg.seed)
    if not cuda:  # speculators' Trainer as shipped needs an accelerator; two patches let it run on a CPU:
        sdist._local_rank = "cpu"  # noqa: SLF001 - it moves model and batches to get_local_rank() (0: cuda:0)
        torch.accelerator.synchronize = lambda *_, **__: None  # its step timer syncs the accelerator every step
    elif torch.device(cfg.device).index:
        sdist._local_rank = torch.device(cfg.device).index  # noqa: SLF001
    loss_impl = a.spec_loss if a.spec_loss != "auto" else ("fused" if cuda else "eager")
    kw = {"ttt_steps": cfg.ttt_steps, "ttt_step_loss_decay": cfg.step_decay,
          "loss_config": resolve_loss_config("kl_div", loss_impl)}
    trainer = Trainer(model, TrainerConfig(lr=cfg.lr, num_epochs=1 << 20, save_path=str(out / "checkpoints"),
                                           train_call_kwargs=kw, optimizer="adamw", weight_decay=cfg.weight_decay,
                                           hidden_states_dtype=dtype, max_steps=a.steps), loader)
    tokens, stamps = [], []
    model.register_forward_pre_hook(lambda m, args, kwargs: tokens.append((kwargs["document_ids"] != -1).sum()),
                                    with_kwargs=True)
    t0 = time.perf_counter()

    def tick():
        if cuda:
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())
        if a.max_minutes and stamps[-1] - t0 > 60 * a.max_minutes:
            trainer.config = trainer.config._replace(max_steps=trainer.global_step)  # the loop stops after this

    epoch = 0
    while trainer.global_step < trainer.config.max_steps:
        before = trainer.global_step
        trainer.train_epoch(epoch, step_callback=tick)
        if trainer.global_step == before:
            raise RuntimeError(f"speculators' loader made no batch in epoch {epoch} ({len(loader)} batches)")
        epoch += 1
    seconds = [t - s for s, t in zip([t0, *stamps], stamps)]
    return {**figure([int(t) for t in tokens], seconds, a.warmup), "attn": attn, "loss_implementation": loss_impl,
            "epochs": epoch, "batches_per_epoch": len(loader)}


def speculators_export(a, spec_data: Path, say):
    """B's data: ``eagle3kit export speculators`` of the data set; seconds it took, or None (the reason said)."""
    t = time.time()
    try:  # the CLI, in its own process: Arrow's thread pools can abort at exit (tests/conftest.py)
        why = subprocess.run([sys.executable, "-m", "eagle3kit.cli", "export", "speculators", str(a.data),
                              str(spec_data)], capture_output=True, text=True, timeout=a.timeout_s).stderr
    except subprocess.TimeoutExpired:
        why = f"timed out after {a.timeout_s} s"
    if (spec_data / "dataset_info.json").exists():
        took = round(time.time() - t, 1)
        say(f"speculators export: {spec_data} in {took} s")
        return took
    say(f"speculators export failed: {why.strip()[-1500:]}")
    return None


def child(a) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(max(a.timeout_s - 20, 10))  # a hang leaves its stacks in the pass's log
    out = Path(a.out)
    res = out / f"{a.child}-r{a.round}.json"
    try:
        ab = a.child.endswith("-ab")
        r = pass_a(a, out / f"{a.child}-r{a.round}", ab) if a.child.startswith("eagle3kit") else \
            compute_alone(a, out / f"{a.child}-r{a.round}", ab) if a.child.startswith("compute") else \
            pass_b(a, out / f"speculators-r{a.round}", out / "speculators_data")
    except Exception as e:  # noqa: BLE001 - reported by the parent
        traceback.print_exc()
        r = {"error": f"{type(e).__name__}: {e}"[:2000]}
    res.write_text(json.dumps(r, indent=1))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip native teardown (Arrow thread pools can abort at exit: tests/conftest.py)


PRELOAD = ["torch", "transformers", "eagle3kit.drafter.train", "speculators.models.eagle3"]


def pass_process(argv: list, log: str) -> None:
    """A pass's process: its own session (killed whole on a timeout, DataLoader workers included), its output into
    ``log``; ``main`` then runs the pass (``child``) and exits."""
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    main(argv)


def pass_context(device: str):
    """Where passes start: forked from a server that imported ``PRELOAD`` (CPU), or spawned fresh (GPU)."""
    if not device.startswith("cpu"):
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_pass(a, argv, name: str, rnd: int, say) -> dict:
    out = Path(a.out)
    for p in (out / f"{name}-r{rnd}", out / f"{name}-r{rnd}.json"):  # a fresh run: train() resumes otherwise
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    log = out / "logs" / f"{name}-r{rnd}.log"
    t, timed_out = time.time(), False
    p = pass_context(a.device).Process(target=pass_process, args=([*argv, "--child", name, "--round", str(rnd)],
                                                                  str(log)))
    p.start()
    p.join(a.timeout_s)
    timed_out = p.is_alive()
    try:
        os.killpg(p.pid, signal.SIGKILL)  # the pass (on a timeout) and any DataLoader worker it left behind
    except ProcessLookupError:
        pass
    p.join()
    res_file = out / f"{name}-r{rnd}.json"
    r = json.loads(res_file.read_text()) if res_file.exists() else \
        {"error": (f"killed after --timeout-s {a.timeout_s}" if timed_out else f"exit {p.exitcode}") + "; log tail: "
                  + " | ".join(log.read_text(errors="replace").strip().splitlines()[-5:])[-1500:]}
    r["wall_s"] = round(time.time() - t, 1)
    wait = f", waiting for data {r['data_wait_fraction']:.0%} of the time" if "data_wait_fraction" in r else ""
    say(f"  {name:<12} round {rnd}: " + (f"{r['tokens_per_s']:>12,.0f} tok/s  ({r['steps']} steps, fastest step "
                                          f"{r.get('fastest_step_tokens_per_s', 0):,.0f} tok/s{wait}, wall {r['wall_s']} s)"
                                          if "error" not in r else f"ERROR {r['error'].splitlines()[0][:300]}"))
    return r


def stats(rounds: list[dict]) -> dict:
    v = [r["tokens_per_s"] for r in rounds if "error" not in r]
    if not v:
        return {"median": None, "rounds": []}
    med = statistics.median(v)
    return {"median": med, "rounds": v, "min": min(v), "max": max(v), "spread_pct": 100 * (max(v) - min(v)) / med}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse(argv)
    if a.child:
        child(a)
    out = Path(a.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                      PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    lines = []

    def say(s=""):
        print(s, flush=True)
        lines.append(s)

    passes = set(a.passes.split(","))
    if not passes or passes - {"eagle3kit", "compute", "speculators"}:
        raise SystemExit(f"--passes {a.passes}: choose among eagle3kit, compute, speculators")
    cfg = train_config(a, out / "eagle3kit-r1")  # refuses bad --set values before anything runs
    if a.ab:
        train_config(a, out / "eagle3kit-ab-r1", ab=True)
    say(f"train throughput: data {a.data}, device {a.device}, {a.steps} steps x {a.rounds} rounds, "
        f"tokens_per_batch {a.tokens_per_batch}, ttt_steps {cfg.ttt_steps}, draft vocab {cfg.draft_vocab_size}, "
        f"workers {a.workers}, first {a.warmup} steps left out")
    ld = loader_alone(a)
    say(f"eagle3kit's loader alone: {ld['tokens_per_s']:,.0f} tok/s ({ld['batches']} batches, {ld['workers']} workers, "
        f"{ld['seconds']:.1f} s, worker start included)")
    spec_data = out / "speculators_data"
    shutil.rmtree(spec_data, ignore_errors=True)
    spec_export = speculators_export(a, spec_data, say) if "speculators" in passes else None
    res, spec_argv, fused_error = {"eagle3kit": [], "compute": [], "speculators": []}, [], None
    if a.ab:
        res.update({"eagle3kit-ab": [], "compute-ab": []})
    for rnd in range(1, a.rounds + 1):
        for name in [n for n in res if n != "speculators"]:
            left_out = name.replace("-ab", "") not in passes
            res[name].append({"error": "left out (--passes)"} if left_out else run_pass(a, argv, name, rnd, say))
        if "speculators" not in passes:
            res["speculators"].append({"error": "left out (--passes)"})
            continue
        if spec_export is None:
            res["speculators"].append({"error": "the speculators export failed"})
            continue
        r = run_pass(a, argv + spec_argv, "speculators", rnd, say)
        if "error" in r and a.spec_loss == "auto" and a.device.startswith("cuda") and not spec_argv:
            # speculators' default GPU loss (fused Triton kernel) inside its torch.compile'd forward: seen to fail
            # with torch 2.11 (dynamo: "ListVariable ... already tracked for mutation"); its eager loss is the
            # documented alternative (--loss-implementation eager)
            fused_error, spec_argv = r["error"], ["--spec-loss", "eager"]
            say("  speculators: the fused loss failed; this and later rounds with --spec-loss eager")
            r = run_pass(a, argv + spec_argv, "speculators", rnd, say)
        res["speculators"].append(r)
    e3k, spec, comp = stats(res["eagle3kit"]), stats(res["speculators"]), stats(res["compute"])
    ratio = e3k["median"] / spec["median"] if e3k["median"] and spec["median"] else None
    say()
    say(f"{'pass':<12} " + " ".join(f"{f'round {i}':>12}" for i in range(1, a.rounds + 1))
        + f" {'median':>12} {'spread':>8}   tokens/s")
    ab = {n: stats(res[n]) for n in ("eagle3kit-ab", "compute-ab") if n in res}
    for name, s in (("eagle3kit", e3k), ("compute", comp), *ab.items(), ("speculators", spec)):
        cells = [f"{r['tokens_per_s']:>12,.0f}" if "error" not in r else
                 f"{'-' if r['error'].startswith('left out') else 'error':>12}" for r in res[name]]
        say(f"{name:<12} " + " ".join(cells) + (f" {s['median']:>12,.0f} {s['spread_pct']:>7.1f}%"
                                                 if s["median"] else f" {'-':>12} {'-':>8}"))
    say(f"ratio eagle3kit / speculators (medians): {ratio:.2f}" if ratio else "ratio eagle3kit / speculators: -")
    if comp["median"] and e3k["median"]:
        say(f"eagle3kit's step alone (batches on the device): {comp['median']:,.0f} tok/s; the full trainer reaches "
            f"{e3k['median'] / comp['median']:.0%} of it (profile: logs/compute-r1-profile.txt)")
    if ab:
        for n in ab:
            base = (e3k if n.startswith("eagle3kit") else comp)["median"]
            if base and ab[n]["median"]:
                say(f"{n.replace('-ab', '')} / {n} (with {' '.join(a.ab)} over the same settings), medians: "
                    f"{base / ab[n]['median']:.2f}")
    errors = [r["error"] for r in res["speculators"] if "error" in r and "speculators" in passes]
    train_errors = [r["error"] for r in res["eagle3kit"] if "error" in r and "eagle3kit" in passes]
    metrics = {"train_tokens_per_s_alone": e3k["median"], "train_tokens_per_s_rounds": e3k["rounds"],
               "train_tokens_per_s_spread_pct": e3k.get("spread_pct"),
               "speculators_tokens_per_s": spec["median"], "speculators_tokens_per_s_rounds": spec["rounds"],
               "speculators_tokens_per_s_spread_pct": spec.get("spread_pct"),
               "train_vs_speculators_ratio": ratio, "rounds": a.rounds, "loader_tokens_per_s": ld["tokens_per_s"],
               "train_step_alone_tokens_per_s": comp["median"], "train_step_alone_tokens_per_s_rounds": comp["rounds"],
               "compute_rounds_detail": res["compute"],
               **({"ab_settings": a.ab, "train_tokens_per_s_ab": ab["eagle3kit-ab"]["median"],
                   "train_tokens_per_s_ab_rounds": ab["eagle3kit-ab"]["rounds"],
                   "train_step_alone_tokens_per_s_ab": ab["compute-ab"]["median"],
                   "train_step_alone_tokens_per_s_ab_rounds": ab["compute-ab"]["rounds"],
                   "eagle3kit_ab_rounds_detail": res["eagle3kit-ab"], "compute_ab_rounds_detail": res["compute-ab"]}
                  if ab else {}),
               "eagle3kit_rounds_detail": res["eagle3kit"], "speculators_rounds_detail": res["speculators"],
               "settings": {"data": str(a.data), "device": a.device, "steps": a.steps, "warmup_steps": a.warmup,
                            "tokens_per_batch": a.tokens_per_batch, "workers": a.workers,
                            "max_minutes": a.max_minutes, "speculators_export_s": spec_export,
                            "train_config": {k: v for k, v in vars(cfg).items() if k not in ("data", "out_dir")},
                            "speculators": {"optimizer": "adamw", "loss": "kl_div", "fused_loss_error": fused_error,
                                            "cpu_patches": not a.device.startswith("cuda")},
                            "tokens_counted": "aligned positions (sample length - 1), loss-masked or not, no padding"}}
    if errors:
        metrics["speculators_error"] = errors[0]
    if train_errors:
        metrics["train_error"] = train_errors[0]
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    (out / "bench.log").write_text("\n".join(lines) + "\n")
    return 0 if e3k["median"] or (comp["median"] and "eagle3kit" not in passes) else 1


if __name__ == "__main__":
    sys.exit(main())
