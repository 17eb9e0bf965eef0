"""``eagle3kit train``: an EAGLE-3 drafter from a captured data set, checkpointed, resumable, evaluated held out.

<out_dir>/
  train.json            the settings (a resume with other settings is refused)
  vocab.pt              the draft vocabulary (ids) and the loss-token frequencies it was chosen from
  checkpoints/last.pt   trainable weights, optimizer, schedule, RNG, data position: an exact resume point
  best/                 SGLang export (LlamaForCausalLMEagle3) of the checkpoint with the best validation tau
                        (``val_percent`` of the train split, never trained on); the held-out split is only reported
  final/                SGLang export at the end
  evals.jsonl           one line per evaluation: per-position acc / cond. acc / loss, tau(n), on the validation
                        samples (val_*, the choice) and the held-out split (heldout_*, the report)
  train_log.jsonl       one line per optimizer step: loss and accuracy per TTT position, lr, tokens/s
  metrics.json          the summary (flat): train_tokens_per_s, train_acc_pos0 (held out), offline_tau, ...

Data parallel: run under ``torchrun --nproc-per-node N`` (nccl on GPUs, gloo on CPUs); rank r takes batches
j % N == r, so N ranks with ``grad_accum`` a see the same global batches as one rank with ``grad_accum`` N * a
(an optimizer step takes N * a * ``rows_per_batch`` packed rows).
"""
from __future__ import annotations

import contextlib
import json
import math
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch

from eagle3kit.drafter import data as D
from eagle3kit.drafter.checkpoint import atomic_save, load_checkpoint, rng_state, set_rng
from eagle3kit.drafter.export import to_sglang
from eagle3kit.drafter.objective import (ChainCounts, TeacherTokens, chain_count_tensor, known_greedy_tokens,
                                         serving_walk,
                                         step_loss, teacher, valid_rows)
from eagle3kit.drafter.train_config import TrainConfig, TrainError
from eagle3kit.drafter.training_setup import Dist, Run, _autocast, _device, setup
from eagle3kit.store import cut_torn_tail

# settings that may differ on a resume (out_dir: a run folder moved or renamed resumes)
RESUMABLE_CHANGES = {"progress", "workers", "save_every", "device", "attention", "eval_every", "max_minutes", "out_dir",
                     "compile_layers"}


def disk_full(err: BaseException, folder: Path) -> bool:
    """Whether ``err`` (torch's, safetensors' or the OS's: each says it its own way, torch's "unexpected pos 64 vs
    0" among them) came from a full disk under ``folder``: ENOSPC in the error or its causes, or under 1 MiB left."""
    import errno
    import shutil

    e = err
    while e is not None:
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    try:
        probe = next(p for p in [folder, *folder.parents] if p.exists())
        return shutil.disk_usage(probe).free < (1 << 20)
    except (OSError, StopIteration):
        return False


def _to(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def forward_batch(run: Run, module, batch: dict, steps: int, with_loss: bool = True, walk: torch.Tensor | None = None,
                  teacher_token: torch.Tensor | None = None, cache: TeacherTokens | None = None):
    """TTT forward of one packed batch: (weighted loss, counts in ``ChainCounts.as_tensor`` layout on the device).
    Nothing here waits for the GPU: counts are summed on the device and read once per optimizer step. ``walk``
    (evaluation only: it reads the rows on the host): ``serving_walk``'s tokens and rounds are added to it.
    ``teacher_token``: the target's greedy tokens of these rows when known (``objective.teacher``); ``cache``: where
    a batch's tokens are looked up by sample and kept (training: the same rows, bit for bit, in a later epoch, a
    resumed run or a run without the cache: the draft vocabulary's log-probabilities are computed alike in each)."""
    cfg = run.cfg
    b = _to(batch, run.device)
    if teacher_token is None and cache is not None:
        teacher_token = cache.lookup(batch, run.device)
        if teacher_token is None:  # on a CPU also remembered across trainings in this process
            teacher_token = known_greedy_tokens(run.head, b["final"])
            cache.store(batch, teacher_token)
    t = teacher(run.head, b["final"], run.vocab_ids, run.t2d_index, token=teacher_token)
    rows = max(1, b["input_ids"].shape[0] // cfg.tokens_per_batch)  # data.collate_rows: rows of tokens_per_batch
    with _autocast(run.device):
        step_logits = module(b["aux"], b["input_ids"], b["doc_ids"], b["position_ids"], steps, rows,
                             cfg.tokens_per_batch)
    losses, total = [], None
    for k, logits in enumerate(step_logits):
        lk, n = step_loss(logits, t, valid_rows(b["loss_mask"], b["doc_ids"], k), k, cfg.loss)
        losses.append((lk.detach(), n))
        if with_loss:
            term = lk * (cfg.step_decay ** k)
            total = term if total is None else total + term
    with torch.no_grad():
        counts = chain_count_tensor([x.detach() for x in step_logits], t, b["loss_mask"], b["doc_ids"], b["input_ids"],
                                    run.vocab_ids, run.most_frequent, losses)
        if walk is not None:
            walk += serving_walk(step_logits, t, b["loss_mask"], b["doc_ids"], run.vocab_ids)
    return total, counts


@torch.no_grad()
def evaluate(run: Run, steps: int | None = None, source=None, max_batches: int | None = None,
             walk: torch.Tensor | None = None) -> ChainCounts:
    """Chained acceptance over a held-out source (every rank its share; counts summed over ranks); ``walk``: a
    [steps, 2] tensor that also sums ``serving_walk`` (this rank's rows)."""
    source = source if source is not None else run.heldout_src
    steps = steps or run.cfg.eval_depth
    if source is None:
        return ChainCounts(steps)
    from eagle3kit.drafter.ttt import TTTModule

    module = TTTModule(run.model)
    was = run.model.training
    run.model.eval()
    batches = D.plan([source.length(i) for i in range(len(source))], run.cfg.tokens_per_batch, None)
    if max_batches:
        batches = batches[:max_batches]
    total = torch.zeros(6 * steps + 2, dtype=torch.float64, device=run.device)
    # the target's greedy tokens of each batch (8 bytes a row), kept on the source from its first evaluation with
    # this head: the batches are the same each time (the plan has no seed), so later evaluations compute only the
    # draft vocabulary's columns of the head, and the full head runs once per batch
    known = source.__dict__.setdefault("_eval_teacher_tokens", {}).setdefault(
        (run.head, run.dist.rank, run.dist.world, run.cfg.tokens_per_batch, run.cfg.rows_per_batch), {})
    for j, (_, batch, _) in enumerate(D.loader(source, batches, run.info.n_states, run.info.hidden_size,
                                               run.cfg.tokens_per_batch, rank=run.dist.rank, world=run.dist.world,
                                               workers=0, rows=run.cfg.rows_per_batch)):
        if batch is not None:
            if j not in known:
                known[j] = known_greedy_tokens(run.head, batch["final"].to(run.device))
            total += forward_batch(run, module, batch, steps, with_loss=False, walk=walk, teacher_token=known[j])[1]
    run.model.train(was)
    total = run.dist.all_sum(total).cpu()
    return ChainCounts.from_tensor(steps, total)


# train()'s clock (seconds, monotonic): max_minutes, fit_schedule's pace and every timing in the log and summary read
# it, so a test can run a budget on a clock it advances instead of sleeping through it
_now = time.perf_counter

FIT_AFTER = 20  # fit_schedule: optimizer steps timed before the plan is cut to the budget (after the first step,
# whose compile of the flex attention kernel (tens of seconds on a GPU) is not the pace)


def _schedule(cfg: TrainConfig, state: dict):
    """Linear warmup over warmup_ratio of the plan, then cosine to min_lr_ratio at ``state["total_steps"]``, read at
    every step: fit_schedule shortens the plan after 20 steps and again if the pace slows (the state is checkpointed,
    so a resume agrees)."""

    def factor(step: int) -> float:
        total = state["total_steps"]
        warmup = max(1, math.ceil(cfg.warmup_ratio * total)) if cfg.warmup_ratio > 0 else 0
        if step < warmup:
            return (step + 1) / warmup
        # min_lr_ratio at the last step (total - 1), also when the warmup leaves that step alone after it
        p = 1.0 if total - 1 <= warmup else min(1.0, (step - warmup) / (total - 1 - warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))
    return factor


def _replan(sched, state: dict, total: int) -> None:
    """A new planned total (fit_schedule): the lr of the coming step is recomputed from it. The scheduler computed
    that lr when it stepped, from the old total: a refit that made the coming step the last left it far above
    min_lr (6.5e-4 against 5e-5, a loaded CPU test run, 2026-12-04)."""
    state["total_steps"] = total
    sched.last_epoch -= 1
    sched.step()  # LambdaLR: lr = base x factor(last_epoch), factor reading state["total_steps"]


def _eval_due(cfg: TrainConfig, step: int, steps_per_epoch: int, total_steps: int) -> bool:
    """Is an evaluation due after optimizer step ``step`` (every eval_every steps, else each epoch's end; the last)?"""
    if cfg.eval_every:
        return step % cfg.eval_every == 0 or step == total_steps
    return step % steps_per_epoch == 0 or step == total_steps


def _fitted_steps(cfg: TrainConfig, state: dict, seconds_so_far: float, pace: float, eval_seconds: float,
                  steps_per_epoch: int) -> int:
    """The planned total cut to what fits in max_minutes at ``pace`` (seconds per step; never longer than planned)."""
    pace = max(pace, 1e-9)
    left = 60 * cfg.max_minutes * 0.95 - seconds_so_far
    more = max(0, int(left / pace))
    evals = 1 + (more // cfg.eval_every if cfg.eval_every else more // max(steps_per_epoch, 1))
    more = max(0, int((left - evals * eval_seconds) / pace))
    return max(state["step"] + 1, min(state["total_steps"], state["step"] + more))


def _settings(cfg: TrainConfig) -> dict:
    return {k: v for k, v in asdict(cfg).items() if k not in RESUMABLE_CHANGES}


def _check_resume(out: Path, cfg: TrainConfig) -> None:
    path = out / "train.json"
    if path.exists():
        old = json.loads(path.read_text())
        diff = {k: (old.get(k), v) for k, v in _settings(cfg).items() if old.get(k) != v}
        if diff:
            raise TrainError(f"{out} holds a run with other settings {diff} (old, new). Fix: resume with the same "
                             f"settings, or choose a new out_dir; nothing in {out} was changed")


def train(cfg: TrainConfig, dist: Dist | None = None) -> dict:
    """Train (or resume) and return the summary written to ``<out_dir>/metrics.json``."""
    t_call = _now()
    # where this invocation's time went besides the steps: evaluations (with the best checkpoint's export), the final
    # export, checkpoints
    spent = {"eval": 0.0, "export": 0.0, "save": 0.0}
    cfg.validate()
    dist = dist or Dist.from_env()
    out = Path(cfg.out_dir)
    if out.exists() and not out.is_dir():
        raise TrainError(f"out_dir {out} is a file; give a folder (it is created if missing)")
    _check_resume(out, cfg)
    if dist.world > 1:
        import torch.distributed as tdist

        if not tdist.is_initialized():
            nccl = torch.cuda.is_available() and cfg.device != "cpu"
            if nccl:  # this rank's own GPU before anything touches CUDA (else every rank opens a context on GPU 0)
                torch.cuda.set_device(_device(cfg, dist))
            tdist.init_process_group("nccl" if nccl else "gloo")
    with _exclusive_out_dir(out, dist), contextlib.ExitStack() as closing:
        try:
            return _train(cfg, dist, out, t_call, spent, closing)
        except TrainError:
            raise
        except Exception as e:  # noqa: BLE001 - a full disk, whichever library's write found it
            if not disk_full(e, out):
                raise
            ckpt = out / "checkpoints" / "last.pt"
            raise TrainError(f"out_dir {out}: the disk is full ({type(e).__name__} while writing). "
                             + (f"The last checkpoint ({ckpt}) is kept; " if ckpt.exists() else "No checkpoint was "
                                "written yet; ")
                             + "free space there and rerun the same command: it resumes") from None


@contextlib.contextmanager
def _exclusive_out_dir(out: Path, dist: Dist):
    """Rank 0 holds ``<out_dir>/.lock`` for the whole training (``pipeline.exclusive``): a second training into the
    folder is refused on every rank, naming the holder, before it reads or writes a checkpoint. Two at once would
    interleave their checkpoints and logs: seen when torchrun was SIGKILLed and its workers (each in a session of its
    own) trained on as orphans while the run was resumed, which then failed renaming a checkpoint the orphan had
    just renamed."""
    from eagle3kit.pipeline import exclusive

    with contextlib.ExitStack() as stack:
        why = None
        if dist.rank == 0:
            try:
                stack.enter_context(exclusive(out, "training"))
            except ValueError as e:
                why = str(e)
        refused = why is not None
        if dist.world > 1:  # every rank learns rank 0's verdict (else the others would wait in a collective)
            refused = bool(dist.all_sum(torch.tensor([int(refused)], device=_dist_device(dist))).item())
        if refused:
            raise TrainError(why or f"out_dir {out}: rank 0 found another training writing there; wait for it to "
                                    f"finish, or choose another out_dir")
        yield


def _dist_device(dist: Dist) -> torch.device:
    import torch.distributed as tdist

    return torch.device("cuda", dist.local_rank) if tdist.get_backend() == "nccl" else torch.device("cpu")


def _train(cfg: TrainConfig, dist: Dist, out: Path, t_call: float, spent: dict,
           closing: contextlib.ExitStack) -> dict:
    from eagle3kit.drafter.model import trainable_state
    from eagle3kit.drafter.ttt import TTTModule

    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    run = setup(cfg, dist, closing, clock=_now)
    live = getattr(run.train_src, "stream", None)  # the live stream's producer (closed by ``closing``)
    lengths = [run.train_src.length(i) for i in range(len(run.train_src))]
    per_step = dist.world * cfg.grad_accum * cfg.rows_per_batch  # packed rows per optimizer step
    steps_per_epoch = len(D.plan(lengths, cfg.tokens_per_batch, cfg.seed, 0)) // per_step
    if steps_per_epoch == 0:
        raise TrainError(f"{len(lengths)} training samples make fewer packed batches than one optimizer step needs "
                         f"({per_step}): lower tokens_per_batch, rows_per_batch or grad_accum, or extract more samples")
    total_steps = cfg.max_steps or steps_per_epoch * cfg.epochs
    params = [p for p in run.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    module = TTTModule(run.model)
    if dist.world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        module = DDP(module, device_ids=[run.device.index] if run.device.type == "cuda" else None)
    state = {"step": 0, "tokens": 0, "train_seconds": 0.0, "best_tau": -1.0, "best": {}, "skipped": 0,
             "total_steps": total_steps, "planned_steps": total_steps, "rows_per_step": per_step}
    ckpt = out / "checkpoints" / "last.pt"
    saved = load_checkpoint(ckpt) if ckpt.exists() else None
    if saved and saved["state"].get("rows_per_step", per_step) != per_step:  # the data position is step x rows
        old = saved["state"]["rows_per_step"]
        raise TrainError(f"{ckpt} was written with {old} packed rows per optimizer step (ranks x grad_accum x "
                         f"rows_per_batch), this run takes {per_step} ({dist.world} ranks x {cfg.grad_accum} x "
                         f"{cfg.rows_per_batch}): resumed, it would read batches again or skip them. Fix: resume with "
                         f"as many ranks (or a grad_accum that gives {old} rows a step), or choose a new out_dir")
    if saved:
        state.update(saved["state"])  # the plan as it was (fit_schedule may have cut it)
        state.pop("stopped_early", None)  # a run stopped by max_minutes goes on when resumed
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(cfg, state))
    if saved:
        run.model.load_state_dict(saved["model"], strict=False)
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        set_rng(saved["rng"], run.device)
        print(f"[train] resumed from {ckpt} at step {state['step']} of {state['total_steps']}", flush=True)
    total_steps = state["total_steps"]
    eval_steps = cfg.eval_depth
    if dist.rank == 0 and not (out / "train.json").exists():  # a resume found the same settings there; written once
        # every check has passed, so a refused run never locks its settings against the corrected command
        out.mkdir(parents=True, exist_ok=True)
        (out / "train.json").write_text(json.dumps(_settings(cfg), indent=1, sort_keys=True))
    bar = None
    if cfg.progress and dist.rank == 0:
        from eagle3kit.metrics import progress_bar

        bar = progress_bar(total=total_steps, initial=state["step"], unit="step", desc="train", smoothing=0.05)

    def save():
        if dist.rank != 0:
            return
        t0 = _now()
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        atomic_save({"model": trainable_state(run.model), "optimizer": opt.state_dict(),
                      "scheduler": sched.state_dict(), "rng": rng_state(run.device), "state": state}, ckpt)
        spent["save"] += _now() - t0
        last["save"] = _now() - t0

    if dist.rank == 0:  # a killed run's torn last line would join the resumed run's first row
        for name in ("train_log.jsonl", "evals.jsonl"):
            cut_torn_tail(out / name)

    def log(name, row):
        if dist.rank == 0:
            with open(out / name, "a") as f:
                f.write(json.dumps(row) + "\n")

    def do_eval():
        t0 = _now()
        counts = evaluate(run, eval_steps)
        m = counts.metrics("heldout_")
        chosen_by = evaluate(run, eval_steps, source=run.val_src) if run.val_src is not None else None
        row = {"step": state["step"], "tokens": state["tokens"], **m,
               **(chosen_by.metrics("val_") if chosen_by is not None else {})}
        log("evals.jsonl", row)
        # the choice is the validation samples' (never the held-out split's, which only reports); none to judge by
        # (val_percent 0, no rows): best/ is the latest drafter; never the untrained one (step 0 is measured, not
        # exported: a run stopped before its first trained evaluation has no best/ at all)
        tau = row[f"val_tau_{cfg.serving_steps}"] if chosen_by is not None and chosen_by.valid[0] else None
        if state["step"] > 0 and (tau is None or tau > state["best_tau"]) and dist.rank == 0:
            state["best_tau"] = state["best_tau"] if tau is None else tau
            state["best"] = row
            t_export = _now()
            export(run, out / "best", extra={"step": state["step"], "heldout": m})
            last["export"] = _now() - t_export  # the final export takes as long
        spent["eval"] += _now() - t0
        last["eval"] = _now() - t0
        return m

    def epoch_rows(epoch, in_epoch):
        """The epoch's packed rows that the steps left read (a plan ends mid-epoch at max_steps; a fitted plan only
        gets shorter): the loader prefetches no more, and the stream captures no sample that no step would train on."""
        batches = D.epoch_plan(lengths, cfg.tokens_per_batch, cfg.seed, epoch, steps_per_epoch * per_step)
        return batches[:min(len(batches), (in_epoch + total_steps - state["step"]) * per_step)]

    def schedule_live(epoch, in_epoch, batches):
        """What this rank reads this epoch, in order: the stream captures it ahead."""
        run.train_src.schedule(epoch, [i for j in range(in_epoch * per_step, len(batches))
                                       if j % dist.world == dist.rank for i in batches[j]])

    scheduled = None  # (epoch, in_epoch) handed to the stream before the loop
    if live is not None and state["step"] < total_steps:
        # the stream starts capturing the first rows now, while the untrained drafter is evaluated, instead of at the
        # first step: its bound fills before the first step asks
        scheduled = divmod(state["step"], steps_per_epoch)
        schedule_live(*scheduled, epoch_rows(*scheduled))
    setup_seconds = _now() - t_call
    last = {"eval": 0.0, "save": 0.0, "export": 0.0}  # the latest of each: what the budget keeps back for the stop
    if state["step"] == 0 and not ckpt.exists():
        state["initial"] = do_eval()  # the untrained drafter: what "held-out loss fell" is measured against
        state["eval_seconds"] = spent["eval"]  # fit_schedule's cost of one evaluation, kept for a resume
    eval_seconds = state.get("eval_seconds", spent["eval"])
    run.model.train()
    fit_from = state["step"] + 1 if cfg.fit_schedule and not state.get("fitted") else None  # pace timed from here
    fit_at, t_fit = (fit_from + FIT_AFTER if fit_from is not None else None), None
    # fitted again a third of the way through the plan, or sooner when a third of the time left has passed (a pace
    # that more than triples would otherwise reach the budget before the step count does)
    refit_at = t_refit = eval_at_fit = last_fit = refit_after_s = None
    while state["step"] < total_steps and not state.get("stopped_early"):
        epoch, in_epoch = divmod(state["step"], steps_per_epoch)
        batches = epoch_rows(epoch, in_epoch)
        if live is not None and (epoch, in_epoch) != scheduled:  # the first epoch was handed over before the loop
            schedule_live(epoch, in_epoch, batches)
        scheduled = None
        it = iter(D.loader(run.train_src, batches, run.info.n_states, run.info.hidden_size, cfg.tokens_per_batch,
                           start=in_epoch * per_step, rank=dist.rank, world=dist.world, workers=cfg.workers,
                           pin=run.device.type == "cuda", rows=cfg.rows_per_batch))
        for _ in range(in_epoch, steps_per_epoch):
            if state["step"] >= total_steps:
                break
            t0 = _now()
            counts = torch.zeros(6 * cfg.ttt_steps + 2, dtype=torch.float64, device=run.device)
            rows, waited = 0, 0.0
            for micro in range(cfg.grad_accum):
                tw = _now()
                _, batch, skipped = next(it)
                waited += _now() - tw
                state["skipped"] += len(skipped)
                for s in skipped[:3]:
                    print(f"[train] skipped {s}", flush=True)
                if batch is None:
                    batch = _empty_batch(run)
                sync = dist.world == 1 or micro == cfg.grad_accum - 1
                ctx = module.no_sync() if not sync and hasattr(module, "no_sync") else contextlib.nullcontext()
                with ctx:
                    loss, c = forward_batch(run, module, batch, cfg.ttt_steps, cache=run.teacher_tokens)
                    (loss / cfg.grad_accum).backward()
                counts += c
                rows += D.real_rows(batch)
            gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip or float("inf"))  # 0: the norm, unclipped
            lr = sched.get_last_lr()[0]  # the one this step uses
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if run.device.type == "cuda":
                torch.cuda.synchronize(run.device)
            dt = _now() - t0
            overdue = refit_at is not None and _now() - t_refit > refit_after_s
            # the budget counts from the call (setup included) and keeps back what must still run: the next step,
            # an evaluation due now, and the stop's own evaluation, save and export, each as long as the last one
            due = _eval_due(cfg, state["step"] + 1, steps_per_epoch, total_steps)
            out_of_time = bool(cfg.max_minutes) and _now() - t_call + dt + last["eval"] * (1 + due) + last["save"] \
                + last["export"] > 60 * cfg.max_minutes
            if dist.world > 1:  # every rank decides at the same step, whichever rank's clock called it: the flags
                # travel with the row counts (a rank that looked or stopped alone would enter a collective the
                # others do not: a hang)
                rows, overdue, out_of_time = (int(x) for x in dist.all_sum(
                    torch.tensor([rows, int(overdue), int(out_of_time)], device=run.device)))
            overdue, out_of_time = bool(overdue), bool(out_of_time)
            state["step"] += 1
            state["tokens"] += rows
            state["train_seconds"] += dt
            state["data_wait_seconds"] = state.get("data_wait_seconds", 0.0) + waited
            state["waited_steps"] = state.get("waited_steps", 0) + (waited > WAITED_S)
            m = ChainCounts.from_tensor(cfg.ttt_steps, counts.cpu()).metrics()
            row = {"step": state["step"], "epoch": epoch, "lr": lr, "grad_norm": float(gnorm),
                   "tokens_per_s": rows / dt if dt else 0.0, "seconds": dt, "data_wait_s": waited,
                   **{k: v for k, v in m.items() if k.startswith(("loss_pos", "acc_pos", "cond_acc_pos"))}}
            log("train_log.jsonl", row)
            if bar is not None:
                bar.set_postfix(loss=f"{m.get('loss_pos0', 0):.3f}", acc0=f"{m['acc_pos0']:.3f}",
                                tok_s=f"{state['tokens'] / max(state['train_seconds'], 1e-9):,.0f}",
                                **_stream_postfix(live, state), refresh=False)
                bar.update(1)
            if state["step"] == fit_from:
                t_fit = _now()
            look = refit_at is not None and (state["step"] == refit_at or overdue)  # the same step on every rank
            if state["step"] == fit_at:
                fitted = _fitted_steps(cfg, state, _now() - t_call, (_now() - t_fit) / FIT_AFTER,
                                       eval_seconds, steps_per_epoch)
                dist_fitted = int(dist.all_min(torch.tensor([fitted], device=run.device)).item())  # in time on
                # every rank's clock
                _replan(sched, state, dist_fitted)
                state["fitted"], total_steps = True, dist_fitted
                print(f"[train] fit_schedule: {total_steps} of {state['planned_steps']} planned steps fit in "
                      f"max_minutes={cfg.max_minutes}", flush=True)
            elif look:
                # a pace that changed after the first 20 steps (another process on the machine, a later stretch of
                # the data: 0.22 s a step, then 0.34 s, seen in a CPU test run) would end the run before the cosine
                # does; the pace since the last fit, evaluations left out (counted apart), can only shorten the plan
                pace = (_now() - t_refit - (spent["eval"] - eval_at_fit)) / (state["step"] - last_fit)
                refit = min(total_steps, _fitted_steps(cfg, state, _now() - t_call, pace, eval_seconds,
                                                       steps_per_epoch))
                refit = int(dist.all_min(torch.tensor([refit], device=run.device)).item())
                if refit < total_steps:
                    print(f"[train] fit_schedule: the pace changed; {refit} steps fit instead of {total_steps}",
                          flush=True)
                    _replan(sched, state, refit)
                    total_steps = refit
            if state["step"] == fit_at or look:
                refit_at = None  # the next check a third of the way through what is left, in steps or in time
                if total_steps - state["step"] >= 2 * FIT_AFTER:
                    refit_at = state["step"] + (total_steps - state["step"]) // 3
                    t_refit, eval_at_fit, last_fit = _now(), spent["eval"], state["step"]
                    refit_after_s = (60 * cfg.max_minutes * 0.95 - (t_refit - t_call)) / 3
                if bar is not None:
                    bar.total = total_steps
                    bar.refresh()
            if _eval_due(cfg, state["step"], steps_per_epoch, total_steps):
                do_eval()
            if out_of_time and state["step"] < total_steps:  # the budget, as of this step's end (before its eval)
                state["stopped_early"] = True
                print(f"[train] max_minutes={cfg.max_minutes} reached at step {state['step']} of {total_steps}",
                      flush=True)
                do_eval()
                save()
                break
            if state["step"] % cfg.save_every == 0 or state["step"] == total_steps:
                save()
    if bar is not None:
        bar.close()
    if dist.rank == 0:
        t0 = _now()
        export(run, out / "final", extra={"step": state["step"]})
        spent["export"] += _now() - t0
    summary = _summary(run, state, lengths)
    if live is not None:
        summary.update(_live_summary(run, state, out, live.close(state["step"] % steps_per_epoch == 0)))
    # this invocation's wall time, and what took it besides the optimizer steps (train_seconds, all invocations)
    summary.update(train_wall_seconds=_now() - t_call, train_setup_seconds=setup_seconds,
                   **{f"train_{k}_seconds": v for k, v in spent.items()})
    if dist.rank == 0:
        (out / "metrics.json").write_text(json.dumps(summary, indent=1, sort_keys=True))
    return summary


WAITED_S = 0.005  # a step whose loader wait exceeded this waited on its data (the live stream's wait share)


def _stream_postfix(live, state: dict) -> dict:
    """The progress line's stream fields: samples in flight at the servers, buffered for the trainer, and the share
    of steps that waited on data."""
    if live is None:
        return {}
    p = live.progress()
    return {"inflight": p["in_flight"], "buffered": p["buffered"],
            "wait": f"{state.get('waited_steps', 0) / max(state['step'], 1):.0%}"}


def _live_summary(run: Run, state: dict, out: Path, stream: dict) -> dict:
    from eagle3kit.live.session import disk_bytes_of_states

    return {**run.extra.get("live", {}), **stream,
            "live_wait_share": state.get("waited_steps", 0) / max(state["step"], 1),
            "live_hidden_state_bytes_on_disk": disk_bytes_of_states(out)}


def _empty_batch(run: Run) -> dict:
    """One row that no loss or count sees (all samples of a batch were skipped): keeps DDP ranks in step."""
    n, h = run.info.n_states, run.info.hidden_size
    return {"aux": torch.zeros(1, (n - 1) * h), "final": torch.zeros(1, h), "input_ids": torch.zeros(1, dtype=torch.int64),
            "loss_mask": torch.zeros(1, dtype=torch.int64), "doc_ids": torch.zeros(1, dtype=torch.int64),
            "position_ids": torch.ones(1, dtype=torch.int64), "sample_ids": torch.full((1,), -1, dtype=torch.int64)}


def export(run: Run, dest: Path, extra: dict | None = None) -> Path:
    return to_sglang(run.model, run.vocab, dest, run.target, run.extra["aux_layer_ids"],
                     provenance={"data": str(run.cfg.data), "train": asdict(run.cfg),
                                 "most_frequent_token": run.most_frequent, **(extra or {})},
                     final_pre_norm=run.info.final_pre_norm is not False,
                     teacher_exact=run.info.final_pre_norm is not False or run.head.final_normed)


def _summary(run: Run, state: dict, lengths: list[int]) -> dict:
    cfg = run.cfg
    best = state.get("best") or {}
    s = {"train_samples": len(lengths), "train_tokens": int(sum(lengths)), "train_tokens_seen": state["tokens"],
         "train_steps": state["step"], "train_seconds": state["train_seconds"],
         "train_tokens_per_s": state["tokens"] / state["train_seconds"] if state["train_seconds"] else 0.0,
         "train_samples_skipped": state["skipped"],
         "train_data_wait_fraction": state.get("data_wait_seconds", 0.0) / state["train_seconds"]
         if state["train_seconds"] else 0.0, "train_ttt_steps": cfg.ttt_steps, "train_loss": cfg.loss,
         "train_lm_head": cfg.lm_head, "train_step_decay": cfg.step_decay, "draft_vocab_size": run.vocab.size,
         "draft_vocab_coverage": run.vocab.coverage(run.freq), "heldout_samples": len(run.heldout_src or []),
         "val_samples": len(run.val_src or []),
         "train_best_chosen_by": "validation" if best.get(f"val_tau_{cfg.serving_steps}") is not None else "latest",
         "best_step": best.get("step", 0), "train_total_steps_planned": state.get("planned_steps", 0),
         "train_total_steps_fitted": state.get("total_steps", 0) if state.get("fitted") else 0,
         "train_stopped_early": bool(state.get("stopped_early")), "train_attention": run.extra.get("attention"),
         "train_compiled_layers": bool(run.extra.get("compiled")),
         "train_setup_compile_seconds": run.extra.get("compile_seconds", 0.0)}
    for k, v in best.items():
        if k.startswith(("heldout_", "val_tau_")):
            s[k] = v
    init = state.get("initial") or {}
    if "heldout_loss_pos0" in init:
        s["initial_heldout_loss_pos0"] = init["heldout_loss_pos0"]
        s["initial_heldout_acc_pos0"] = init["heldout_acc_pos0"]
    if best:
        s["train_acc_pos0"] = best.get("heldout_acc_pos0", 0.0)
        s["baseline_acc_pos0"] = best.get("heldout_baseline_acc_pos0", 0.0)
        s["offline_tau"] = best.get(f"heldout_tau_{cfg.serving_steps}", 0.0)
    return s
