"""``eagle3kit doctor``: will SGLang feed a drafter the hidden states it was trained on?

Reads an exported drafter (``config.json`` as SGLang reads it, ``eagle3kit.json`` with what it was trained on) and
optionally the training data, and checks: the layer ids SGLang will capture for this target family against the
training layers (``layers.check``), options SGLang 0.5.14 ignores (norm_before_residual, norm_before_fc, sliding
window), the final slot (pre-norm, by the data set's record and by the values themselves).
"""
from __future__ import annotations

import json
from pathlib import Path

from eagle3kit.layers import Diagnosis, Finding, check, post_norm_share
from eagle3kit.drafter.tensors import mla_expected_tensors  # noqa: F401 - the MLA head's table (tests read it here)


def diagnose(drafter_dir, target=None, data=None, probe: int = 4) -> Diagnosis:
    from eagle3kit.target import TargetInfo, resolve_target

    drafter_dir = Path(drafter_dir)
    try:
        cfg = json.loads((drafter_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{drafter_dir / 'config.json'}: not a readable drafter config ({e}). Fix: pass the folder "
                         f"`eagle3kit train` exported (best/ or final/)") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{drafter_dir / 'config.json'}: a JSON {type(cfg).__name__}, not the drafter config (an "
                         f"object). Fix: pass the folder `eagle3kit train` exported (best/ or final/)")
    meta_path = drafter_dir / "eagle3kit.json"
    try:
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    except (OSError, ValueError) as e:
        raise ValueError(f"{meta_path}: not readable JSON ({e}). Fix: export the drafter again") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path}: a JSON {type(meta).__name__}, not an object. Fix: export the drafter again")
    target = target or meta.get("target")
    if not target:
        raise ValueError(f"{drafter_dir}: no eagle3kit.json naming the target: pass --target")
    info = TargetInfo.read(resolve_target(target))
    capture = meta.get("capture_layer_ids")
    if not capture:
        raise ValueError(f"{drafter_dir}: eagle3kit.json does not record the training layers: pass --capture-layers")
    # teacher_exact: the teacher saw the target's logits (a recorded post-norm slot taken as it is counts); older
    # exports only say whether the slot was pre-norm
    exact = meta.get("teacher_exact", meta.get("final_pre_norm", True))
    if cfg.get("speculators_model_type"):  # speculators' own checkpoint (eagle3kit export speculators): what vLLM
        # loads, its ids in the input_of_layer convention; SGLang 0.5.14 loads LlamaForCausalLMEagle3 exports only
        d = check(capture, cfg, info.model_type, info.num_layers, engine="vllm", final_is_pre_norm=bool(exact))
        d.findings.append(Finding("error", f"{drafter_dir} is a speculators checkpoint ({cfg['speculators_model_type']}"
                                  f"): vLLM serves it, SGLang 0.5.14 cannot load it",
                                  "for SGLang: `eagle3kit export sglang` (its ids are converted for the target)"))
        return d
    d = check(capture, cfg, info.model_type, info.num_layers, final_is_pre_norm=bool(exact))
    d.findings.extend(check_options(cfg, meta))
    if (cfg.get("architectures") or [""])[0] == MLA_ARCH:
        d.findings.extend(check_mla(drafter_dir, cfg))
    d.findings.extend(check_weights(drafter_dir, cfg, info, meta))
    if data:
        d.findings.extend(check_data(data, target, probe).findings)
    return d


def check_weights(drafter_dir: Path, cfg: dict, info, meta: dict) -> list[Finding]:
    """The config against the target it serves beside (the aux states are the target's, the vocabulary its), and
    every tensor of the safetensors files against what SGLang builds from the config (``drafter.tensors``)."""
    from eagle3kit.drafter.tensors import check_files

    fix = "export the drafter again from its training (`eagle3kit export sglang RUN DEST`), and do not edit it"
    out = []
    h_in = cfg.get("target_hidden_size", cfg.get("hidden_size"))
    if h_in != info.hidden_size:
        key = "target_hidden_size" if "target_hidden_size" in cfg else "hidden_size"
        out.append(Finding("error", f"{drafter_dir / 'config.json'}: {key}={h_in!r}, but the target's hidden states "
                           f"are {info.hidden_size} wide ({info.path})", fix))
    if cfg.get("vocab_size") != info.vocab_size:
        out.append(Finding("error", f"{drafter_dir / 'config.json'}: vocab_size={cfg.get('vocab_size')!r}, the "
                           f"target's vocabulary is {info.vocab_size} ({info.path})", fix))
    dv = cfg.get("draft_vocab_size")
    if dv is None or (meta.get("draft_vocab_size") is not None and dv != meta["draft_vocab_size"]):
        out.append(Finding("error", f"{drafter_dir / 'config.json'}: draft_vocab_size={dv!r}, the drafter was "
                           f"trained with {meta.get('draft_vocab_size')} (eagle3kit.json)", fix))
    problems = check_files(drafter_dir, cfg)
    out.extend(Finding(level, what, fix) for level, what in problems)
    if not problems:
        out.append(Finding("ok", f"{drafter_dir}: every tensor SGLang 0.5.14 builds from config.json is there, of its "
                           f"shape and dtype, nothing else, every file read to its end"))
    return out


PREFILL_GRAPH = ["--cuda-graph-backend-prefill", "breakable"]  # SGLang 0.5.14 prefills an EAGLE target eagerly on
# its default piecewise graph; on the breakable one the target's and the draft's prefills run on a graph: a trained
# drafter's first token 39.9 -> 23.8 ms, whole requests 0.78x -> 0.84x plain at batch 1, every prompt's verify count
# and accepted drafts unchanged (outputs/records/gpu-drafter-pipeline-15)


def serving_command(drafter_dir, target=None) -> list[str]:
    """The SGLang command that serves an exported drafter as 05 measured it best: its target (``target``, else the
    one it was trained on), a chain of the training's ``serving_steps`` (else 3), topk 1, steps + 1 draft tokens, the
    prefill on a graph (``PREFILL_GRAPH``). The server's own flags (``--tp``, memory, ports) are the user's to add."""
    from eagle3kit.acceptance.online import Serving
    from eagle3kit.target import resolve_target

    meta_path = Path(drafter_dir) / "eagle3kit.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    steps = int((meta.get("train") or {}).get("serving_steps") or 3)
    main = Serving("main", str(drafter_dir), steps, 1, steps + 1, PREFILL_GRAPH)
    return ["python", "-m", "sglang.launch_server", "--model-path", str(resolve_target(target or meta["target"])),
            *main.args()]


PRE_NORM, POST_NORM_RECORDED, POST_NORM_UNRECORDED, RECORD_CONTRADICTED = (
    "pre_norm", "post_norm_recorded", "post_norm_unrecorded", "record_contradicted")


def final_slot(source, norm_weight, probe: int = 4) -> tuple[str, float]:
    """(verdict, share of probed tokens that look normed) on a captured source's last slot, by record and by value:
    ``pre_norm`` (the last layer's output before the final norm: the teacher norms it), ``post_norm_recorded`` (the
    norm's output, recorded ``final_slot: post_norm``, a capture inside SGLang's prefill graph: the teacher takes it as
    it is), ``post_norm_unrecorded`` (the norm's output with no record, e.g. another engine's states: normed again by
    a teacher) or ``record_contradicted`` (recorded post-norm, but the values are not the norm's output)."""
    from eagle3kit.drafter.data import SampleError

    shares = []
    for i in range(len(source)):
        if len(shares) == probe:
            break
        try:  # a bad sample is the loader's to count and skip; probe the readable ones
            shares.append(post_norm_share(source.load(i)["hidden_states"][:, -1], norm_weight))
        except SampleError:
            continue
    share = max(shares) if shares else 0.0
    if source.info().final_pre_norm is False:
        return (POST_NORM_RECORDED if share > 0.5 else RECORD_CONTRADICTED), share
    return (POST_NORM_UNRECORDED if share > 0.5 else PRE_NORM), share


def check_data(data, target, probe: int = 4) -> Diagnosis:
    """The final slot of a captured data set holds the state before the final norm (by record and by value)."""
    from eagle3kit.drafter.data import open_source
    from eagle3kit.drafter.model import TargetHead
    from eagle3kit.target import resolve_target

    d = Diagnosis()
    verdict, share = final_slot(open_source(data, None), TargetHead.from_target(resolve_target(target)).norm_weight,
                                probe)
    if verdict == POST_NORM_RECORDED:
        d.findings.append(Finding("ok", f"{data}: the final slot holds the final norm's output, as recorded "
                                  f"(final_slot post_norm: a capture inside SGLang's prefill graph; {share:.0%} of "
                                  f"probed tokens look normed); eagle3kit's teacher takes it as it is (speculators' "
                                  f"own trainer and its export would apply the norm again)"))
    elif verdict == POST_NORM_UNRECORDED:
        d.findings.append(Finding("error", f"{data}: the final slot holds post-norm states ({share:.0%} of probed tokens "
                                  f"have RMS(state / norm weight) = 1; recorded as pre-norm); a trainer that applies "
                                  f"the target's norm (speculators, eagle3kit) learns from twice-normed logits",
                                  "capture the last layer's output before the final norm (eagle3kit's final slot)"))
    elif verdict == RECORD_CONTRADICTED:
        d.findings.append(Finding("error", f"{data}: recorded final_slot post_norm, but only {share:.0%} of probed "
                                  f"tokens have RMS(state / norm weight) = 1: not the target's final norm outputs",
                                  "check the data set against the target it was captured from"))
    else:
        d.findings.append(Finding("ok", f"{data}: the final slot is the pre-norm state ({share:.0%} of probed tokens "
                                  f"look normed)"))
    return d


MLA_ARCH = "Eagle3DeepseekV2ForCausalLM"


def check_options(cfg: dict, meta: dict) -> list:
    """EAGLE-3.1 options in the config against the training's: SGLang reads fc_norm / norm_output from config.json
    and runs whatever it says (a flipped norm_output feeds the next draft step another state than training did)."""
    train = meta.get("train") or {}
    if not train:
        return []
    want = {"fc_norm": bool(train.get("fc_norm") or train.get("eagle31")),
            "norm_output": bool(train.get("norm_output") or train.get("eagle31"))}
    got = {"fc_norm": bool(cfg.get("fc_norm") or cfg.get("use_aux_norm")), "norm_output": bool(cfg.get("norm_output"))}
    bad = [k for k in want if want[k] != got[k]]
    if bad:
        return [Finding("error", f"config.json says {', '.join(f'{k}={got[k]}' for k in bad)}, the drafter was trained "
                        f"with {', '.join(f'{k}={want[k]}' for k in bad)}: SGLang runs what config.json says",
                        f"set {', '.join(f'{k}: {str(want[k]).lower()}' for k in bad)} in config.json")]
    return [Finding("ok", f"fc_norm={got['fc_norm']}, norm_output={got['norm_output']} as in training")]


def check_mla(drafter_dir, cfg: dict) -> list:
    """An MLA export against what SGLang 0.5.14 builds: the options it would run otherwise (any rope scaling runs as
    DeepSeek-YaRN, a tied lm_head is the embeddings) and every tensor's name, shape and dtype (a name it does not
    know is skipped with only a warning; a tensor it lacks stays uninitialised)."""
    from safetensors import safe_open

    from eagle3kit.drafter.mla import ROPE_TYPES

    out = []
    missing = [k for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
               if not cfg.get(k)]
    if missing or cfg.get("num_hidden_layers") != 1:
        return [Finding("error", f"{drafter_dir}: {MLA_ARCH} needs num_hidden_layers 1 and {missing or 'the MLA keys'}"
                        f" (SGLang refuses to load it)", "export with `eagle3kit export sglang`")]
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rtype = rope.get("rope_type") or rope.get("type") or "default"
    if rtype not in ROPE_TYPES:
        out.append(Finding("error", f"rope_type {rtype!r}: SGLang runs any rope scaling of this head as DeepSeek-YaRN",
                           "train with default or yarn rope"))
    if cfg.get("tie_word_embeddings"):
        out.append(Finding("error", "tie_word_embeddings true: SGLang makes the draft's lm_head its (the target's) "
                           "embeddings", "set tie_word_embeddings: false"))
    if cfg.get("draft_vocab_size") is None:
        out.append(Finding("error", "no draft_vocab_size: SGLang loads the draft's lm_head from the target",
                           "write draft_vocab_size"))
    try:
        with safe_open(str(Path(drafter_dir) / "model.safetensors"), framework="pt") as f:
            have = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - the user's file, named with the fix
        return out + [Finding("error", f"{drafter_dir}/model.safetensors: unreadable ({type(e).__name__})",
                              "export again")]
    want = mla_expected_tensors(cfg)
    dtype_names = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "I64": "int64"}
    lacking = sorted(set(want) - set(have))
    skipped = sorted(set(have) - set(want) - {"t2d", "embed_tokens.weight"})
    wrong = sorted(k for k in set(want) & set(have) if have[k][0] != want[k][0]
                   or dtype_names.get(have[k][1], have[k][1]) != want[k][1])
    if lacking:
        out.append(Finding("error", f"SGLang would leave {lacking} uninitialised", "export again"))
    if skipped:
        out.append(Finding("error", f"SGLang would skip {skipped} (unknown names: a warning only)",
                           "export with `eagle3kit export sglang`"))
    if wrong:
        out.append(Finding("error", "shape or dtype differ from what SGLang builds: " + ", ".join(
            f"{k} {have[k]} vs {want[k]}" for k in wrong), "export again from the trained drafter"))
    if not (lacking or skipped or wrong):
        out.append(Finding("ok", f"all {len(want)} tensors are the ones {MLA_ARCH} loads (names, shapes, dtypes)"))
    return out
