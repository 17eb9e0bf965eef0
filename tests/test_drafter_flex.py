"""The block-sparse TTT attention (``drafter.flex``, the GPU default) against the dense one: the blocks it lists are
exactly those the dense mask touches, and the drafter's logits are the same (CPU: flex's eager reference, forward
only; the compiled kernel and its gradients are compared on the GPU in tests/test_gpu_drafter.py)."""
import pytest
import torch

from eagle3kit.drafter import flex
from eagle3kit.drafter.train import TrainConfig, TrainError
from eagle3kit.drafter.ttt import causal_doc_mask, draft_steps, extend_mask_for_step
from tests.test_train import TINY


def _docs(rows, s):
    doc = torch.full((rows, s), -1, dtype=torch.long)
    doc[0, :100], doc[0, 100:220] = 0, 1
    if rows > 1:
        doc[1, :200], doc[1, 200:] = 2, 3
    return doc


def _blocks(mask, b):
    rows, _, s, kv = mask.shape
    blk = mask.view(rows, 1, s // b, b, kv // b, b)
    return blk.any(-1).any(-2), blk.all(-1).all(-2)


def test_step_masks_list_exactly_the_blocks_the_dense_masks_touch():
    rows, s, steps, b = 2, 384, 4, flex.BLOCK
    doc = _docs(rows, s)
    masks, dense = flex.step_masks(doc, steps), causal_doc_mask(doc)
    for k, m in enumerate(masks):
        if k:
            dense = extend_mask_for_step(dense, s)
        touched, full = _blocks(dense, b)
        listed = m.to_dense().bool()
        assert listed.shape[-1] == steps * s // b
        assert torch.equal(listed[..., :touched.shape[-1]], touched), k
        assert not listed[..., touched.shape[-1]:].any(), k  # the steps not run yet: nothing
        fully = torch.zeros_like(listed)
        if m.full_kv_num_blocks is not None:
            for r in range(rows):
                for q in range(s // b):
                    fully[r, 0, q, m.full_kv_indices[r, 0, q, :m.full_kv_num_blocks[r, 0, q]].long()] = True
        assert not (fully[..., :full.shape[-1]] & ~full).any(), k  # a block run without mask_mod must be all visible
    # the check can fail: the masks of other samples' boundaries list other blocks
    other = flex.step_masks(torch.zeros_like(doc), steps)[0].to_dense().bool()
    assert not torch.equal(other[..., :s // b], _blocks(causal_doc_mask(doc), b)[0])
    with pytest.raises(ValueError, match="multiple of"):
        flex.step_masks(doc[:, :200], steps)


def test_flex_drafter_gives_the_dense_drafters_logits(small_dataset, tmp_path):
    from eagle3kit.drafter import data as D
    from eagle3kit.drafter.training_setup import setup

    run = setup(TrainConfig(data=str(small_dataset), out_dir=str(tmp_path / "s"), **TINY))
    src, tpb = run.train_src, run.cfg.tokens_per_batch
    lengths = [src.length(i) for i in range(len(src))]
    tl = run.model.config.transformer_layer_config
    run.model.eval()

    def logits(b, rows, impl, budget, doc=None):
        tl._attn_implementation = impl
        try:
            return list(draft_steps(run.model, b["aux"].float(), b["input_ids"], b["doc_ids"] if doc is None else doc,
                                    b["position_ids"], 3, rows, budget))
        finally:
            tl._attn_implementation = "sdpa"

    with torch.no_grad():
        # one row of several samples (not a multiple of the block: padded inside), and three rows of tpb
        for rows, budget in ((1, 3 * tpb), (3, tpb)):
            batches = D.plan(lengths, budget, 0)[:rows]
            (_, b, _), = list(D.loader(src, batches, run.info.n_states, run.info.hidden_size, budget, workers=0,
                                       rows=rows))[:1]
            dense, sparse = logits(b, rows, "sdpa", budget), logits(b, rows, flex.IMPL, budget)
            for k in range(3):
                assert sparse[k].shape == dense[k].shape
                torch.testing.assert_close(sparse[k], dense[k], rtol=1e-4, atol=1e-4)
        # the comparison can fail: the row's samples merged into one (attention across their boundaries)
        assert rows == 3 and b["doc_ids"].unique().numel() >= 3
        (_, one, _), = list(D.loader(src, D.plan(lengths, 3 * tpb, 0)[:1], run.info.n_states, run.info.hidden_size,
                                     3 * tpb, workers=0))
        assert one["doc_ids"].unique().numel() >= 2 and one["input_ids"].shape[0] % flex.BLOCK
        merged = logits(one, 1, flex.IMPL, 3 * tpb, doc=torch.zeros_like(one["doc_ids"]))
        assert not torch.allclose(merged[0], logits(one, 1, "sdpa", 3 * tpb)[0], atol=1e-2)
    with pytest.raises(TrainError, match="no backward"):
        setup(TrainConfig(data=str(small_dataset), out_dir=str(tmp_path / "f"), attention="flex", **TINY))


def test_auto_attention_falls_back_to_dense_when_flex_fails(small_dataset, tmp_path, capsys):
    """attention=auto probes the flex path at the run's shapes; where it fails (here: a CPU, where flex has no
    backward) the run trains with SDPA and says so, instead of losing its budget."""
    from eagle3kit.drafter.training_setup import _probe_flex, setup

    run = setup(TrainConfig(data=str(small_dataset), out_dir=str(tmp_path / "s"), **TINY))
    assert run.extra["attention"] == "sdpa" and not flex.uses_flex(run.model)  # auto on a CPU: dense
    run.model.config.transformer_layer_config._attn_implementation = flex.IMPL
    width = len(run.extra["aux_layer_ids"]) * run.info.hidden_size
    assert _probe_flex(run.cfg, run.model, run.device, width) == "sdpa"
    assert not flex.uses_flex(run.model) and "training with dense SDPA" in capsys.readouterr().out
    assert all(p.grad is None for p in run.model.parameters())
