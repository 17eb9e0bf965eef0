"""The head-only target and the synthetic data set that measure the trainer at Kimi-K2.5's geometry on a GPU
(``benchmarks/train_throughput.py``): here at a small geometry, the same code path."""
import json

import pytest
from safetensors import safe_open

from eagle3kit.synthetic import KIMI_K25_TEXT, make_head_only, random_states, write_synthetic_dataset
from tests.conftest import TINY_DRAFTER

SMALL = {**KIMI_K25_TEXT, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
         "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 49160}


@pytest.fixture(scope="module")
def head_only(tmp_path_factory, target_path):
    return make_head_only(tmp_path_factory.mktemp("kimi") / "target", target_path, SMALL)


def test_the_head_only_target_has_the_geometry_and_only_the_trainers_tensors(head_only, target_path):
    """Kimi-K2.5's sizes by default (hidden 7168, vocabulary 163,840, 61 layers); the three tensors the trainer
    reads, of the config's shapes, and no decoder layer. A tokenizer larger than the vocabulary is refused."""
    assert KIMI_K25_TEXT["hidden_size"] == 7168 and KIMI_K25_TEXT["vocab_size"] == 163840
    assert KIMI_K25_TEXT["num_hidden_layers"] == 61
    conf = json.loads((head_only / "config.json").read_text())
    assert conf["hidden_size"] == 64 and conf["vocab_size"] == 49160
    with safe_open(str(head_only / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes == {"model.embed_tokens.weight": (49160, 64), "lm_head.weight": (49160, 64),
                      "model.norm.weight": (64,)}
    with pytest.raises(ValueError, match="more than vocab_size"):
        make_head_only(head_only.parent / "small-vocab", target_path, {**SMALL, "vocab_size": 1000})


def test_a_drafter_trains_on_synthetic_states_of_the_head_only_target(head_only, tmp_path):
    """The data set passes verify as a captured one (files, checksums, shapes of the target's geometry, layers),
    and the trainer runs on it with the head-only target (its teacher head at the config's vocabulary)."""
    from eagle3kit.drafter.train import TrainConfig, train
    from eagle3kit.store import read_settings, verify

    data = tmp_path / "data"
    s = write_synthetic_dataset(data, head_only, max_samples=12, max_tokens=64)
    assert s["written"] >= 6 and s["failed"] == 0, s
    rep = verify(data, expected_states=4, hidden_size=64)
    assert rep.ok, rep.problems
    assert read_settings(data)["engine"] == "synthetic"
    summary = train(TrainConfig(data=str(data), out_dir=str(tmp_path / "run"), max_steps=2,
                                **{**TINY_DRAFTER, "tokens_per_batch": 128}))
    assert summary["train_steps"] == 2 and summary["train_samples_skipped"] == 0
    # the same data for a target of another geometry is refused, naming it
    other = make_head_only(tmp_path / "other", head_only, {**SMALL, "hidden_size": 32})
    with pytest.raises(Exception, match="hidden size"):
        train(TrainConfig(data=str(data), target=str(other), out_dir=str(tmp_path / "run2"), max_steps=1,
                          **TINY_DRAFTER))


def test_the_synthetic_last_slot_is_pre_norm_by_value_at_kimis_hidden_size():
    """The trainer's post-norm probe (``doctor.post_norm_share``) sees the synthetic last slot as pre-norm at Kimi's
    hidden 7168, against the head-only target's norm weight (ones), where plain N(0, 1) rows, RMS 1 within 1 %, look
    like the norm's output and are refused."""
    import torch

    from eagle3kit.doctor import post_norm_share

    hidden = KIMI_K25_TEXT["hidden_size"]
    ones = torch.ones(hidden, dtype=torch.bfloat16)
    states = random_states(64, 4, hidden, torch.Generator().manual_seed(0))
    assert states.shape == (64, 4, hidden) and states.dtype == torch.bfloat16
    assert post_norm_share(states[:, -1], ones) < 0.5
    plain = torch.randn(64, hidden, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert post_norm_share(plain, ones) > 0.5
