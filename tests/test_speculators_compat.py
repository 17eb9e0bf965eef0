"""speculators' own loader reads eagle3kit's export. scripts/setup.sh installs speculators 0.9 without its
dependencies (it pins an older transformers), so this runs in CI; skipped where speculators is not installed."""
import pytest
import torch

speculators = pytest.importorskip("speculators")
pytest.importorskip("hs_connectors")


@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_speculators_arrow_dataset_reads_the_export(tmp_path, tokenizer, reference, target_path, storage):
    """Both storage options: bf16 files are hard-linked into the export, fp8 ones decoded to bf16."""
    from hs_connectors import FileTransfer
    from safetensors.torch import load_file
    from speculators.data_generation.offline import check_hidden_states
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn

    from eagle3kit.export import to_speculators
    from eagle3kit.extract import ReferenceBackend, extract, load_samples, settings_for
    from eagle3kit.target import TargetInfo

    samples, _ = load_samples("embedded:sharegpt", tokenizer, 6, 128)
    info = TargetInfo.read(target_path)
    extract(samples, tmp_path / "d", ReferenceBackend(reference, storage),
            settings_for(target_path, info, [2, 15, 27, 30], storage, "embedded:sharegpt", 128), progress=False)
    r = to_speculators(tmp_path / "d", tmp_path / "spec", split="all")
    assert r["hard_linked"] == (len(samples) if storage == "bf16" else 0)
    hs_dir = tmp_path / "spec" / "hidden_states"
    ds = ArrowDataset(max_len=256, datapath=str(tmp_path / "spec"), transfer=FileTransfer(hs_dir), on_missing="raise",
                      train_ratio=0.5, split="train")
    item = ds[0]
    assert item["hidden_states"].shape[-1] == 3 * 576 and item["verifier_last_hidden_states"].shape[-1] == 576
    check_hidden_states(load_file(hs_dir / "hs_0.safetensors"), samples[0].input_ids)
    batch = CollateFn(256, 576, num_target_layers=3, preprocess=shift_batch)([ds[i] for i in range(len(ds))])
    assert batch["hidden_states"].shape == (1, 256, 3 * 576) and int(batch["loss_mask"].sum()) > 0
    assert torch.isfinite(batch["verifier_last_hidden_states"].float()).all()
