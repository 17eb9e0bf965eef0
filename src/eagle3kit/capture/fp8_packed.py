"""fp8 storage of one forward's captured block: one GPU kernel, one buffer, one copy to the host.

What the capture hook did before (``format.fp8_encode_states`` on the GPU, gpu-benchmark-graph-fp8): about eight
kernels on the scheduler's stream (a float32 copy of the aux slots, abs, amax, the scale's division and clamp, the
division, the e4m3 cast, the final slot's copy), float32 intermediates twice the block's size, then three host copies
into three regions of the ring. Its hook took 4.6-5.0 % of the scheduler's time against 2.8-2.9 % for bf16.

Here the three stored tensors (``format.fp8_encode_states``: the aux slots in e4m3 with a float32 scale per vector,
the last slot in bf16) are laid out in one byte buffer (``packed_layout``). On the GPU one Triton kernel
(``_fp8_triton.py``) reads the ``[T, n, H]`` block once and writes that buffer; the hook copies it into one region of
the host ring and hands the writer views of it (``unpack``). Bit for bit what ``fp8_encode_states`` computes on the
same device (``tests/test_fp8_packed.py``, its GPU test; ``benchmarks/fp8_encode.py`` times both). Without Triton or on
the CPU, ``encode_packed`` composes the same buffer from ``fp8_encode_states``.
"""
from __future__ import annotations

import functools
import logging

import torch

from eagle3kit.capture.format import fp8_encode_states

ALIGN = 512  # each tensor's start in the buffer (any dtype's alignment; the host ring's regions use the same)
log = logging.getLogger("eagle3kit.capture")
PARTS = (("hidden_states_fp8", torch.float8_e4m3fn), ("hidden_states_scale", torch.float32),
         ("hidden_states_final", torch.bfloat16))


@functools.lru_cache(maxsize=256)  # once per block shape (the hook asks every forward; shapes repeat)
def packed_layout(n_rows: int, n_slots: int, hidden: int) -> tuple[dict, int]:
    """{name: (byte offset, shape, dtype)} of the stored fp8 tensors of a ``[n_rows, n_slots, hidden]`` block in one
    buffer, and the buffer's size in bytes (the dict is shared between callers: read it, never change it)."""
    if n_slots < 2:
        raise ValueError(f"fp8 storage needs an aux slot and the final one: {n_slots} slot(s)")
    shapes = {"hidden_states_fp8": (n_rows, n_slots - 1, hidden), "hidden_states_scale": (n_rows, n_slots - 1),
              "hidden_states_final": (n_rows, hidden)}
    layout, off = {}, 0
    for name, dtype in PARTS:
        layout[name] = (off, shapes[name], dtype)
        n = int(torch.Size(shapes[name]).numel()) * dtype.itemsize
        off += -(-n // ALIGN) * ALIGN
    return layout, max(off, ALIGN)


def unpack(buf: torch.Tensor, layout: dict) -> dict:
    """Views of the stored tensors in a packed byte buffer (on the GPU or in the host ring)."""
    out = {}
    for name, (off, shape, dtype) in layout.items():
        n = int(torch.Size(shape).numel()) * dtype.itemsize
        out[name] = buf[off:off + n].view(dtype).view(shape)
    return out


def encode_packed_reference(states: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The packed buffer composed from ``format.fp8_encode_states`` (torch operations, any device)."""
    layout, size = packed_layout(*states.shape)
    buf = torch.empty(size, dtype=torch.uint8, device=states.device)  # the alignment gaps are never read
    views = unpack(buf, layout)
    for name, x in fp8_encode_states(states).items():
        views[name].copy_(x)
    return buf, layout


_TRITON: list = []  # [module] once imported, [None] when it cannot be


def fused_available() -> bool:
    """Triton importable (SGLang's GPU install brings it); False on a CPU-only install."""
    if not _TRITON:
        try:
            from eagle3kit.capture import _fp8_triton
        except Exception:  # noqa: BLE001 - no triton, or one that cannot build for this machine: the torch path
            _fp8_triton = None
        _TRITON.append(_fp8_triton)
    return _TRITON[0] is not None


def encode_packed(states: torch.Tensor, fused: bool | None = None) -> tuple[torch.Tensor, dict]:
    """``[T, n, H]`` captured states (the hook's block) as the packed fp8 buffer and its layout, on the states' device.
    ``fused``: None, the Triton kernel when the states are on a GPU and Triton is there (a kernel that fails is
    logged, turned off for the process and replaced by the torch operations: a capture never fails for it); True,
    that kernel or an exception; False, ``encode_packed_reference``."""
    auto = fused is None
    if auto:
        fused = states.is_cuda and fused_available()
    if not fused:
        return encode_packed_reference(states)
    if not (states.is_cuda and fused_available()):
        raise RuntimeError("the fused fp8 encoder needs the states on a CUDA GPU and Triton")
    layout, size = packed_layout(*states.shape)
    buf = torch.empty(size, dtype=torch.uint8, device=states.device)
    views = unpack(buf, layout)
    try:
        _TRITON[0].encode(states, views["hidden_states_fp8"], views["hidden_states_scale"],
                          views["hidden_states_final"])
    except Exception as e:  # noqa: BLE001 - a Triton that cannot build this kernel here (an old GPU, say)
        if not auto:
            raise
        _TRITON[0] = None
        log.warning("fp8 capture: the fused encoder failed (%s: %s); the torch operations encode from now on",
                    type(e).__name__, e)
        return encode_packed_reference(states)
    return buf, layout
