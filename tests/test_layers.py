"""The layer doctor: every row of the conventions table, the Kimi case, pre/post-norm, and its diagnoses."""
import pytest

from eagle3kit.layers import (NotExpressible, check, describe, from_input_of_layer, sglang_convention,
                              sglang_default_aux, to_input_of_layer)


@pytest.mark.parametrize("convention,ids,expected", [
    ("input_of_layer", [2, 15, 27, 30], [2, 15, 27, 30]),
    ("speculators", [2, 15, 27, 30], [2, 15, 27, 30]),  # speculators/vLLM: input of layer k, L = final pre-norm
    ("vllm", [2, 15, 27], [2, 15, 27]),
    ("eagle", [2, 15, 27], [2, 15, 27]),  # SafeAILab: input of layers 2, L//2, L-3
    ("hf_hidden_states", [2, 15, 27], [2, 15, 27]),
    ("sglang_llama", [1, 14, 26], [2, 15, 27]),  # SGLang Llama/Qwen always +1 (output of layer k)
    ("specforge", [1, 14, 26], [2, 15, 27]),  # SpecForge: output-of-layer convention
    ("sglang_deepseek", [1, 14, 26], [2, 15, 27]),  # DeepSeek: +1 only when ids[0] == 1
    ("sglang_deepseek", [2, 15, 27], [2, 15, 27]),
])
def test_conventions_table(convention, ids, expected):
    assert to_input_of_layer(ids, convention, 30) == expected


def test_kimi_3_31_59_on_sglang_deepseek_means_outputs_of_2_30_58():
    assert sglang_convention("kimi_k2") == "sglang_deepseek" == sglang_convention("deepseek_v3")
    served = to_input_of_layer([3, 31, 59], "sglang_deepseek", 61)
    assert served == [3, 31, 59]
    assert [describe(k, 61) for k in served] == [f"the output of layer {k - 1} (input of layer {k})" for k in served]
    assert [k - 1 for k in served] == [2, 30, 58]
    # the same ids on a Llama-type target would be read +1: outputs of layers 3, 31, 59
    assert to_input_of_layer([3, 31, 59], "sglang_llama", 61) == [4, 32, 60]


def test_sglang_default_and_limits():
    assert sglang_default_aux(30) == [2, 15, 27] and sglang_default_aux(61) == [2, 30, 58]
    assert from_input_of_layer([2, 15, 27], "sglang_llama", 30) == [1, 14, 26]
    with pytest.raises(NotExpressible):
        from_input_of_layer([30], "sglang_llama", 30)  # SGLang Llama captures outputs of layers 0..L-2 only
    with pytest.raises(NotExpressible):
        from_input_of_layer([1, 15, 27], "sglang_deepseek", 30)  # ids starting with 1 get +1
    for conv in ("sglang_llama", "sglang_deepseek", "speculators"):
        for ids in ([2, 15, 27], [3, 16, 28]):
            assert to_input_of_layer(from_input_of_layer(ids, conv, 30), conv, 30) == ids
    with pytest.raises(ValueError, match="unknown layer-id convention"):
        to_input_of_layer([1], "vllm2", 30)


def test_check_finds_offset_and_gives_the_fix():
    capture = [2, 15, 27, 30]
    ok = check(capture, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}, "llama", 30)
    assert ok.ok
    bad = check(capture, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}}, "llama", 30)
    assert not bad.ok and "offset [1]" in str(bad) and "[1, 14, 26]" in str(bad)
    default = check(capture, {}, "llama", 30)  # no ids: SGLang's default [2, L//2, L-3] as input of layer
    assert default.ok and "default" in str(default)
    kimi = check([3, 31, 59, 61], {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [3, 31, 59]}}, "kimi_k2", 61)
    assert kimi.ok
    kimi_wrong = check([2, 30, 58, 61], {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [3, 31, 59]}},
                       "kimi_k2", 61)
    assert not kimi_wrong.ok and "[2, 30, 58]" in str(kimi_wrong)


def test_check_pre_vs_post_norm_and_norm_before_residual():
    post = check([2, 15, 27, 30], {}, "llama", 30, final_is_pre_norm=False)
    assert not post.ok and "after the norm" in str(post)
    missing_final = check([2, 15, 27], {}, "llama", 30)
    assert not missing_final.ok
    # options SGLang 0.5.14 does not read: the export would run another network, so the doctor refuses it
    for cfg in ({"norm_before_residual": True}, {"norm_before_fc": True}, {"sliding_window": 2048},
                {"transformer_layer_config": {"layer_types": ["sliding_attention"], "sliding_window": 512}},
                {"transformer_layer_config": {"norm_before_residual": True}}):
        assert not check([2, 15, 27, 30], cfg, "llama", 30).ok, cfg
    for cfg in ({"fc_norm": True, "norm_output": True}, {"norm_before_residual": False, "norm_before_fc": False},
                # speculators' full-attention recipe: a window beside layer_types that say full attention
                {"transformer_layer_config": {"sliding_window": 2048, "use_sliding_window": False,
                                              "layer_types": ["full_attention"]}},
                {"transformer_layer_config": {"sliding_window": 4096, "use_sliding_window": False}}):
        assert check([2, 15, 27, 30], cfg, "llama", 30).ok, cfg


def test_ids_sglang_cannot_capture_are_flagged_not_read_past_the_model():
    """SGLang captures inside its layer loop (i < L): the last layer's output is out of reach. A config naming it
    (Llama [1, 14, 29] on 30 layers, DeepSeek [2, 31, 61] on 61) was read as input_of_layer 30 or 61 and passed."""
    for conv, ids, n in (("sglang_llama", [1, 14, 29], 30), ("sglang_deepseek", [2, 31, 61], 61)):
        with pytest.raises(ValueError, match="SGLang captures the inputs of layers"):
            to_input_of_layer(ids, conv, n)
    assert to_input_of_layer([2, 15, 30], "speculators", 30) == [2, 15, 30]  # the final state: a capture's last slot
    bad = check([2, 15, 27, 30], {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 29]}}, "llama", 30)
    assert not bad.ok and "[1, 14, 26]" in str(bad)  # the fix: the ids that feed what it was trained on
    kimi = check([2, 31, 60, 61], {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 31, 61]}}, "kimi_k2", 61)
    assert not kimi.ok and "inputs of layers 0..60" in str(kimi)


def test_doctor_command_reports_and_exits_nonzero_on_mismatch(tmp_path, target_path, capsys):
    import json

    from eagle3kit.cli import main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}}))
    assert main(["doctor", "--target", str(target_path), "--capture-layers", "2", "15", "27",
                 "--drafter-config", str(cfg)]) == 1
    assert "eagle_aux_hidden_state_layer_ids = [1, 14, 26]" in capsys.readouterr().out
    cfg.write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}))
    assert main(["doctor", "--target", str(target_path), "--capture-layers", "2", "15", "27",
                 "--drafter-config", str(cfg)]) == 0


def test_doctor_prints_the_serving_command_only_for_a_drafter_it_passes(tmp_path, target_path, capsys):
    """A drafter the doctor passes comes with the SGLang command that serves it (its chain as trained, the prefill on
    SGLang's breakable graph); one fed the wrong layers gets the fix and no command."""
    import json
    import shlex

    from eagle3kit.acceptance import breakeven as B
    from eagle3kit.cli import main

    d = B.untrained_drafter(target_path, tmp_path / "untrained", 512)
    assert main(["doctor", "--drafter", str(d)]) == 0
    cmd = shlex.split(capsys.readouterr().out.strip().splitlines()[-1])
    assert cmd[:3] == ["python", "-m", "sglang.launch_server"]
    flag = {cmd[i]: cmd[i + 1] for i in range(3, len(cmd) - 1, 2)}
    assert flag["--model-path"] == str(target_path) and flag["--speculative-draft-model-path"] == str(d)
    assert (flag["--speculative-algorithm"], flag["--speculative-num-steps"], flag["--speculative-eagle-topk"],
            flag["--speculative-num-draft-tokens"], flag["--cuda-graph-backend-prefill"]) == ("EAGLE3", "3", "1", "4",
                                                                                             "breakable")
    meta = json.loads((d / "eagle3kit.json").read_text())
    (d / "eagle3kit.json").write_text(json.dumps({**meta, "train": {"serving_steps": 7}}))
    assert main(["doctor", "--drafter", str(d)]) == 0
    cmd = shlex.split(capsys.readouterr().out.strip().splitlines()[-1])
    steps, drafts = (cmd[cmd.index(f) + 1] for f in ("--speculative-num-steps", "--speculative-num-draft-tokens"))
    assert (steps, drafts) == ("7", "8")  # the chain it was trained for
    cfg = json.loads((d / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 15, 27]  # one layer off: SGLang feeds 3, 16, 28
    (d / "config.json").write_text(json.dumps(cfg))
    assert main(["doctor", "--drafter", str(d)]) == 1
    out = capsys.readouterr().out
    assert "[1, 14, 26]" in out and "sglang.launch_server" not in out
