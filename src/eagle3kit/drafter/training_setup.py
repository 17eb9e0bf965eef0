"""What a training needs before its first step (``setup``): the data sources (files, or the live stream), the target's
head, the draft vocabulary, the drafter on its device, its attention path and compiled layers, checked against each
other; ``Dist``, the torchrun world it runs in; ``Run``, what the training loop (``drafter.train``) and the offline
evaluation read."""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle3kit.drafter import data as D
from eagle3kit.drafter import vocab as V
from eagle3kit.drafter.checkpoint import atomic_save
from eagle3kit.drafter.objective import TeacherTokens
from eagle3kit.drafter.train_config import TrainConfig, TrainError

COMPILE_BACKEND = "inductor"  # of compile_layers (tests on a CPU use "aot_eager": the same graphs, no code generation)


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> "Dist":
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                   int(os.environ.get("LOCAL_RANK", 0)))

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(t, "SUM")

    def all_min(self, t: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(t, "MIN")

    def _all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        return t


@dataclass
class Run:
    """Everything train() sets up: data, model, teacher, optimizer (a notebook can reuse it for evaluation)."""
    cfg: TrainConfig
    dist: Dist
    device: torch.device
    train_src: object
    heldout_src: object | None
    info: D.SourceInfo
    target: Path
    vocab: V.DraftVocab
    freq: torch.Tensor
    model: torch.nn.Module
    head: torch.nn.Module
    t2d_index: torch.Tensor
    vocab_ids: torch.Tensor
    most_frequent: int
    extra: dict = field(default_factory=dict)
    val_src: object | None = None  # the train split's validation samples (val_percent): the checkpoint choice
    teacher_tokens: TeacherTokens | None = None  # training batches' greedy tokens by sample (teacher_cache_gb)


def _device(cfg: TrainConfig, dist: Dist) -> torch.device:
    """Where this rank trains: under torchrun each rank on its own GPU (``cuda:<local rank>``) for ``auto`` and for
    ``cuda`` alike; one GPU index for every rank would put them all on that GPU, which NCCL refuses ("Duplicate GPU")."""
    if cfg.device == "auto":
        return torch.device(f"cuda:{dist.local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(cfg.device)
    if dev.type == "cuda" and dist.world > 1:
        if dev.index is not None:
            raise TrainError(f"device={cfg.device} under torchrun with {dist.world} ranks: every rank would train on "
                             f"GPU {dev.index}. Fix: device=cuda or auto (each rank on its own GPU, cuda:<local rank>)")
        dev = torch.device("cuda", dist.local_rank)
    return dev


def _resolve_target(cfg: TrainConfig, info: D.SourceInfo) -> Path:
    from eagle3kit.target import resolve_target

    t = cfg.target or info.target
    if not t:
        raise TrainError(f"{cfg.data} does not say which target it was captured from: pass target=<model dir>")
    return resolve_target(t)


def _aux_ids(cfg: TrainConfig, info: D.SourceInfo, num_layers: int) -> list[int]:
    recorded = info.layer_ids[:-1] if info.layer_ids else None
    if recorded and info.layer_ids[-1] != num_layers:
        raise TrainError(f"{cfg.data}: its last slot is layer id {info.layer_ids[-1]}, not the final state "
                         f"({num_layers}): the drafter's teacher needs the last layer's output before the norm")
    if cfg.aux_layer_ids and recorded and list(cfg.aux_layer_ids) != recorded:
        raise TrainError(f"aux_layer_ids {cfg.aux_layer_ids} differ from the data set's {recorded}: the states are "
                         f"what they are; leave aux_layer_ids unset")
    ids = recorded or cfg.aux_layer_ids
    if not ids:
        raise TrainError(f"{cfg.data} does not record its layer ids: pass aux_layer_ids (input_of_layer)")
    if info.n_states and len(ids) + 1 != info.n_states:
        raise TrainError(f"{len(ids)} aux layer ids but the samples hold {info.n_states} states (aux + final)")
    return list(ids)


def _check_final_slot(cfg: TrainConfig, source, head) -> bool:
    """Whether the teacher takes the last slot as it is (True) or applies the target's final norm to it (False).
    A slot recorded post-norm (``final_slot: post_norm``, a capture inside SGLang's prefill graph) that is post-norm by
    value is the norm's output: taken as it is. A slot post-norm by value but not recorded so (another engine's
    states) is refused: normed again, the teacher would learn from a twice-normed state. ``allow_post_norm_final``
    reproduces that mistake on purpose (the acceptance experiment): the norm is applied whatever the slot holds."""
    from eagle3kit import doctor

    verdict, share = doctor.final_slot(source, head.norm_weight)
    if cfg.allow_post_norm_final:
        return False
    if verdict == doctor.RECORD_CONTRADICTED:
        raise TrainError(f"{cfg.data}: recorded final_slot post_norm, but only {share:.0%} of probed tokens have "
                         f"RMS(state / norm weight) = 1: these are not the target's final norm outputs (another "
                         f"target, or a wrong record). Fix: train with the target the data was captured from")
    if verdict == doctor.POST_NORM_UNRECORDED:
        raise TrainError(f"{cfg.data}: the last slot holds the final norm's output (post-norm: "
                         f"{share:.0%} of probed tokens have RMS(state / norm weight) = 1), but the data set does not "
                         f"record it (final_slot), so the teacher would apply the norm again and learn from logits of "
                         f"a twice-normed state. Fix: capture with eagle3kit (its final slot is the last layer's output "
                         f"before the norm, or recorded post_norm under --prefill-graph)")
    return verdict == doctor.POST_NORM_RECORDED


def count_frequencies(source, vocab_size: int) -> torch.Tensor:
    freq = torch.zeros(vocab_size, dtype=torch.int64)
    for i in range(len(source)):
        try:
            ids, mask = source.tokens(i)
        except D.SampleError:  # unreadable: the loader skips and counts it when training reaches it
            continue
        V.count_tokens(ids, mask, vocab_size, freq)
    return freq


def no_cudnn_sdpa(device) -> None:
    """On a GPU, SDPA without cuDNN: cuDNN's SDPA builds a plan for every new shape (~1 s), and packed batches all
    differ in length (each TTT step's keys too), so it rebuilt them at every step: 6.5 K tokens/s against 87 K
    without (gpu-drafter-pipeline-2/trainbench). Training and the offline evaluation of an export both call it."""
    if torch.device(device).type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def _heldout_source(path):
    """An explicit held-out set: an eagle3kit data set's held-out split (its train split would be scored as held
    out: the natural case is training from a speculators export of the same data set), or every sample of one
    extracted without a held-out split, said in the log; a speculators export whole."""
    src = D.open_source(path, "heldout")
    if isinstance(src, D.CaptureSource) and len(src) == 0:
        src = D.open_source(path, None)
        print(f"[train] heldout={path} has no held-out split: all its {len(src)} samples are held out", flush=True)
    return src


def setup(cfg: TrainConfig, dist: Dist | None = None, closing: contextlib.ExitStack | None = None,
          clock=time.perf_counter) -> Run:
    """``closing``: where a live stream's close is registered (its servers stop whatever happens next); ``clock``:
    what times the compile (the training's own clock, so that a budget and its parts read one clock)."""
    from eagle3kit.drafter.model import TargetHead, build
    from eagle3kit.target import TargetInfo

    cfg.validate()
    dist = dist or Dist.from_env()
    device = _device(cfg, dist)
    no_cudnn_sdpa(device)
    live_extra, val_src = {}, None
    if cfg.live is not None:  # samples captured while training, through the stream (``eagle3kit.live``)
        from eagle3kit.live.session import open_live

        train_src, live_heldout, val_src, live_extra = open_live(cfg, dist, Path(cfg.out_dir))
        if closing is not None:
            closing.callback(train_src.close)
        heldout_src = _heldout_source(cfg.heldout) if cfg.heldout else live_heldout
    else:
        train_src = D.open_source(cfg.data, "train")
        if len(train_src) == 0:
            raise TrainError(f"{cfg.data}: no training samples (split 'train' is empty). Fix: extract more samples")
        # the data set's own held-out split, asked of the source itself (the carved train split below is a Subset)
        heldout_src = _heldout_source(cfg.heldout) if cfg.heldout else \
            (D.CaptureSource(cfg.data, "heldout") if isinstance(train_src, D.CaptureSource) else None)
        try:
            train_src, val_src = D.carve_validation(train_src, cfg.val_percent, cfg.val_max_samples)
        except ValueError as e:
            raise TrainError(f"{cfg.data}: {e}") from None
    if heldout_src is not None and len(heldout_src) == 0:
        heldout_src = None
    info = train_src.info()
    target = _resolve_target(cfg, info)
    tinfo = TargetInfo.read(target)
    if info.hidden_size and info.hidden_size != tinfo.hidden_size:
        raise TrainError(f"{cfg.data} holds hidden size {info.hidden_size}, the target {target} has "
                         f"{tinfo.hidden_size}: wrong target")
    aux = _aux_ids(cfg, info, tinfo.num_layers)
    info.n_states = len(aux) + 1
    info.hidden_size = tinfo.hidden_size
    head = TargetHead.from_target(target)
    # a live source's samples exist only once scheduled: its held-out set (the same captures) is probed instead
    head.final_normed = _check_final_slot(cfg, heldout_src if live_extra and heldout_src is not None else train_src,
                                          head)
    out = Path(cfg.out_dir)
    vocab_file = out / "vocab.pt"
    if vocab_file.exists() and (out / "train.json").exists():  # a resume's (a refused run's is made again)
        st = torch.load(vocab_file, weights_only=True)
        vocab, freq = V.DraftVocab.from_state(st), st["freq"]
    else:
        freq = count_frequencies(train_src, tinfo.vocab_size)
        vocab = V.build(freq, min(cfg.draft_vocab_size, tinfo.vocab_size))
        if dist.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            atomic_save({**vocab.state(), "freq": freq}, vocab_file)
    from eagle3kit.drafter import flex

    sparse = cfg.attention == "flex" or (cfg.attention == "auto" and device.type == "cuda")
    if sparse and device.type != "cuda":
        raise TrainError(f"attention=flex on {device}: PyTorch's flex attention has no backward there. Fix: "
                         f"attention=sdpa (or auto) on a CPU")
    if cfg.drafter == "mla":
        from eagle3kit.drafter import mla

        try:
            model = mla.build(target, aux, vocab, cfg.use_fc_norm, cfg.use_norm_output,
                              train_lm_head=cfg.lm_head == "trained", overrides=cfg.mla_overrides(),
                              attn_implementation=flex.IMPL if sparse else "sdpa", seed=cfg.seed).to(device)
        except mla.MLAError as e:
            raise TrainError(str(e)) from None
    else:
        model = build(target, aux, vocab, cfg.num_layers, cfg.use_fc_norm, cfg.use_norm_output,
                      train_lm_head=cfg.lm_head == "trained", ttt_steps=cfg.ttt_steps,
                      attn_implementation=flex.IMPL if sparse else "sdpa").to(device)
    head = head.placed(device)
    attention = "flex" if sparse else "sdpa"
    t_compile = clock()
    if sparse and cfg.attention == "auto":
        attention = _probe_flex(cfg, model, device, len(aux) * tinfo.hidden_size)
    compiled = cfg.compile_layers and _compile_layers(cfg, model, device, len(aux) * tinfo.hidden_size)
    compile_seconds = clock() - t_compile  # the flex probe and the layers' compile: part of the setup
    return Run(cfg, dist, device, train_src, heldout_src, info, target, vocab, freq, model, head,
               vocab.target_to_draft().to(device), vocab.ids.to(device), int(torch.argmax(freq)),
               extra={"aux_layer_ids": aux, "num_layers": tinfo.num_layers, "model_type": tinfo.model_type,
                      "attention": attention, "compiled": bool(compiled), "live": live_extra,
                      "compile_seconds": compile_seconds}, val_src=val_src,
               teacher_tokens=TeacherTokens(int(cfg.teacher_cache_gb * 1e9)) if cfg.teacher_cache_gb > 0 else None)


def _probe_flex(cfg: TrainConfig, model, device, aux_width: int) -> str:
    """attention=auto on a GPU: one forward and backward of the flex path at the run's shapes (which also compiles
    its kernel, as the first step would). If it fails (e.g. a PyTorch or Triton without flex support), the run falls
    back to dense SDPA (same network, slower) and says so, rather than losing the budget; attention=flex fails."""
    try:
        _trial_step(cfg, model, device, aux_width)
        return "flex"
    except Exception as e:  # noqa: BLE001 - reported; the dense path trains the same network
        model.config.transformer_layer_config._attn_implementation = "sdpa"
        print(f"[train] flex attention failed on {device} ({type(e).__name__}: {str(e)[:300]}); training with dense "
              f"SDPA attention instead (same network, slower). attention=sdpa skips this probe", flush=True)
        return "sdpa"
    finally:
        model.zero_grad(set_to_none=True)


def _trial_step(cfg: TrainConfig, model, device, aux_width: int, rows: int | None = None,
                train: bool = True) -> None:
    """One TTT forward and backward of ``model`` at the run's shapes (gradients left for the caller to clear);
    ``train=False``: the forward alone as an evaluation runs it (eval mode, no grad, ``eval_steps`` deep), ``rows``
    packed rows."""
    from eagle3kit.drafter.ttt import draft_steps

    rows = rows or cfg.rows_per_batch
    steps = cfg.ttt_steps if train else cfg.eval_depth
    n = cfg.tokens_per_batch * rows
    was = model.training
    model.train(train)
    try:
        with _autocast(device), torch.set_grad_enabled(train):
            out = draft_steps(model, torch.zeros(n, aux_width, device=device), torch.zeros(n, dtype=torch.long,
                              device=device), torch.zeros(n, dtype=torch.long, device=device),
                              torch.arange(n, device=device) % cfg.tokens_per_batch, steps, rows,
                              cfg.tokens_per_batch)
            loss = sum(x.float().mean() for x in out)
        if train:
            loss.backward()
    finally:
        model.train(was)


def _compile_layers(cfg: TrainConfig, model, device, aux_width: int) -> bool:
    """compile_layers: each decoder layer compiled in place (``nn.Module.compile``: parameter names, checkpoints and
    the export are unchanged), tried on one training step at the run's shapes and on every forward shape an
    evaluation runs (eval mode, no grad, ``eval_steps`` deep, batches of 1 to ``rows_per_batch`` rows: the last batch
    of a held-out plan may hold fewer), which compiles them as the first step and the first evaluations would. A
    failure leaves the layers eager and says so (the same network, slower) rather than losing the run at its first
    evaluation. Each TTT step of the layer holds a different number of keys so far (its own graph), training and
    evaluation differ in grad mode and batches in rows: the recompile limit is raised to hold them all (two graphs a
    layer call: speculators' layer breaks once on purpose)."""
    import torch._dynamo

    depth = max(cfg.ttt_steps, cfg.eval_depth)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit,
                                                2 * depth * (cfg.rows_per_batch + 2))
    for layer in model.layers:
        layer.compile(dynamic=False, backend=COMPILE_BACKEND)
    try:
        _trial_step(cfg, model, device, aux_width)
        for rows in range(cfg.rows_per_batch, 0, -1):
            _trial_step(cfg, model, device, aux_width, rows=rows, train=False)
        return True
    except Exception as e:  # noqa: BLE001 - reported; the eager layers train the same network
        for layer in model.layers:
            layer._compiled_call_impl = None  # noqa: SLF001 - what nn.Module.compile set
        print(f"[train] compile_layers failed on {device} ({type(e).__name__}: {str(e)[:300]}); training with eager "
              f"layers instead (same network, slower)", flush=True)
        return False
    finally:
        model.zero_grad(set_to_none=True)


def _autocast(device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
