"""GPU: a drafter trained on CUDA from states captured on CUDA, served by SGLang 0.5.14 (EAGLE3): SGLang's draft
holds every exported tensor, computes the trained network's logits on its own inputs, is fed the layers the doctor
predicts, and the off-by-one export is both fed other layers and flagged. (The full-size run: notebook 05 with
params/gpu-smollm2-drafter.yaml; this is its small, fast form.)"""
import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


def test_trained_drafter_served_by_sglang(tmp_path, target_path):
    from transformers import AutoTokenizer

    from eagle3kit.acceptance import experiment, online
    from eagle3kit.drafter.train import TrainConfig, train
    from eagle3kit.pipeline import run_extraction

    data = tmp_path / "data"
    run_extraction(target=str(target_path), out_dir=data, engine="transformers", max_samples=32, max_tokens=512,
                   heldout_percent=25, reference_device="cuda", reference_dtype="bfloat16", progress=False)
    out = tmp_path / "drafter"
    s = train(TrainConfig(data=str(data), out_dir=str(out), draft_vocab_size=4096, ttt_steps=3, max_steps=30,
                          tokens_per_batch=2048, lr=1e-3, workers=1, progress=False))
    assert s["train_steps"] == 30 and s["train_tokens_per_s"] > 0
    from eagle3kit.acceptance import offline
    off = offline.evaluate_drafter(out / "best", data, steps=3, device="cuda")  # 05's first cell (the head on the GPU,
    assert off["offline_tau_3"] >= 1.0  # the states loaded on the CPU: the final-slot probe failed there in -14)
    tok = AutoTokenizer.from_pretrained(target_path)
    prompts = online.heldout_prompts(data, tok, 4)
    assert prompts, "no held-out prompts"
    plan = experiment.OnlinePlan(target=str(target_path), drafter=str(out / "best"), sweep_steps=(3,), trees=(),
                                 concurrencies=(1,), prompts_per_conc={1: 4}, max_new_tokens=32, rounds=1)
    results = experiment.run(plan, prompts, tmp_path / "online", eos_ids=online.eos_token_ids(target_path, tok))
    # equal work: SGLang gave plain and the drafter's server every token asked for (ignore_eos), no reply cut short
    done = {n: results["servers"][n]["by_concurrency"][1]["rounds"][0]["output_tokens"] for n in ("plain", "main")}
    assert done == {"plain": 4 * 32, "main": 4 * 32}, done
    proofs = experiment.prove(plan, results, tmp_path / "online", device="cuda")
    m = experiment.summarize(plan, results, proofs, {})
    report = Path(os.environ.get("E3K_TEST_OUT", tmp_path)) / "gpu-drafter-test.json"
    report.write_text(json.dumps({"metrics": m, "proofs": proofs, "failed": results["failed"],
                                  "train": s}, indent=1, default=str))
    assert not results["failed"], results["failed"]
    p, o = proofs["proof"], proofs["offbyone"]
    # SGLang's draft (fc_norm off) holds 11 parameters: embed_tokens, fc, norm, 7 of layers.0 (qkv_proj, o_proj,
    # gate_up_proj, down_proj, 3 norms) and lm_head; d2t is not a parameter (it becomes hot_token_id).
    assert p["export_params_unloaded"] == 0 and p["export_params_checked"] == 11, p
    assert not p["export_tensors_not_held"] and "prompts_error" not in p, p
    assert p["export_logits_max_rel_err"] < 0.05 and p["export_logits_argmax_agreement"] > 0.95, p
    assert p["doctor_verified"] and p["doctor_ok"], p
    assert o["doctor_verified"] and not o["doctor_ok"], o
    assert o["fed_layer_ids"] != p["fed_layer_ids"]
    assert m["online_accept_length"] >= 1.0 and m["plain_tokens_per_s"] > 0


def _real_batches(tmp_path, target_path, **cfg):
    """A run set up on CUDA over 24 conversations captured on CUDA (bf16), its first two packed batches of several
    samples each, and ``grads(batch)``: (loss, gradients) of one TTT forward and backward (5 steps)."""
    import torch

    from eagle3kit.drafter import data as D
    from eagle3kit.drafter.train import TrainConfig, forward_batch
    from eagle3kit.drafter.training_setup import setup
    from eagle3kit.drafter.ttt import TTTModule
    from eagle3kit.pipeline import run_extraction

    data = tmp_path / "data"
    run_extraction(target=str(target_path), out_dir=data, engine="transformers", max_samples=24, max_tokens=512,
                   heldout_percent=0, reference_device="cuda", reference_dtype="bfloat16", progress=False)
    run = setup(TrainConfig(data=str(data), out_dir=str(tmp_path / "t"), draft_vocab_size=4096, ttt_steps=5,
                            tokens_per_batch=2048, workers=0, progress=False, device="cuda", **cfg))
    src = run.train_src
    batches = D.plan([src.length(i) for i in range(len(src))], 2048, 0)[:2]
    loaded = [b for _, b, _ in D.loader(src, batches, run.info.n_states, run.info.hidden_size, 2048, workers=0)]
    assert all(b["doc_ids"].unique().numel() >= 2 for b in loaded)  # rows of several samples: boundaries matter
    params = [p for p in run.model.parameters() if p.requires_grad]
    module = TTTModule(run.model)

    def grads(b):
        run.model.zero_grad(set_to_none=True)
        loss, _ = forward_batch(run, module, b, 5)
        loss.backward()
        return loss.item(), [p.grad.float().clone() for p in params]

    def merged(b):  # the samples of a row merged into one: what a wrong mask computes
        return {**b, "doc_ids": torch.zeros_like(b["doc_ids"])}

    return run, loaded, grads, merged


def _rel(a, c) -> float:
    """The worst parameter's relative gradient difference."""
    return max(float((x - y).norm() / y.norm().clamp_min(1e-12)) for x, y in zip(a, c))


def _same_training(rows, names, tmp_path, report_name) -> None:
    """Per batch (reference, candidate, merged), each (loss, gradients): the candidate's loss within 0.5 % and its
    gradients within 5 % of the reference's, while the merged rows' gradients (the wrong computation) sit at least
    4x as far (the check can fail). The figures go to E3K_TEST_OUT (the record)."""
    ref, cand = names
    report = {}
    for i, ((lr, gr), (lc, gc), (lm, gm)) in enumerate(rows):
        report[i] = {f"loss_{ref}": lr, f"loss_{cand}": lc, "loss_merged": lm, f"grad_rel_{cand}": _rel(gc, gr),
                     "grad_rel_merged": _rel(gm, gr)}
        assert abs(lc - lr) / lr < 5e-3, report[i]
        assert report[i][f"grad_rel_{cand}"] < 0.05, report[i]
        assert report[i]["grad_rel_merged"] > 4 * report[i][f"grad_rel_{cand}"], report[i]
    (Path(os.environ.get("E3K_TEST_OUT", tmp_path)) / report_name).write_text(json.dumps(report, indent=1))


def test_flex_attention_trains_as_the_dense_attention(tmp_path, target_path):
    """The GPU default (block-sparse flex attention, compiled) gives the dense SDPA path's loss, gradients and logits
    on real packed batches (bf16 autocast), and the comparison can fail (the samples of a row merged into one)."""
    from eagle3kit.drafter import flex

    run, loaded, grads, merged = _real_batches(tmp_path, target_path)
    assert flex.uses_flex(run.model) and run.extra["attention"] == "flex"  # the GPU default, its probe passed
    tl = run.model.config.transformer_layer_config

    def with_impl(b, impl):
        tl._attn_implementation = impl
        try:
            return grads(b)
        finally:
            tl._attn_implementation = flex.IMPL

    _same_training([(with_impl(b, "sdpa"), with_impl(b, flex.IMPL), with_impl(merged(b), flex.IMPL)) for b in loaded],
                   ("sdpa", "flex"), tmp_path, "gpu-flex-test.json")


def test_compiled_layers_train_as_the_eager_layers(tmp_path, target_path):
    """compile_layers on the GPU (inductor, flex attention inside): the compiled layers give the eager layers' loss
    and gradients on real packed batches (bf16 autocast), and the comparison can fail (a row's samples merged)."""
    run, loaded, grads, merged = _real_batches(tmp_path, target_path, compile_layers=True)
    assert run.extra["compiled"], "the compile's trial step failed (see the run's output)"
    layers = list(run.model.layers)
    rows = []
    for b in loaded:
        candidate = grads(b)
        compiled = [layer._compiled_call_impl for layer in layers]  # noqa: SLF001 - what nn.Module.compile set
        for layer in layers:
            layer._compiled_call_impl = None  # noqa: SLF001 - eager for the reference
        try:
            rows.append((grads(b), candidate, grads(merged(b))))
        finally:
            for layer, c in zip(layers, compiled):
                layer._compiled_call_impl = c  # noqa: SLF001
    _same_training(rows, ("eager", "compiled"), tmp_path, "gpu-compiled-layers-test.json")
