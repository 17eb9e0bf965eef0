"""TP-replication check: real tensor parallelism on the CPU (torchrun + gloo, 3 ranks) and the comparison."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3kit import tp_check


@pytest.fixture(scope="module")
def tp_captures(tmp_path_factory, target_path, tokenizer):
    out = tmp_path_factory.mktemp("tp")
    prompts = {"p0": tokenizer("Tensor parallel ranks all-reduce the residual stream.").input_ids,
               "p1": tokenizer("A drafter needs the same hidden states on every rank.").input_ids}
    tp_check.run_cpu_tp(target_path, out, prompts, [2, 15, 27], n_ranks=3)
    return out, prompts


def test_three_cpu_ranks_hold_bitwise_equal_states(tp_captures):
    out, prompts = tp_captures
    assert all(tp_check.ranks_found(out, k) == [0, 1, 2] for k in prompts)
    rows = tp_check.compare_ranks(out, list(prompts), [0, 1, 2])
    assert [r["layer_id"] for r in rows] == [2, 15, 27, 30]
    assert all(r["bitwise_equal_fraction"] == 1.0 and r["max_ulp"] == 0 for r in rows)
    assert tp_check.verdict(rows, 3).startswith("replicated")


def test_tp_ranks_match_the_single_process_reference(tp_captures, reference):
    from eagle3kit.capture.format import read_sample

    out, prompts = tp_captures
    t, meta = read_sample(out / "p0.rank1.safetensors")
    assert meta["tp_size"] == 3 and t["hidden_states"].dtype == torch.float32
    ref = reference.hidden(prompts["p0"])["hidden_states"]
    assert ((t["hidden_states"] - ref).norm() / ref.norm()).item() < 1e-4


def test_a_rank_that_differs_is_measured(tp_captures, tmp_path):
    out, prompts = tp_captures
    work = tmp_path / "w"
    shutil.copytree(out, work)
    from safetensors import safe_open

    f = work / "p0.rank2.safetensors"
    with safe_open(str(f), "pt") as h:
        meta = h.metadata()
    d = load_file(str(f))
    d["hidden_states"][0, 1, 0] = torch.nextafter(d["hidden_states"][0, 1, 0], torch.tensor(float("inf")))
    save_file(d, str(f), metadata=meta)
    rows = {r["layer_id"]: r for r in tp_check.compare_ranks(work, ["p0"], [0, 1, 2])}
    assert rows[15]["max_ulp"] == 1 and rows[15]["bitwise_equal_fraction"] < 1.0 and rows[2]["max_ulp"] == 0
    assert "NOT bitwise" in tp_check.verdict(list(rows.values()), 3)


def test_ulp_distance_orders_negative_and_positive_floats():
    x = torch.tensor([-1.0, -0.0, 0.0, 1.0], dtype=torch.bfloat16)
    bits = tp_check.ordered_bits(x)
    assert bits.tolist() == sorted(bits.tolist()) and bits[2] - bits[1] in (0, 1)
    one_up = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    f = tp_check.ordered_bits(torch.tensor([1.0, one_up.item()]))
    assert int(f[1] - f[0]) == 1


def test_two_cpu_ranks_on_the_padded_heads_variant(tmp_path, tokenizer):
    """The 12/4-head variant splits over 2 ranks (the embedded 9/3 heads do not): what a 2-GPU SGLang run uses."""
    from eagle3kit.target import resolve_target

    prompts = {"q0": tokenizer("Two ranks, twelve heads, six each.").input_ids}
    tp_check.run_cpu_tp(resolve_target("embedded:smollm2-tp4"), tmp_path, prompts, [2, 27], n_ranks=2)
    rows = tp_check.compare_ranks(tmp_path, list(prompts), [0, 1])
    assert [r["layer_id"] for r in rows] == [2, 27, 30] and tp_check.verdict(rows, 2).startswith("replicated")


def test_ranks_that_do_not_split_the_heads_are_refused_naming_those_that_do(tmp_path):
    """The embedded 9/3 heads over 2 ranks: refused before torchrun starts, naming the rank counts that fit (it was a
    shape error inside each rank, "shape '[1, 40, -1, 64]' is invalid", after the ranks had loaded the model)."""
    from eagle3kit.target import resolve_target

    with pytest.raises(ValueError, match=r"tp_ranks=2: the target's 9 attention heads and 3 KV heads .* Fix: tp_ranks "
                                         r"in \[1, 3\]"):
        tp_check.run_cpu_tp(resolve_target("embedded:smollm2"), tmp_path, {"q0": [1, 2]}, [2, 27], n_ranks=2)
    assert not (tmp_path / "torchrun.log").exists()


def test_one_rank_is_not_run_not_a_fraction_of_one(tmp_path, tokenizer):
    """One rank compared with itself would be 'bitwise equal' by construction: no rows, verdict 'not run'."""
    from eagle3kit.target import resolve_target

    prompts = {"q0": tokenizer("One rank alone.").input_ids}
    tp_check.run_cpu_tp(resolve_target("embedded:smollm2"), tmp_path, prompts, [2, 27], n_ranks=1)
    assert tp_check.ranks_found(tmp_path, "q0") == [0]
    assert tp_check.compare_ranks(tmp_path, list(prompts), [0]) == []
    assert tp_check.verdict([], 1).startswith("not run")
