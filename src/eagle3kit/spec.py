"""Checks the capture spec notebook makes: captured states against the reference engine, layer identification,
probe prompts. Pure functions over capture files and reference tensors."""
from __future__ import annotations

import random
from pathlib import Path

import torch

from eagle3kit.capture.format import read_sample
from eagle3kit.layers import identify, token_rel_err


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def probe_prompts(tokenizer, n: int, min_len: int, max_len: int, seed: int = 0, data: str = "embedded:sharegpt"):
    """``n`` real chat prompts (ShareGPT user turns in the chat template) cut to random lengths in [min, max]."""
    from eagle3kit.data.conversations import load_conversations
    from eagle3kit.data.render import render

    convs, _ = load_conversations(data, limit=4 * n + 16)
    rng = random.Random(seed)
    prompts = {}
    for i, c in enumerate(convs):
        ids = render(tokenizer, c["messages"]).input_ids
        if len(ids) < min_len:
            continue
        prompts[f"p{len(prompts):03d}"] = ids[:rng.randint(min_len, min(max_len, len(ids)))]
        if len(prompts) == n:
            return prompts
    raise ValueError(f"only {len(prompts)} of {n} prompts reach {min_len} tokens in {data}")


def compare_to_reference(capture_dir, prompts: dict, reference, rank: int = 0) -> list[dict]:
    """One row per (request, slot): relative error of the capture against the reference engine's state."""
    rows = []
    for key, ids in prompts.items():
        cap, meta = read_sample(Path(capture_dir) / f"{key}.rank{rank}.safetensors")
        ref = reference.hidden(ids)
        if cap["token_ids"].tolist() != list(ids):
            rows.append({"key": key, "layer_id": -1, "rel_err": float("inf"), "token_rel_err": float("inf")})
            continue
        for j, layer in enumerate(meta["layer_ids"]):
            a, b = cap["hidden_states"][:, j], ref["hidden_states"][:, j]
            rows.append({"key": key, "layer_id": layer, "n_tokens": len(ids), "rel_err": rel_err(a, b),
                         "token_rel_err": token_rel_err(a, b)})
        if "final_normed" in cap and "final_normed" in ref:
            a, b = cap["final_normed"], ref["final_normed"]
            rows.append({"key": key, "layer_id": "final_normed", "n_tokens": len(ids), "rel_err": rel_err(a, b),
                         "token_rel_err": token_rel_err(a, b)})
    return rows


def all_reference_states(reference, ids) -> dict:
    """Every candidate state of the reference for a prompt: input_of_layer 0..L-1, final pre-norm, post-norm."""
    ref = reference.model
    with torch.no_grad():
        out = ref(input_ids=torch.tensor([ids], device=reference.device), output_hidden_states=True)
    hs = out.hidden_states
    L = reference.info.num_layers
    cands = {f"input_of_layer {k}": hs[k][0].cpu() for k in range(L)}
    cands[f"input_of_layer {L} (final, pre-norm)"] = reference._pre_norm[0].cpu()
    cands["final, post-norm"] = hs[L][0].cpu()
    return cands


def identify_slots(capture_file, reference, ids) -> list[dict]:
    """For each captured slot: which reference state it is closest to (the doctor's offset finder)."""
    cap, meta = read_sample(capture_file)
    cands = all_reference_states(reference, ids)
    out = []
    for j, layer in enumerate(meta["layer_ids"]):
        best, err, errs = identify(cap["hidden_states"][:, j], cands)
        neighbours = sorted(e for n, e in errs.items() if n != best)[:1]
        out.append({"configured": layer, "identified": best, "token_rel_err": err,
                    "next_best_token_rel_err": neighbours[0] if neighbours else float("nan")})
    return out


def observe_sglang(path, aux, prompts: dict, work: Path, server_args=(), port: int = 30200, chunk_size: int = 64,
                   decode_tokens: int = 8) -> dict:
    """Everything the capture spec asserts, observed on two real capture servers started side by side:
    one without chunked prefill, one with ``--chunked-prefill-size chunk_size`` and the radix cache on."""
    import requests

    from eagle3kit.capture.client import CaptureClient
    from eagle3kit.capture.server import capture_server

    dirs = {"plain": work / "unchunked", "chunked": work / "chunked"}
    # one GPU, two servers: each --mem-fraction-static counts what the earlier one holds, so they start in turn
    servers = {
        "plain": capture_server(path, dirs["plain"], aux, port=port, final_normed=True,
                                extra_args=[*server_args, "--chunked-prefill-size", "-1", "--mem-fraction-static",
                                            "0.2"], log_path=work / "sglang-unchunked.log"),
        "chunked": capture_server(path, dirs["chunked"], aux, port=port + 1, final_normed=True,
                                  extra_args=[*server_args, "--chunked-prefill-size", str(chunk_size),
                                              "--mem-fraction-static", "0.45"], log_path=work / "sglang-chunked.log"),
    }
    obs = {"dirs": dirs, "startup_s": {}}
    try:
        for k, s in servers.items():
            obs["startup_s"][k] = s.start().wait_healthy()
        plain = CaptureClient(servers["plain"].url, dirs["plain"])
        obs["markers"] = {m["key"]: m for m in plain.capture_many(prompts.items(), concurrency=len(prompts))}
        obs["health"] = [requests.get(servers["plain"].url + p, timeout=60).status_code
                         for p in ("/health", "/health_generate")]
        decode = {f"d{k}": ids for k, ids in list(prompts.items())[:4]}
        obs["decode_prompts"] = decode
        obs["decode_markers"] = {m["key"]: m for m in plain.capture_many(decode.items(), 4, decode_tokens)}
        bad = requests.post(servers["plain"].url + "/generate", timeout=60,
                            json={"input_ids": next(iter(prompts.values())), "rid": plain.prefix + "malformed",
                                  "sampling_params": {"max_new_tokens": 0}})
        obs["bad_rid_http"] = bad.status_code
        k0, ids0 = next(iter(prompts.items()))
        obs["after_bad_rid"] = plain.capture("after_bad_rid", ids0)
        obs["plain_status"] = plain.status()
        chunked = CaptureClient(servers["chunked"].url, dirs["chunked"])
        obs["chunk_markers"] = {m["key"]: m for m in chunked.capture_many(prompts.items(), len(prompts))}
        hit_ids = max(prompts.values(), key=len)
        obs["hit_first"] = chunked.capture("hit_first", hit_ids, isolate_cache=False)
        obs["hit_second"] = chunked.capture("hit_second", hit_ids, isolate_cache=False)
        obs["chunked_status"] = chunked.status()
    finally:
        for s in servers.values():
            s.stop()
    return obs


def observe_reference(reference, prompts: dict, work: Path, chunk_size: int = 64) -> dict:
    """The same observations on the reference engine: batched (padded) forward and KV-cache chunked forward."""
    dirs = {"plain": work / "batched", "chunked": work / "chunked"}
    batched = reference.hidden_batched(list(prompts.values()))
    markers, chunk_markers = {}, {}
    for (key, ids), t in zip(prompts.items(), batched):
        markers[key] = reference.capture(dirs["plain"], key, ids, tensors=t)
        chunk_markers[key] = reference.capture(dirs["chunked"], key, ids,
                                               tensors=reference.hidden_chunked(ids, chunk_size))
        chunk_markers[key]["chunks"] = -(-len(ids) // chunk_size)
    return {"dirs": dirs, "markers": markers, "chunk_markers": chunk_markers}


def compare_dirs(dir_a, dir_b, keys, rank: int = 0) -> float:
    """Max relative difference (whole tensor, and median per token) between two captures of the same prompts."""
    worst, worst_tok = 0.0, 0.0
    for key in keys:
        a, _ = read_sample(Path(dir_a) / f"{key}.rank{rank}.safetensors")
        b, _ = read_sample(Path(dir_b) / f"{key}.rank{rank}.safetensors")
        for j in range(a["hidden_states"].shape[1]):
            worst = max(worst, rel_err(a["hidden_states"][:, j], b["hidden_states"][:, j]))
            worst_tok = max(worst_tok, token_rel_err(a["hidden_states"][:, j], b["hidden_states"][:, j]))
    return worst, worst_tok
