"""The capture hook SGLang loads through its own ``--forward-hooks`` extension point (no edits to SGLang).

What it takes, from where (SGLang 0.5.14, Llama-style models; DESIGN.md lists the internals relied on):
  * ``model.layers.{k-1}`` forward hook, ``output = (hidden_states, residual)``: the residual stream entering
    layer k is ``hidden_states + residual`` (the next layer's fused add-RMSNorm works in place, so the sum is
    taken at once into a new tensor). The last layer's sum is the final state before the norm.
  * ``logits_processor`` forward hook, ``args = (input_ids, hidden_states, lm_head, forward_batch, ...)``: it runs
    last in every forward, so it closes the forward: token ids from ``args[0]``, the normed final state from
    ``args[1]`` when asked for.
  * ``ForwardBatch``: ``forward_mode`` (only ``ForwardMode.EXTEND``; DECODE, MIXED, TARGET_VERIFY, IDLE are
    skipped), ``rids``, ``extend_seq_lens_cpu``, ``extend_prefix_lens_cpu`` (rows are packed in ``rids`` order).
  * With ``prefill_graph`` (SGLang's prefill CUDA graph kept on) no layer is hooked: ``graph_plugin`` switches
    SGLang's EAGLE-3 aux states on before the graphs are captured, and the logits processor's hook takes them from
    ``args[4]``, the final norm's output from ``args[1]`` as the last slot, the first ``sum(extend_seq_lens_cpu)``
    rows of each (the graph pads to its bucket), and the rids from the batch ``ModelRunner.forward`` was called with
    (the graph's static batch has none).

Hot path per selected forward: per hooked layer one add (and, for mixed batches, a gather) written into its slot
of one ``[rows, slots, H]`` block on the GPU (the file's layout; with fp8 storage encoded there by one kernel into one
buffer, ``fp8_packed``, so fewer bytes cross: the aux slots in e4m3, the final one in bf16), then one copy of the block
on a side stream into a pinned shared-memory ring; a separate writer process (``writer_process.py``) splits,
reassembles chunks and writes, so no file work runs under the scheduler's GIL. Every hook body is wrapped: an
exception is counted and reported in ``_status.rank<r>.json``, never raised into SGLang.
"""
from __future__ import annotations

import json
import logging
import re
import time

import torch

from eagle3kit.capture import fp8_packed, graph_plugin
from eagle3kit.capture.assemble import gather_index, select_rows
from eagle3kit.capture.format import capture_metadata, write_marker
from eagle3kit.capture.rid import RID_PREFIX
from eagle3kit.capture.writer import Job
from eagle3kit.capture.writer_process import WriterProcess, allow_profiler
from eagle3kit.checksum import DEFAULT as DEFAULT_CHECKSUM, check_algorithm

log = logging.getLogger("eagle3kit.capture")
FACTORY = "eagle3kit.capture.hook"
_SESSIONS: dict[str, "CaptureSession"] = {}


def capture_config(capture_dir: str, aux_layer_ids, num_layers: int, *, final_normed: bool = False,
                   ranks="0", storage: str = "bf16", rid_prefix: str = RID_PREFIX, max_inflight_mb: int = 2048,
                   io_threads: int = 4, model: str = "", fail_keys_once=(), prefill_graph: bool = False,
                   checksum: str = DEFAULT_CHECKSUM) -> dict:
    """The hook's config. ``aux_layer_ids`` use the "input of layer k" convention (speculators/vLLM); the final
    state (input of layer ``num_layers``) is always appended as the last slot: before the norm, or with
    ``prefill_graph`` (SGLang's prefill CUDA graph kept on, ``graph_plugin``) the final norm's output, the only final
    state SGLang's aux-state path hands out (``final_slot``). ``fail_keys_once``: fault injection for the fault tests:
    the first forward holding one of these keys raises inside the hook (as a bug would), once per key.
    ``checksum``: what the markers name each file by (``eagle3kit.checksum``: xxh3_128, or sha256)."""
    aux = [int(k) for k in aux_layer_ids]
    bad = [k for k in aux if not 1 <= k < num_layers]
    if bad:
        raise ValueError(f"aux_layer_ids {bad} out of range: in the 'input of layer k' convention k must be in "
                         f"[1, {num_layers - 1}] for a {num_layers}-layer model (0 would be the embeddings)")
    if ranks not in ("0", "all") and not isinstance(ranks, list):
        raise ValueError(f"ranks={ranks!r}: use '0' (one rank, default), 'all' (TP check) or a list of ranks")
    if prefill_graph and final_normed:
        raise ValueError("final_normed with prefill_graph: the last slot already is the final norm's output there; "
                         "leave final_normed off")
    return {"capture_dir": str(capture_dir), "aux_layer_ids": aux, "num_layers": int(num_layers),
            "final_normed": bool(final_normed), "ranks": ranks, "storage": storage, "rid_prefix": rid_prefix,
            "max_inflight_mb": int(max_inflight_mb), "io_threads": int(io_threads), "model": str(model),
            "checksum": check_algorithm(checksum),
            **({"prefill_graph": True} if prefill_graph else {}),
            **({"fail_keys_once": [str(k) for k in fail_keys_once]} if fail_keys_once else {})}


def final_slot(config: dict) -> str:
    """What the last slot holds: ``pre_norm`` (the last layer's output before the final norm, from the layer hooks)
    or ``post_norm`` (the final norm's output, under the prefill graph)."""
    return "post_norm" if config.get("prefill_graph") else "pre_norm"


def slot_layers(config: dict) -> list[int]:
    """Input-of-layer ids of the ``hidden_states`` slots, in file order: aux layers, then the final state."""
    return config["aux_layer_ids"] + [config["num_layers"]]


def forward_hooks(config: dict, layer_module: str = "model.layers.{}") -> list[dict]:
    """The ``--forward-hooks`` JSON for SGLang: one entry per decoder layer to read, one closing entry (only the
    closing one under the prefill graph: the states come to it from SGLang's aux-state path)."""
    layers = [] if config.get("prefill_graph") else sorted({k - 1 for k in slot_layers(config)})
    specs = [{"name": f"eagle3kit_layer{j}", "target_modules": [layer_module.format(j)],
              "hook_factory": f"{FACTORY}:layer_hook", "config": {**config, "layer": j}} for j in layers]
    specs.append({"name": "eagle3kit_end", "target_modules": [end_module(layer_module)],
                  "hook_factory": f"{FACTORY}:end_hook", "config": config})
    return specs


def end_module(layer_module: str = "model.layers.{}") -> str:
    """The logits processor beside the decoder layers: SGLang matches ``--forward-hooks`` names exactly, and a wrapper
    keeps its language model's under the same prefix (Kimi-K2.5: ``language_model.logits_processor``)."""
    prefix = layer_module.rsplit("model.layers", 1)[0] if "model.layers" in layer_module else ""
    return f"{prefix}logits_processor"


class _Forward:
    """Captured rows of the forward in progress."""
    __slots__ = ("fb", "sel", "index", "states", "filled", "host")

    def __init__(self, fb, sel, index):
        self.fb, self.sel, self.index = fb, sel, index
        self.states = None  # [n_rows, n_slots, H], the file's layout, filled layer by layer
        self.filled: set[int] = set()
        self.host: list = []  # host buffers taken for this forward (given back if it is abandoned)


class CaptureSession:
    """Per process (one per TP rank): routes layer outputs of selected rows to the writer."""

    def __init__(self, config: dict, rank: int = 0, tp_size: int = 1, extend_mode=None, forward_batch_type=None,
                 dp_rank: int | None = None):
        self.config = config
        self._fp8 = config.get("storage") == "fp8"  # encoded in the hook, on the states' device
        self.rank, self.tp_size = rank, tp_size
        self.extend_mode = extend_mode
        self.fb_type = forward_batch_type
        self.prefix = config["rid_prefix"]
        self._fail_once = set(config.get("fail_keys_once", ()))  # fault injection (capture_config)
        ranks = config["ranks"]
        self.active = ranks == "all" or (ranks == "0" and rank == 0) or (isinstance(ranks, list) and rank in ranks)
        slots = slot_layers(config)
        self.n_slots = len(slots)
        self.layer_slots: dict[int, list[int]] = {}
        for i, k in enumerate(slots):
            self.layer_slots.setdefault(k - 1, []).append(i)
        self.cur: _Forward | None = None
        self._stream = None
        self.writer = None
        if self.active:
            meta = capture_metadata("sglang", config["model"], rank, tp_size, slots, config["num_layers"],
                                    config["final_normed"], final_slot(config))
            self.writer = WriterProcess(config["capture_dir"], rank, meta, storage=config["storage"],
                                        io_threads=config["io_threads"],
                                        checksum=config.get("checksum", DEFAULT_CHECKSUM),
                                        max_inflight_bytes=config["max_inflight_mb"] << 20, dp_rank=dp_rank)

    # -- hook bodies (called by the wrappers below, inside try/except) ---------------------------------------
    def _forward_batch(self, args, pos):
        if len(args) > pos and (self.fb_type is None or isinstance(args[pos], self.fb_type)):
            return args[pos]
        for a in args:
            if self.fb_type is not None and isinstance(a, self.fb_type):
                return a
        return None

    def _state(self, fb, total_rows: int):
        if self.cur is not None and self.cur.fb is fb:
            return self.cur
        if self.cur is not None:  # the previous forward never reached the logits processor
            self.writer.note("forwards_abandoned")
            self.abandon()
        if fb.forward_mode != self.extend_mode or fb.rids is None:
            return None
        if getattr(fb, "_original_forward_mode", None) is not None:  # a DECODE/IDLE batch SGLang dressed as EXTEND
            return None
        sel = select_rows(fb.rids, fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu, self.prefix)
        for kind, n in sel.ignored.items():
            self.writer.ignored[kind] += n
        for rid, why in sel.bad_rids:
            self.writer.note("bad_rids")
            self.writer.last_error = why
        if not sel.spans:
            self.cur = _Forward(fb, sel, None)  # remembered so that later layers return at once
            return self.cur
        index = gather_index(sel, total_rows)
        if index is not None:
            index = index.to(self._device_of(fb), non_blocking=True)
        self.cur = _Forward(fb, sel, index)
        return self.cur

    @staticmethod
    def _device_of(fb):
        ids = getattr(fb, "input_ids", None)
        return ids.device if isinstance(ids, torch.Tensor) else torch.device("cpu")

    def refuse(self, reason: str) -> None:
        """No capture in this process: the reason goes where the client and the server's probe read it (the writer's
        status), and the hook factories register nothing."""
        if self.writer is not None:
            self.writer.error("setup", RuntimeError(reason))
        self.active = False

    def abandon(self) -> None:
        """Forget the forward in progress and give its host buffers back."""
        st, self.cur = self.cur, None
        if st is not None and st.host and self.writer is not None:
            self.writer.discard(st.host)

    def _host(self, st: _Forward, shape, dtype, cuda: bool) -> torch.Tensor:
        dst = self.writer.host_empty(shape, dtype, cuda=cuda)
        st.host.append(dst)
        return dst

    def _copy(self, st: _Forward, rows: torch.Tensor) -> torch.Tensor:
        """Host copy of ``rows`` (already selected); asynchronous on a side stream from the GPU."""
        dst = self._host(st, rows.shape, rows.dtype, rows.is_cuda)
        if not rows.is_cuda:
            return dst.copy_(rows)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=rows.device)
        self._stream.wait_stream(torch.cuda.current_stream(rows.device))
        with torch.cuda.stream(self._stream):
            dst.copy_(rows, non_blocking=True)
        rows.record_stream(self._stream)
        return dst

    def _block(self, st: _Forward, like: torch.Tensor) -> None:
        """The forward's one ``[rows, slots, H]`` block (the file's layout), of ``like``'s dtype: on the GPU (one copy
        to the host at the end; fp8 is encoded there too), on the CPU straight in host memory."""
        shape = (st.sel.n_rows, self.n_slots, like.shape[-1])
        st.states = (torch.empty(shape, dtype=like.dtype, device=like.device) if like.is_cuda or self._fp8
                     else self._host(st, shape, like.dtype, False))

    def _rows(self, st: _Forward, x: torch.Tensor) -> torch.Tensor:
        return x if st.index is None else x.index_select(0, st.index)

    def on_layer(self, layer: int, args, output):
        fb = self._forward_batch(args, 2)
        if fb is None:
            return
        # Llama/Qwen return (hidden, residual); DeepSeek-V2/V3 (hidden, residual, topk_indices)
        h, r = (output[0], output[1]) if isinstance(output, tuple) else (output, None)
        st = self._state(fb, h.shape[0])
        if st is None or not st.sel.spans:
            return
        if st.states is None:  # each layer's residual sum is written into its slot
            self._block(st, h)
        slots = self.layer_slots.get(layer, ())
        for i in slots:
            if r is None:
                st.states[:, i].copy_(self._rows(st, h))
            else:
                torch.add(self._rows(st, h), self._rows(st, r), out=st.states[:, i])
            st.filled.add(i)

    def _graph_batch(self, fb):
        """Under the prefill graph the logits processor gets the graph's static batch, without ``rids``: the batch
        ``ModelRunner.forward`` was called with (remembered by ``graph_plugin``) has them. A batch that ran eagerly
        (over the largest graph size, with input logprobs ...) arrives as it is."""
        if fb.rids is not None:
            return fb
        real = graph_plugin.STATE["batch"]
        if real is None:
            raise RuntimeError(f"prefill graph: no batch remembered from ModelRunner.forward: {graph_plugin.missing_reason()}")
        if list(real.extend_seq_lens_cpu or []) != list(fb.extend_seq_lens_cpu or []):
            raise RuntimeError("prefill graph: the batch remembered from ModelRunner.forward is not the one the logits "
                               "processor sees (their extend_seq_lens_cpu differ)")
        return real

    def _fill_from_aux(self, st: _Forward, args, n: int) -> None:
        """The slots from SGLang's aux states (``args[4]``, one [rows, H] per aux layer) and the final norm's output
        (``args[1]``): the first ``n`` rows are the batch's tokens (a graph pads to its bucket); copied now, since the
        next replay overwrites the graph's buffers."""
        aux = args[4] if len(args) > 4 else None
        want = self.n_slots - 1
        if not isinstance(aux, (list, tuple)) or len(aux) != want:
            got = len(aux) if isinstance(aux, (list, tuple)) else 0
            raise RuntimeError(f"prefill graph: {got} aux states from SGLang where {want} were set: "
                               f"{graph_plugin.missing_reason()}")
        self._block(st, args[1])
        for i, x in enumerate(list(aux) + [args[1]]):  # fewer rows than the batch's fail in the copy
            st.states[:, i].copy_(self._rows(st, x[:n]))
            st.filled.add(i)

    def on_end(self, args):
        fb = self._forward_batch(args, 3)
        if fb is None:
            return
        graph = bool(self.config.get("prefill_graph"))
        if graph:
            fb = self._graph_batch(fb)
        mode = getattr(fb.forward_mode, "name", str(fb.forward_mode)).lower()
        self.writer.note(f"forwards_{mode}")
        n = args[1].shape[0]
        if graph and fb.forward_mode == self.extend_mode and fb.extend_seq_lens_cpu is not None:
            n = int(sum(fb.extend_seq_lens_cpu))  # the rows past them pad the graph's bucket
        st = self._state(fb, n)
        if st is None or not st.sel.spans:
            self.cur = None
            return
        if graph:
            self._fill_from_aux(st, args, n)
        missing = [k for k, idx in self.layer_slots.items() if any(i not in st.filled for i in idx)]
        if missing:
            raise RuntimeError(f"no output captured from decoder layers {missing}: their hooks did not fire "
                               f"(module names differ from the layer_module template?)")
        inject = self._fail_once.intersection(sp.key for sp in st.sel.spans) if self._fail_once else set()
        if inject:
            self._fail_once -= inject
            raise RuntimeError(f"injected fault for {sorted(inject)} (fail_keys_once)")
        if self._fp8:  # encoded where the states are (the GPU: one kernel), one buffer, one copy; views of it
            buf, layout = fp8_packed.encode_packed(st.states)
            self.writer.note("fp8_fused_forwards" if buf.is_cuda and fp8_packed.fused_available() else
                             "fp8_torch_forwards")
            tensors = fp8_packed.unpack(self._copy(st, buf), layout)
        else:
            tensors = {"hidden_states": self._copy(st, st.states) if st.states.is_cuda else st.states}
        # the logits processor's input_ids; a multimodal wrapper (Kimi-K2.5's kimi_k25.py) embeds the tokens itself
        # and passes None there: the batch's own ids are the same tokens
        ids = (args[0] if args[0] is not None else fb.input_ids)[:n]
        if graph and st.index is None:  # a view of the graph's input buffer, which the next replay overwrites while
            ids = ids.clone()  # the side stream may still be copying it: taken on this stream first
        tensors["token_ids"] = self._copy(st, self._rows(st, ids))
        if self.config["final_normed"]:
            tensors["final_normed"] = self._copy(st, self._rows(st, args[1]))
        event = None
        if self._stream is not None and args[1].is_cuda:
            event = torch.cuda.Event()
            event.record(self._stream)
        self.cur = None  # the job owns the host buffers now
        self.writer.submit(Job(st.sel, tensors, event))


def _session(config: dict) -> CaptureSession:
    key = config["capture_dir"]
    if key not in _SESSIONS:
        from sglang.srt.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        try:
            rank, size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        except Exception:  # noqa: BLE001 - not initialised: a single process
            rank, size = 0, 1
        allow_profiler()
        rank, size, dp, refused = capture_layout(rank, size, dp_rank(), _dp_attention(), _server_features())
        session = _SESSIONS[key] = CaptureSession(config, rank, size, ForwardMode.EXTEND, ForwardBatch, dp_rank=dp)
        if refused:
            session.refuse(refused)
        log.info("eagle3kit capture: rank %d/%d dp %s active=%s layers=%s -> %s%s", rank, size, dp,
                 session.active, slot_layers(config), key, f" REFUSED: {refused}" if refused else "")
    return _SESSIONS[key]


def _dp_attention() -> dict | None:
    """SGLang's DP-attention layout of this process (``layers/dp_attention.py``), or None when it is off."""
    try:
        from sglang.srt.layers import dp_attention as dpa

        if not dpa.is_dp_attention_enabled():
            return None
        return {"tp_rank": dpa.get_attention_tp_rank(), "tp_size": dpa.get_attention_tp_size(),
                "dp_rank": dpa.get_attention_dp_rank(), "cp_rank": dpa.get_attention_cp_rank()}
    except Exception:  # noqa: BLE001 - an SGLang without these: no DP attention as far as we can tell
        return None


def _server_features() -> dict:
    """What of this server's settings changes which rows a layer's output holds (SGLang's resolved arguments)."""
    try:
        from sglang.srt.server_args import get_global_server_args

        args = get_global_server_args()
        return {"a2a": str(getattr(args, "moe_a2a_backend", None) or "none"),
                "two_batch_overlap": bool(getattr(args, "enable_two_batch_overlap", False))}
    except Exception:  # noqa: BLE001 - an SGLang without them: nothing known to refuse
        return {}


def capture_layout(tp_rank: int, tp_size: int, dp: int | None, dpa: dict | None, features: dict | None = None) -> tuple:
    """(rank, group size, DP index, refusal or None) the capture session runs with.

    Plain TP: every TP rank holds the same full hidden states; ranks are TP ranks (rank 0 writes by default), ``dp``
    is SGLang's ``--dp`` worker. Under DP attention (``--enable-dp-attention``) each attention-DP group serves its own
    requests (SGLang 0.5.14 routes each request whole to one group, and a group's ForwardBatch holds only its rows),
    so the rank that matters is the attention-TP rank: rank 0 of every group writes its group's requests, files and
    markers named ``rank0`` (a request is served by one group: no name collides), status per group (``dp``). With an
    attention-TP group of more than one GPU a layer's output may be split across its ranks (SCATTERED under DeepEP or
    --moe-dense-tp-size 1): refused, fix dp = tp. Two-batch overlap runs MoE layers without their module hooks:
    refused. ``features`` (``_server_features``): an all-to-all MoE backend (``--moe-a2a-backend`` deepep etc.) leaves
    the outputs of MoE layers split across the ranks of a group of more than one GPU (SCATTERED, SGLang 0.5.14
    ``layers/communicator.py``), under plain TP too: refused; ``--ep-size`` alone splits only the experts (an all-reduce
    follows), so layer outputs stay whole and it is allowed."""
    features = features or {}
    if dpa is None:
        rank, size, dp_index = tp_rank, tp_size, dp
    else:  # context-parallel peers (cp_rank > 0) never write
        rank = dpa["tp_rank"] if dpa.get("cp_rank", 0) == 0 else max(1, dpa["tp_rank"])
        size, dp_index = dpa["tp_size"], dpa["dp_rank"]
    refused = None
    if features.get("a2a", "none") != "none" and size > 1:
        refused = (f"capture cannot run with --moe-a2a-backend {features['a2a']} on {size} GPUs per group: the outputs "
                   f"of MoE layers are split across them, no rank holds every row. Fix: --moe-a2a-backend none (expert "
                   f"parallelism with --ep-size keeps whole outputs), or --enable-dp-attention with --dp equal to --tp")
    elif dpa is not None and size > 1:
        refused = (f"capture under --enable-dp-attention needs one GPU per attention-DP group (dp = tp); this server "
                   f"has {size} per group, whose layer outputs may be split across them. Fix: --dp equal to --tp")
    elif features.get("two_batch_overlap"):
        refused = ("capture cannot run with --enable-two-batch-overlap: its MoE layers run without their module "
                   "hooks. Fix: leave it off for the capture server")
    return rank, size, dp_index, refused


def dp_rank(title: str | None = None) -> int | None:
    """This scheduler's data-parallel worker under ``--dp N``, else None. SGLang names the process
    ``sglang::scheduler_DP<d>[_TP<r>...]`` (``configure_scheduler_process``); every worker of a ``--dp N`` server
    is TP rank 0 of its own group, so the DP index keeps their status files apart."""
    if title is None:
        try:
            import setproctitle

            title = setproctitle.getproctitle()
        except Exception:  # noqa: BLE001 - no title to read: not a DP worker as far as we can tell
            return None
    m = re.search(r"scheduler_DP(\d+)", title)
    return int(m.group(1)) if m else None


def _guarded(session: CaptureSession, where: str, fn, *args):
    t = time.perf_counter()
    try:
        fn(*args)
        if session.writer is not None:  # the scheduler's own time in the hooks, reported in the status file
            session.writer.counts["hook_us"] += int((time.perf_counter() - t) * 1e6)
    except Exception as e:  # noqa: BLE001 - never raise into SGLang
        failed = session.cur
        try:
            session.abandon()
        except Exception:  # noqa: BLE001
            session.cur = None
        if session.writer is not None:
            session.writer.error(where, e)
        try:  # the requests of the failed forward: an error marker each, so their clients fail them now (and retry)
            _fail_requests(session, failed, f"capture hook error in {where}: {type(e).__name__}: {e}")
        except Exception:  # noqa: BLE001 - the marker is a courtesy; the client's timeout still ends the wait
            pass


def _fail_requests(session: CaptureSession, forward, reason: str) -> None:
    if forward is None or session.writer is None:
        return
    for span in {s.key: s for s in forward.sel.spans}.values():
        write_marker(session.config["capture_dir"], span.key, session.rank,
                     {"status": "error", "key": span.key, "rid": span.rid, "rank": session.rank, "reason": reason,
                      "time": time.time()})


def layer_hook(config: dict):
    """SGLang hook factory for one decoder layer (``config["layer"]``)."""
    session = _session(config)
    if not session.active:
        return None  # SGLang registers nothing for a factory that returns None
    layer = int(config["layer"])

    def hook(module, args, output):
        _guarded(session, f"layer {layer}", session.on_layer, layer, args, output)
    return hook


def end_hook(config: dict):
    """SGLang hook factory for the logits processor: closes each forward."""
    session = _session(config)
    if not session.active:
        return None

    def hook(module, args, output):
        _guarded(session, "end", session.on_end, args)
    return hook


def dumps(specs: list[dict]) -> str:
    return json.dumps(specs, separators=(",", ":"))
