"""The break-even benchmark's pure parts (acceptance.breakeven; the servers run on the GPU,
benchmarks/spec_breakeven.py): the untrained drafter SGLang would load, the settings and servers planned, and the
break-even taken per round from the timings."""
import pytest

from eagle3kit.acceptance import breakeven as B


def test_the_untrained_drafter_is_an_export_sglang_loads_and_the_doctor_passes(tmp_path, target_path):
    import json

    from eagle3kit.doctor import diagnose
    from eagle3kit.drafter.export import load_sglang_export

    d = B.untrained_drafter(target_path, tmp_path / "untrained", 512)
    model, cfg, meta = load_sglang_export(d)  # refuses tensors SGLang would drop or leave uninitialised
    assert cfg["draft_vocab_size"] == 512 and cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert meta["untrained"] is True and meta["capture_layer_ids"] == [2, 15, 27, 30]  # SGLang's default layers
    assert diagnose(d).ok  # the layer ids SGLang reads feed the layers it was built for
    assert json.loads((d / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]


@pytest.mark.parametrize("target", ["embedded:deepseek-v3-tiny", "embedded:kimi-k25-tiny"])
def test_the_untrained_drafter_of_the_users_family_is_read_by_the_deepseek_rule(tmp_path, target):
    """For a DeepSeek-V3 or Kimi-K2.5 target the export's ids are the input-of-layer ids themselves (SGLang's
    deepseek_v2.py adds 1 only when the first id is 1), and the doctor passes it."""
    import json

    from eagle3kit.doctor import diagnose
    from eagle3kit.target import resolve_target

    d = B.untrained_drafter(resolve_target(target), tmp_path / "untrained", 1024)
    assert json.loads((d / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert diagnose(d).ok


@pytest.mark.parametrize("text, want", [("3,1,4", (3, 1, 4)), (" 5,4,8 ", (5, 4, 8)), ("1,1,2", (1, 1, 2))])
def test_settings_parse(text, want):
    assert B.parse_setting(text) == want


@pytest.mark.parametrize("text, why", [("3,1,5", "verifies 4 draft tokens"), ("0,1,1", "at least"),
                                       ("3-1-4", "steps,topk,draft_tokens"), ("3,1", "steps,topk,draft_tokens")])
def test_settings_that_sglang_would_not_run_as_meant_are_refused(text, why):
    with pytest.raises(ValueError, match=why):
        B.parse_setting(text)


def test_plan_gives_each_variant_its_plain_server_and_one_per_setting():
    fi = ["--attention-backend", "flashinfer"]
    servings = B.plan("/d", ["3,1,4", (5, 4, 8)], {"base": [], "fi": fi})
    assert [s.name for s in servings] == ["plain-base", "base-3-1-4", "base-5-4-8", "plain-fi", "fi-3-1-4", "fi-5-4-8"]
    by = {s.name: s for s in servings}
    assert by["plain-fi"].drafter is None and by["plain-fi"].args() == fi
    assert by["fi-5-4-8"].args()[-2:] == fi and "--speculative-eagle-topk" in by["fi-5-4-8"].args()
    with pytest.raises(ValueError, match="letters and digits"):
        B.plan("/d", ["3,1,4"], {"my-variant": []})
    with pytest.raises(ValueError, match="no variant"):
        B.plan("/d", ["3,1,4"], {})


def test_a_server_given_twice_is_refused_before_any_starts(tmp_path, monkeypatch):
    """A setting listed twice made two servers of one name: the second replaced the first in the servers' dict, so
    the first was never stopped and held its GPU memory and port after the run."""
    from eagle3kit.acceptance import online
    from eagle3kit.capture import server

    started = []
    monkeypatch.setattr(server.SGLangServer, "start", lambda self: started.append(self) or self)
    with pytest.raises(ValueError, match=r"servers \['base-3-1-4'\] are given twice"):
        online.start_servers("/t", B.plan("/d", ["3,1,4", "7,1,8", "3,1,4"], {"base": []}), tmp_path, stagger=0)
    assert started == []


def test_a_server_that_did_not_start_costs_its_variant_not_the_run():
    servings = B.plan("/d", ["3,1,4", "5,1,6"], {"base": [], "compile": ["--enable-torch-compile"]})
    names = lambda failed: [s.name for s in B.measurable(servings, failed)]  # noqa: E731
    assert names([]) == [s.name for s in servings]
    assert names(["compile-5-1-6"]) == ["plain-base", "base-3-1-4", "base-5-1-6", "plain-compile", "compile-3-1-4"]
    # without its own plain server a variant's speculative ones have nothing to be timed against
    assert names(["plain-compile"]) == ["plain-base", "base-3-1-4", "base-5-1-6"]
    assert not [s for s in B.measurable(servings, ["plain-base", "plain-compile"]) if s.drafter]


def _rounds(tps, accept=None):
    return {1: {"rounds": [{"output_tokens_per_s": t, **({"accept_length": a} if accept else {})}
                           for t, a in zip(tps, accept or [None] * len(tps))]}}


def test_breakeven_is_taken_per_round_as_cycle_over_plain_step():
    """Round i of a speculative server against round i of its variant's plain one: 700 tokens/s plain, 250 with
    1.0 accepted a cycle, is a cycle of 4 ms against 1.43 ms a token: break-even 2.8."""
    servings = B.plan("/d", ["3,1,4", "7,1,8"], {"base": []})
    measured = {"plain-base": _rounds([700.0, 720.0, 680.0]),
                "base-3-1-4": _rounds([250.0, 240.0, 272.0], [1.0, 1.0, 1.0]),
                "base-7-1-8": _rounds([200.0, 0.0, 170.0], [1.1, 1.1, 1.0])}  # a round without tokens is left out
    m, table = B.summarize(measured, servings)
    assert m["breakeven_base_3_1_4_rounds"] == pytest.approx([2.8, 3.0, 2.5])
    assert m["breakeven_base_3_1_4"] == pytest.approx(2.8)
    assert m["breakeven_base_3_1_4_spread"] == pytest.approx(0.5 / 2.8)
    assert m["cycle_ms_base_3_1_4"] == pytest.approx(4.0) and m["plain_ms_per_token_base_3_1_4"] == pytest.approx(1000 / 700)
    assert m["breakeven_base_7_1_8_rounds"] == pytest.approx([1.1 * 700 / 200, 1.0 * 680 / 170])
    assert m["breakeven_best_setting"] == "base (3,1,4)" and m["breakeven_best"] == pytest.approx(2.8)
    assert [r["setting"] for r in table] == ["(3,1,4)", "(7,1,8)"]
    # a server that never produced a round is absent, not a zero
    m2, _ = B.summarize({"plain-base": _rounds([700.0]), "base-3-1-4": {}}, servings[:2])
    assert m2 == {}


def test_the_best_setting_beats_the_fastest_plain_server_not_only_its_own():
    """gpu-breakeven-sync: --disable-overlap-schedule slowed plain (2.10 ms a token against 1.65), not the cycle
    (3.97 ms against 3.99): 1.89 against its own plain, yet no faster than the default against the default plain."""
    servings = B.plan("/d", ["3,1,4"], {"base": [], "sync": ["--disable-overlap-schedule"]})
    measured = {"plain-base": _rounds([1000 / 1.65] * 3), "base-3-1-4": _rounds([1000 / 3.99] * 3, [1.0] * 3),
                "plain-sync": _rounds([1000 / 2.10] * 3), "sync-3-1-4": _rounds([1000 / 3.97] * 3, [1.0] * 3)}
    m, table = B.summarize(measured, servings)
    assert m["breakeven_sync_3_1_4"] == pytest.approx(3.97 / 2.10)  # against its own variant's plain: lower ...
    assert m["breakeven_sync_3_1_4"] < m["breakeven_base_3_1_4"]
    assert m["breakeven_vs_fastest_plain_sync_3_1_4"] == pytest.approx(3.97 / 1.65)
    assert m["fastest_plain"] == "plain-base" and m["fastest_plain_ms_per_token"] == pytest.approx(1.65)
    assert m["breakeven_best"] == pytest.approx(3.97 / 1.65) and m["breakeven_best_setting"] == "sync (3,1,4)"
    assert [r["vs fastest plain"] for r in table] == pytest.approx([3.99 / 1.65, 3.97 / 1.65])


def test_chat_prompts_are_first_user_turns_with_the_generation_prompt(tokenizer):
    from eagle3kit.acceptance.online import chat_prompts

    prompts = chat_prompts(tokenizer, 5, max_prompt_tokens=300)
    assert len(prompts) == 5 and all(0 < len(p) <= 300 for p in prompts)
    for p in prompts:
        text = tokenizer.decode(p)
        assert text.rstrip().endswith("assistant") and text.count("<|im_start|>user") >= 1, text[-80:]
    with pytest.raises(ValueError, match="only"):
        chat_prompts(tokenizer, 3, max_prompt_tokens=5)


@pytest.mark.parametrize("args, why", [(["--settings", "3,1,5"], "verifies 4 draft tokens"),
                                       (["--variants", "{a"], "is not JSON"),
                                       (["--variants", "[1]"], "JSON object"),
                                       (["--variants", '{"a-b": []}'], "letters and digits")])
def test_the_benchmark_refuses_bad_settings_before_anything_is_built(tmp_path, capsys, args, why):
    import importlib.util

    from tests.conftest import ROOT

    spec = importlib.util.spec_from_file_location("spec_breakeven", ROOT / "benchmarks" / "spec_breakeven.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--out", str(tmp_path / "out"), *args]) == 2
    assert why in capsys.readouterr().err
    assert not (tmp_path / "out" / "untrained-drafter").exists()


def test_the_untrained_drafter_takes_the_trained_ones_shape_from_its_export(tmp_path, target_path):
    import json

    trained = B.untrained_drafter(target_path, tmp_path / "trained", 1000, [3, 14, 26])  # stands for a trained export
    got = B.untrained_like(trained, str(target_path), tmp_path / "untrained")
    meta = json.loads((got / "eagle3kit.json").read_text())
    assert meta["draft_vocab_size"] == 1000 and meta["capture_layer_ids"] == [3, 14, 26, 30] and meta["untrained"]
    cfg = json.loads((got / "config.json").read_text())
    assert cfg == json.loads((trained / "config.json").read_text())  # what SGLang reads: the same shape
    with pytest.raises(ValueError, match="not an eagle3kit SGLang export.*export the drafter with eagle3kit"):
        B.untrained_like(tmp_path, str(target_path), tmp_path / "x")



def test_replies_of_two_lengths_give_each_server_its_marginal_cycle_and_fixed_cost():
    """Plain: 20 ms a request + 1.25 ms a step; the untrained drafter's server: 40 ms + 3.3 ms a cycle, one token a
    cycle. Over whole requests the cycle looks longer than 3.3 ms; the fit over replies of 64 and 256 tokens gives it."""
    from eagle3kit.plots import table

    def timed(fixed, per, spec):
        reqs = [(n, (fixed + per * (n - 1)) / 1000) for n in [64, 256] * 3]
        toks, secs = sum(n for n, _ in reqs), sum(t for _, t in reqs)
        r = {"output_tokens_per_s": toks / secs, "per_request_time": [list(x) for x in reqs]}
        if spec:
            r.update(accept_length=1.0, per_request=[[n - 1, 0] for n, _ in reqs])
        return {1: {"rounds": [r]}}

    servings = B.plan("/d", ["3,1,4"], {"base": []})
    m, rows = B.summarize({"plain-base": timed(20, 1.25, False), "base-3-1-4": timed(40, 3.3, True)}, servings)
    assert m["cycle_marginal_ms_base_3_1_4"] == pytest.approx(3.3) and m["request_fixed_ms_base_3_1_4"] == pytest.approx(40)
    assert m["plain_request_fixed_ms_base_3_1_4"] == pytest.approx(20)
    assert m["breakeven_marginal_base_3_1_4"] == pytest.approx(3.3 / 1.25)
    assert m["plain_step_marginal_ms_base_3_1_4"] == pytest.approx(1.25) and m["request_fixed_ms_se_base_3_1_4"] < 1e-6
    # a server whose fit runs backwards (noise over too few requests) gets no marginal break-even, as in 05
    m2, rows2 = B.summarize({"plain-base": timed(20, 1.25, False), "base-3-1-4": timed(400, -0.5, True)}, servings)
    assert "breakeven_marginal_base_3_1_4" not in m2 and "breakeven_base_3_1_4" in m2
    # the table's columns are every row's, not the first row's: a later setting's fit is shown
    two = B.plan("/d", ["3,1,4", "5,1,6"], {"base": []})
    m3, rows3 = B.summarize({"plain-base": timed(20, 1.25, False), "base-3-1-4": timed(400, -0.5, True),
                             "base-5-1-6": timed(40, 3.3, True)}, two)
    assert "marginal break-even" not in rows3[0] and "marginal break-even" in table(rows3)
    assert "marginal break-even" in table(rows) and "40 (20)" in table(rows)
    assert not any("first_token" in k for k in m) and "first token" not in table(rows)
    probed = {"plain-base": timed(20, 1.25, False), "base-3-1-4": timed(40, 3.3, True)}
    for name, ms, server in (("plain-base", 12.0, 0.010), ("base-3-1-4", 30.0, 0.027)):
        probed[name][1]["rounds"][0]["first_token"] = {"seconds": [ms / 1000] * 3, "server_seconds": [server] * 3}
    m, rows = B.summarize(probed, servings)
    assert m["first_token_ms_base_3_1_4"] == pytest.approx(30) and m["plain_first_token_ms_base_3_1_4"] == pytest.approx(12)
    assert m["first_token_server_ms_base_3_1_4"] == pytest.approx(27)
    assert m["plain_first_token_server_ms_base_3_1_4"] == pytest.approx(10)
    assert "30.0 (12.0)" in table(rows)
    probed["base-3-1-4"][1]["rounds"][0]["first_token"] = {"error": "HTTPError: 500"}  # the probe failed there
    m, rows = B.summarize(probed, servings)
    assert m["first_token_error_base_3_1_4"] == "HTTPError: 500" and "first_token_ms_base_3_1_4" not in m
    assert "breakeven_base_3_1_4" in m  # the timed figures stand
