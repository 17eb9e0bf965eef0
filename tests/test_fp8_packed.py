"""fp8 storage packed in one buffer (``capture/fp8_packed.py``): the layout, the torch composition the CPU uses, and on
a GPU the Triton kernel's bytes against torch's on the same device."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from eagle3kit.capture import fp8_packed
from eagle3kit.capture.format import fp8_encode_states

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from fp8_encode import block, differing_bytes  # noqa: E402


def test_the_layout_aligns_each_tensor_and_the_views_are_the_stored_tensors():
    layout, size = fp8_packed.packed_layout(37, 4, 100)
    assert [layout[k][1] for k in ("hidden_states_fp8", "hidden_states_scale", "hidden_states_final")] == \
        [(37, 3, 100), (37, 3), (37, 100)]
    assert all(off % fp8_packed.ALIGN == 0 for off, _, _ in layout.values())
    ends = sorted(off + torch.Size(shape).numel() * dtype.itemsize for off, shape, dtype in layout.values())
    assert ends[-1] <= size and size % fp8_packed.ALIGN == 0
    x = block("37x4x100", "cpu")
    buf, layout = fp8_packed.encode_packed(x)  # on the CPU: torch's operations, composed into the buffer
    got, want = fp8_packed.unpack(buf, layout), fp8_encode_states(x)
    assert set(got) == set(want) and differing_bytes(want, got) == 0
    assert all(v.dtype == want[k].dtype and v.shape == want[k].shape for k, v in got.items())
    got["hidden_states_fp8"].view(torch.uint8)[5, 1, 7] ^= 1  # one changed bit is seen
    assert differing_bytes(want, got) == 1
    assert fp8_packed.packed_layout(0, 4, 576)[1] == fp8_packed.ALIGN  # an empty block still has a buffer


def test_fp8_needs_an_aux_slot_and_the_fused_kernel_a_gpu():
    with pytest.raises(ValueError, match="aux slot"):
        fp8_packed.packed_layout(3, 1, 8)
    with pytest.raises(RuntimeError, match="CUDA GPU and Triton"):
        fp8_packed.encode_packed(block("4x2x8", "cpu"), fused=True)


def test_the_benchmark_runs_and_names_its_figures(tmp_path):
    spec = importlib.util.spec_from_file_location("fp8_encode_bench", ROOT / "benchmarks" / "fp8_encode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.main(["--shapes", "16x3x64", "--rounds", "2", "--calls", "2", "--device", "cpu", "--out", str(tmp_path)])
    assert res["fp8_encode_16x3x64_torch_cpu_us"] > 0 and len(res["fp8_encode_16x3x64_torch_cpu_us_rounds"].split()) == 2
    assert (tmp_path / "metrics.json").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["1x4x576", "37x4x576", "8192x4x576", "64x4x7168", "33x2x100", "5x5x4096"])
def test_the_fused_kernel_writes_torchs_bytes_on_the_gpu(shape):
    """The hook's fp8 path on a GPU: one Triton kernel where torch ran ~8 operations. The same bytes (values, scales,
    the bf16 final slot), rows of zeros and of tiny values included; a changed byte is seen."""
    assert fp8_packed.fused_available(), "Triton did not import on the GPU machine: the hook falls back to torch"
    x = block(shape, "cuda")
    want = fp8_encode_states(x)
    buf, layout = fp8_packed.encode_packed(x, fused=True)
    got = fp8_packed.unpack(buf, layout)
    n = differing_bytes(want, got)
    division = {k: torch.empty_like(v) for k, v in want.items()}  # the scale divided by 448 instead: for the record
    fp8_packed._TRITON[0].encode(x, division["hidden_states_fp8"], division["hidden_states_scale"],
                                 division["hidden_states_final"], reciprocal=False)
    assert n == 0, f"{n} bytes differ from torch's (with the scale divided by 448: {differing_bytes(want, division)})"
    got["hidden_states_final"].view(torch.uint8).view(-1)[-1] ^= 1
    assert differing_bytes(want, got) == 1
