"""The Triton kernel of ``fp8_packed.encode_packed`` (imported only where Triton is: SGLang's GPU install).

One program per (token, slot) vector of the ``[T, n, H]`` block: an aux slot becomes e4m3 values and one float32 scale,
the last slot is copied as bf16. The arithmetic is ``format.fp8_encode``'s as torch runs it on a GPU, operation for
operation, so the bytes are the same: the scale is ``amax * fl32(1/448)`` (torch divides a tensor by a Python scalar
through its reciprocal on CUDA), clamped below at fl32(1e-12) (NaN kept), the values divided by it with IEEE rounding
(``div_rn``; Triton's ``/`` is an approximate division), then cast to e4m3 rounding to nearest even.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

INV_FP8_MAX = float(torch.tensor(1.0 / 448.0, dtype=torch.float32))  # fl32(1/448): torch's reciprocal of FP8_MAX
MIN_SCALE = float(torch.tensor(1e-12, dtype=torch.float32))


@triton.jit
def _encode_kernel(src, q, scale, final, n_aux, hidden, stride_t, stride_s, inv_max, fp8_max, min_scale,
                   BLOCK: tl.constexpr, RECIPROCAL: tl.constexpr):
    row = tl.program_id(0)
    t = (row // (n_aux + 1)).to(tl.int64)
    s = row % (n_aux + 1)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(src + t * stride_t + s * stride_s + offs, mask=mask, other=0.0)
    if s == n_aux:  # the final slot: the teacher's input, kept in bf16
        tl.store(final + t * hidden + offs, x.to(tl.bfloat16), mask=mask)
    else:
        xf = x.to(tl.float32)
        amax = tl.max(tl.abs(xf), axis=0)
        if RECIPROCAL:
            sc = amax * inv_max
        else:
            sc = tl.div_rn(amax, fp8_max)
        sc = tl.where(sc < min_scale, min_scale, sc)
        y = tl.div_rn(xf, sc)
        tl.store(q + (t * n_aux + s) * hidden + offs, y.to(tl.float8e4nv), mask=mask)
        tl.store(scale + t * n_aux + s, sc)


def encode(states: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, final: torch.Tensor,
           reciprocal: bool = True) -> None:
    """Encode ``states`` ([T, n, H], last dimension contiguous, on a GPU) into ``q`` ([T, n-1, H] e4m3), ``scale``
    ([T, n-1] float32) and ``final`` ([T, H] bf16), all contiguous, on the current stream. ``reciprocal``: the scale
    as torch computes it on a GPU (False: divided by 448, as torch does on the CPU)."""
    n_rows, n_slots, hidden = states.shape
    if states.stride(2) != 1:
        raise ValueError("the captured block's last dimension must be contiguous")
    if n_rows == 0:
        return
    block = triton.next_power_of_2(hidden)
    launch = _encode_kernel[(n_rows * n_slots,)]  # on the current device's current stream: the states' device
    if states.device.index != torch.cuda.current_device():
        raise ValueError(f"states on {states.device}, current device cuda:{torch.cuda.current_device()}")
    launch(states, q, scale, final, n_slots - 1, hidden, states.stride(0), states.stride(1), INV_FP8_MAX, 448.0,
           MIN_SCALE, BLOCK=block, RECIPROCAL=reciprocal, num_warps=max(1, min(16, block // 256)))
