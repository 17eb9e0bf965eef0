"""Offline acceptance of an exported drafter: the network SGLang loads, chained over held-out samples.

Each draft step is fed the previous step's own hidden state and the next token of the sample; on target-
regenerated data (``extract --regenerate``) those tokens are the target's greedy path, so a step counts as accepted
exactly when serving would accept it (``greedy_path_fraction`` says how closely the data follows that path).
Per position k: ``acc_pos{k}`` (accepted through k), ``cond_acc_pos{k}`` (accepted at k given accepted before);
``tau_{n} = 1 + sum_{k<n} prod_{i<=k} cond_acc_i`` for chains of n steps, bonus token included.
``walk_accept_length_{n}``: serving's own count, walking each reply round by round (``objective.serving_walk``): the
offline figure comparable with SGLang's accept length (tau weighs every position alike; serving revisits hard ones).
"""
from __future__ import annotations

from pathlib import Path

import torch


def evaluation_run(drafter_dir, data, split: str = "heldout", tokens_per_batch: int = 4096, device: str = "auto",
                   first_replies_of=None, reply_tokens: int | None = None):
    """A ``training_setup.Run`` around an exported drafter and a data set split (what ``train.evaluate`` takes);
    ``first_replies_of``, ``reply_tokens``: see ``evaluate_drafter``."""
    from eagle3kit.drafter import data as D
    from eagle3kit.drafter.export import load_sglang_export
    from eagle3kit.drafter.model import TargetHead
    from eagle3kit.drafter.train_config import TrainConfig
    from eagle3kit.drafter.training_setup import Dist, Run, _check_final_slot, count_frequencies, no_cudnn_sdpa
    from eagle3kit.drafter.vocab import DraftVocab
    from eagle3kit.target import TargetInfo, resolve_target

    model, cfg, meta = load_sglang_export(drafter_dir)
    target = resolve_target(meta["target"])
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    no_cudnn_sdpa(dev)  # its dense masks change shape at every batch and step (05's offline cell, cuDNN on: 86 s for
    # 419 held-out samples on the H200, gpu-drafter-pipeline-7)
    source = D.open_source(data, split)
    if first_replies_of is not None:
        source = first_replies(source, first_replies_of, reply_tokens)
    if len(source) == 0:
        raise ValueError(f"{data}: no samples of split {split!r} to evaluate on")
    info = source.info()
    if info.layer_ids and [int(k) for k in info.layer_ids] != [int(k) for k in meta["capture_layer_ids"]]:
        raise ValueError(f"{data} holds the states of layers {list(info.layer_ids)}, the drafter {drafter_dir} was "
                         f"trained on {meta['capture_layer_ids']} (input_of_layer): its acceptance there says nothing. "
                         f"Fix: evaluate on data captured at the drafter's layers")
    tinfo = TargetInfo.read(target)
    info.n_states, info.hidden_size = len(meta["capture_layer_ids"]), tinfo.hidden_size
    d2t = model.d2t if model.d2t is not None else torch.zeros(model.draft_vocab_size, dtype=torch.int64)
    vocab = DraftVocab.from_d2t(d2t.cpu(), tinfo.vocab_size)
    most = meta.get("most_frequent_token")
    if most is None:
        most = int(torch.argmax(count_frequencies(D.open_source(data, "train"), tinfo.vocab_size)))
    head = TargetHead.from_target(target).placed(dev)
    head.final_normed = info.final_pre_norm is False  # a recorded post-norm slot is the norm's output: logits as is
    tc = TrainConfig(data=str(data), out_dir="", tokens_per_batch=tokens_per_batch, ttt_steps=1, serving_steps=1)
    _check_final_slot(tc, source, head)  # as training does: a post-norm slot not recorded so would be normed twice
    return Run(tc, Dist(), dev, None, source, info, target, vocab, torch.zeros(0), model.to(dev).eval(), head,
               vocab.target_to_draft().to(dev), vocab.ids.to(dev), int(most),
               extra={"aux_layer_ids": meta["capture_layer_ids"][:-1], "meta": meta})


def first_replies(source, conv_ids, reply_tokens: int | None = None):
    """Only the samples of ``conv_ids``, each with only its first assistant reply loss-masked: what SGLang generates
    from their first user turn, i.e. from the online experiment's prompts (``online.heldout_prompts``). On data whose
    replies the target regenerated greedily, that reply is the text the online server decodes. ``reply_tokens``:
    only the reply's first tokens, as many as the online rounds decode (their ``max_new_tokens``): a reply's later
    stretch, which the server never reaches, is not walked."""
    from eagle3kit.drafter import data as D

    if not isinstance(source, D.CaptureSource):
        raise ValueError(f"{source}: first replies need an eagle3kit data set (its manifest's conversation ids)")
    if reply_tokens is not None and reply_tokens < 1:
        raise ValueError(f"reply_tokens={reply_tokens}: the online rounds' max_new_tokens, at least 1")
    wanted = set(conv_ids)

    def first(spans):
        a, b = spans[0]
        return [[a, b if reply_tokens is None else min(b, a + reply_tokens)]]

    source.entries = [{**e, "loss_spans": first(e["loss_spans"])} for e in source.entries
                      if e["conv_id"] in wanted and e["loss_spans"]]
    return source


def evaluate_drafter(drafter_dir, data, steps: int = 7, split: str = "heldout", tokens_per_batch: int = 4096,
                     device: str = "auto", max_batches: int | None = None, first_replies_of=None,
                     reply_tokens: int | None = None) -> dict:
    """Chained acceptance of the exported drafter over ``split`` of ``data``: flat metrics (``offline_`` prefix).
    ``first_replies_of``: conversation ids whose first replies alone are evaluated (``first_replies``), for the
    like-for-like comparison with the online accept length on the prompts of those conversations; ``reply_tokens``:
    each of those replies walked only as far as the online rounds decode (``first_replies``)."""
    from eagle3kit.drafter.train import evaluate

    run = evaluation_run(drafter_dir, data, split, tokens_per_batch, device, first_replies_of, reply_tokens)
    walk = torch.zeros(steps, 2, dtype=torch.float64)
    counts = evaluate(run, steps, max_batches=max_batches, walk=walk)
    if not counts.valid[0]:
        raise ValueError(f"{data} ({split}): no loss-masked rows to evaluate (no assistant tokens?)")
    m = counts.metrics("offline_")
    for n in range(1, steps + 1):  # what serving would accept walking each reply (see objective.serving_walk)
        tokens, rounds = walk[n - 1].tolist()
        m[f"offline_walk_accept_length_{n}"] = tokens / rounds if rounds else 1.0
    del run, counts
    if torch.cuda.is_available():  # 05 evaluates before its SGLang servers start: leave them the memory
        torch.cuda.empty_cache()
    return m


def plot(metrics: dict, title: str, path=None, prefix: str = "offline_"):
    """Acceptance by position (chained and conditional) and tau against the number of steps."""
    import matplotlib.pyplot as plt

    ks = sorted(int(k[len(prefix + "acc_pos"):]) for k in metrics if k.startswith(prefix + "acc_pos"))
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    a.bar([k - 0.2 for k in ks], [metrics[f"{prefix}acc_pos{k}"] for k in ks], 0.4, label="accepted through k")
    a.bar([k + 0.2 for k in ks], [metrics[f"{prefix}cond_acc_pos{k}"] for k in ks], 0.4,
          label="accepted at k | accepted before")
    a.set_xlabel("draft position k")
    a.set_ylabel("fraction of held-out rows")
    a.set_ylim(0, 1)
    a.legend(fontsize=7)
    a.set_title("acceptance by position")
    ns = [k + 1 for k in ks]
    taus = [metrics[f"{prefix}tau_{n}"] for n in ns]
    b.plot(ns, taus, "o-")
    b.plot(ns, [n + 1 for n in ns], ":", color="grey", label="every draft accepted (n + 1)")
    b.set_xlabel("draft steps n (chain)")
    b.set_ylabel("tau (tokens per verify, bonus incl.)")
    b.set_title(f"tau(3) = {metrics.get(prefix + 'tau_3', float('nan')):.2f}")
    b.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    if path:
        fig.savefig(Path(path), dpi=110, bbox_inches="tight")
    return fig
