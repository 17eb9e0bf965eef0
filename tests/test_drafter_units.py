"""Unit tests of the drafter's pure parts: the draft vocabulary (vocab.py), the teacher, validity, losses and chained
acceptance counts (objective.py), and the TTT helpers (ttt.py). Small hand-made tensors whose answers are known."""
import pytest
import torch

from eagle3kit.drafter import vocab as V
from eagle3kit.drafter.objective import ChainCounts, Teacher, chain_counts, step_loss, teacher, valid_rows
from eagle3kit.drafter.ttt import causal_doc_mask, shifted


# ----------------------------------------------------------------------------------------------------------- vocab
def _freq(n=20, **counts):
    f = torch.zeros(n, dtype=torch.int64)
    for k, v in counts.items():
        f[int(k[1:])] = v
    return f


FREQ = _freq(t5=10, t2=7, t9=7, t14=7, t0=3)  # ids 2, 9, 14 tie at 7


def test_build_top_n_ties_broken_by_lower_id():
    v = V.build(FREQ, 3)
    assert v.ids.tolist() == [2, 5, 9]  # 5 (10), then 2 and 9 of the tie at 7 (14 loses to lower ids)
    assert v.ids.dtype == torch.int64 and v.vocab_size == 20 and v.size == 3


def test_build_pads_with_lowest_unused_ids_ascending():
    v = V.build(FREQ, 7)  # 5 tokens occur: {0, 2, 5, 9, 14}; padding takes 1 and 3
    assert v.ids.tolist() == [0, 1, 2, 3, 5, 9, 14]
    v = V.build(torch.zeros(6, dtype=torch.int64), 4)  # nothing occurs: the lowest ids
    assert v.ids.tolist() == [0, 1, 2, 3]
    assert V.build(FREQ, 20).ids.tolist() == list(range(20))


def test_build_matches_a_brute_force_reference_on_a_large_vocab():
    g = torch.Generator().manual_seed(0)
    freq = torch.randint(0, 40, (49152,), generator=g)  # many ties
    freq[torch.randperm(49152, generator=g)[:45000]] = 0
    v = V.build(freq, 512)
    ref = sorted(range(49152), key=lambda i: (-int(freq[i]), i))[:512]
    assert v.ids.tolist() == sorted(ref)
    assert (v.ids[1:] > v.ids[:-1]).all()


@pytest.mark.parametrize("size", [0, 21, -1])
def test_build_rejects_sizes_outside_the_vocabulary(size):
    with pytest.raises(ValueError, match="draft_vocab_size"):
        V.build(FREQ, size)


def test_d2t_follows_sglang_hot_token_id_rule():
    v = V.build(FREQ, 7)
    d2t = v.d2t
    assert d2t.dtype == torch.int64 and d2t.tolist() == [0, 0, 0, 0, 1, 4, 8]
    hot_token_id = d2t + torch.arange(v.size)  # SGLang llama_eagle3: hot_token_id = d2t + arange(N)
    assert torch.equal(hot_token_id, v.ids)
    for draft_id in range(v.size):
        assert draft_id + int(d2t[draft_id]) == int(v.ids[draft_id])


def test_t2d_and_target_to_draft():
    v = V.build(FREQ, 3)
    t2d = v.t2d
    assert t2d.dtype == torch.bool and t2d.shape == (20,) and int(t2d.sum()) == 3
    assert t2d.nonzero().flatten().tolist() == [2, 5, 9]
    inv = v.target_to_draft()
    assert inv.shape == (20,) and inv[[2, 5, 9]].tolist() == [0, 1, 2]
    assert (inv[~t2d] == -1).all()
    assert torch.equal(v.ids[inv[v.ids]], v.ids)


def test_coverage():
    v = V.build(FREQ, 3)
    assert v.coverage(FREQ) == pytest.approx((10 + 7 + 7) / 34)
    assert V.build(FREQ, 7).coverage(FREQ) == pytest.approx(1.0)
    assert v.coverage(torch.zeros(20, dtype=torch.int64)) == 0.0


def test_from_d2t_and_state_round_trip():
    v = V.build(FREQ, 7)
    back = V.DraftVocab.from_d2t(v.d2t, 20)
    assert torch.equal(back.ids, v.ids) and back.vocab_size == 20
    back = V.DraftVocab.from_d2t(v.d2t.to(torch.int32), 20)
    assert back.ids.dtype == torch.int64 and torch.equal(back.ids, v.ids)
    s = V.DraftVocab.from_state(v.state())
    assert torch.equal(s.ids, v.ids) and s.vocab_size == 20


@pytest.mark.parametrize("ids", [[3, 2], [1, 1], [0, 20], [-1, 4]],
                         ids=["descending", "repeated", "past_vocab", "negative"])
def test_from_d2t_rejects_non_ascending_or_out_of_range(ids):
    d2t = torch.tensor(ids) - torch.arange(len(ids))
    with pytest.raises(ValueError, match="ascending target ids"):
        V.DraftVocab.from_d2t(d2t, 20)


def test_count_tokens_counts_only_loss_masked_positions():
    ids = torch.tensor([1, 2, 2, 3, 4, 19])
    mask = torch.tensor([0, 1, 1, 0, 1, 0])
    out = V.count_tokens(ids, mask, 20)
    assert out.dtype == torch.int64 and out.shape == (20,)
    assert {i: int(c) for i, c in enumerate(out) if c} == {2: 2, 4: 1}
    again = V.count_tokens(torch.tensor([4, 1]), torch.tensor([True, False]), 20, out=out)
    assert again is out and {i: int(c) for i, c in enumerate(out) if c} == {2: 2, 4: 2}
    # an out-of-vocabulary id outside the loss mask is not counted, so not checked
    assert int(V.count_tokens(torch.tensor([25, 3]), torch.tensor([0, 1]), 20).sum()) == 1


@pytest.mark.parametrize("bad", [20, 100, -1])
def test_count_tokens_rejects_ids_outside_the_vocabulary(bad):
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        V.count_tokens(torch.tensor([1, bad]), torch.tensor([1, 1]), 20)


# ------------------------------------------------------------------------------------------------------------- ttt
def test_shifted():
    x = torch.arange(5)
    assert shifted(x, 0) is x
    assert shifted(x, 2).tolist() == [2, 3, 4, 0, 0]
    assert shifted(x, 1, -1).tolist() == [1, 2, 3, 4, -1]
    assert shifted(x, 7, -1).tolist() == [-1] * 5
    m = torch.tensor([True, False, True])
    assert shifted(m, 1, False).tolist() == [False, True, False]
    y = torch.arange(12.).reshape(4, 3)
    s = shifted(y, 1, 9.0)
    assert s.shape == (4, 3) and torch.equal(s[:3], y[1:]) and (s[3] == 9.0).all()


def test_causal_doc_mask_sees_only_earlier_rows_of_its_own_sample():
    doc = torch.tensor([0, 0, 1, 1, 1, 2])
    m = causal_doc_mask(doc)
    assert m.shape == (1, 1, 6, 6) and m.dtype == torch.bool
    for t in range(6):
        for s in range(6):
            assert bool(m[0, 0, t, s]) == (s <= t and doc[s] == doc[t]), (t, s)
    assert m[0, 0, 3].tolist() == [False, False, True, True, False, False]


# ----------------------------------------------------------------------------------------------------- valid_rows
def test_valid_rows_respects_loss_mask_sample_boundary_and_row_end():
    # rows 0..4 belong to sample 0, rows 5..8 to sample 1; row t holds x_{t+1}, step k predicts row t+1+k's token
    mask = torch.tensor([0, 1, 1, 1, 1, 1, 1, 0, 1])
    doc = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 1])
    F_, T = False, True
    assert valid_rows(mask, doc, 0).tolist() == [F_, T, T, T, F_, T, F_, F_, F_]  # row 4: target in sample 1
    assert valid_rows(mask, doc, 1).tolist() == [F_, T, T, F_, F_, F_, T, F_, F_]  # row 3: target in sample 1
    # (row 6 is valid at step 1 though not at step 0: only x_{t+1} and x_{t+2+k} are asked to be loss-masked)
    assert valid_rows(mask, doc, 2).tolist() == [F_, T, F_, F_, F_, T, F_, F_, F_]  # row 6: past the packed row
    assert valid_rows(mask, doc, 8).tolist() == [F_] * 9
    assert valid_rows(mask.bool(), doc, 0).dtype == torch.bool


def test_valid_rows_one_sample_all_masked():
    s = 6
    for k in range(4):
        v = valid_rows(torch.ones(s, dtype=torch.int64), torch.zeros(s, dtype=torch.int64), k)
        assert v.tolist() == [t + 1 + k < s for t in range(s)]


# --------------------------------------------------------------------------------------------------------- teacher
class _Head:
    """A fake target head: logits of the final state are the state itself ([S, V])."""

    def __init__(self):
        self.calls = 0

    def logits(self, final):
        self.calls += 1
        return final * 1.0


def test_teacher_full_vocab_argmax_and_renormalised_draft_logp():
    vocab_ids = torch.tensor([1, 3, 4, 7])
    dv = V.DraftVocab(vocab_ids, 10)
    z = torch.randn(5, 10, generator=torch.Generator().manual_seed(1))
    z[0, 8] = 10.0  # argmax outside the draft vocabulary
    z[1, 3] = 10.0
    z[2, 0] = 10.0  # outside
    z[3, 7] = 10.0
    z[4, 1] = 10.0
    head = _Head()
    t = teacher(head, z, vocab_ids, dv.target_to_draft(), chunk=2)
    assert head.calls == 3  # chunks of 2 rows
    assert t.token.tolist() == [8, 3, 0, 7, 1]
    assert t.draft_index.tolist() == [-1, 1, -1, 3, 0]
    assert t.logp.shape == (5, 4) and t.logp.dtype == torch.float32
    assert torch.allclose(t.logp.exp().sum(-1), torch.ones(5), atol=1e-6)
    assert torch.allclose(t.logp, torch.log_softmax(z[:, vocab_ids], -1), atol=1e-6)
    # renormalised over the draft vocabulary, not the full softmax restricted to it
    assert not torch.allclose(t.logp, torch.log_softmax(z, -1)[:, vocab_ids], atol=1e-3)


# ------------------------------------------------------------------------------------------------------- step_loss
def _teacher(logits_full, vocab_ids, vocab_size):
    dv = V.DraftVocab(vocab_ids, vocab_size)
    token = logits_full.argmax(-1)
    return Teacher(token, dv.target_to_draft()[token], torch.log_softmax(logits_full[:, vocab_ids], -1))


def test_kl_is_zero_when_draft_equals_teacher_and_positive_otherwise():
    g = torch.Generator().manual_seed(2)
    vocab_ids = torch.tensor([0, 2, 5, 6, 9])
    t = _teacher(torch.randn(8, 12, generator=g), vocab_ids, 12)
    valid = torch.ones(8, dtype=torch.bool)
    valid[-1] = False
    for k in (0, 1):
        loss, n = step_loss(shifted(t.logp, k).clone(), t, valid & (torch.arange(8) + k < 7), k, "kl")
        assert n == 7 - k and abs(float(loss)) < 1e-6
    loss, n = step_loss(torch.randn(8, 5, generator=g), t, valid, 0, "kl")
    assert n == 7 and float(loss) > 1e-3


def test_ce_masked_leaves_out_rows_whose_teacher_token_is_outside_the_draft_vocab():
    g = torch.Generator().manual_seed(3)
    vocab_ids = torch.tensor([0, 2, 5, 6, 9])
    z = torch.randn(8, 12, generator=g)
    for r, tok in enumerate([0, 11, 5, 3, 9, 2, 7, 6]):  # 11, 3, 7: outside the draft vocabulary
        z[r, tok] = 8.0
    t = _teacher(z, vocab_ids, 12)
    assert t.draft_index.tolist() == [0, -1, 2, -1, 4, 1, -1, 3]
    logits = torch.randn(8, 5, generator=g)
    valid = torch.tensor([1, 1, 1, 1, 1, 1, 0, 0], dtype=torch.bool)
    k = 1  # row t's teacher is row t+1
    loss, n = step_loss(logits, t, valid, k, "ce_masked")
    rows = [r for r in range(8) if valid[r] and t.draft_index[r + k] >= 0]  # rows 1, 3, 4 (teacher rows 2, 4, 5)
    assert rows == [1, 3, 4] and n == 3
    q = torch.log_softmax(logits, -1)
    manual = sum(float(-(t.logp[r + k].exp() * q[r]).sum()) for r in rows) / len(rows)
    assert float(loss) == pytest.approx(manual, rel=1e-5)
    every = [r for r in range(8) if valid[r]]
    unmasked = sum(float(-(t.logp[r + k].exp() * q[r]).sum()) for r in every) / len(every)
    assert float(loss) != pytest.approx(unmasked, rel=1e-3)
    # kl keeps every valid row
    assert step_loss(logits, t, valid, k, "kl")[1] == 6


def test_step_loss_without_rows_is_a_differentiable_zero():
    t = _teacher(torch.randn(4, 6), torch.tensor([0, 1, 2]), 6)
    logits = torch.randn(4, 3, requires_grad=True)
    loss, n = step_loss(logits, t, torch.zeros(4, dtype=torch.bool), 0, "kl")
    assert n == 0 and float(loss.detach()) == 0.0 and loss.requires_grad


def test_step_loss_unknown_kind_raises():
    t = _teacher(torch.randn(4, 6), torch.tensor([0, 1, 2]), 6)
    with pytest.raises(ValueError, match="choose one of"):
        step_loss(torch.randn(4, 3), t, torch.ones(4, dtype=torch.bool), 0, "mse")


def test_step_loss_unknown_kind_raises_even_without_rows():
    t = _teacher(torch.randn(4, 6), torch.tensor([0, 1, 2]), 6)
    with pytest.raises(ValueError):
        step_loss(torch.randn(4, 3), t, torch.zeros(4, dtype=torch.bool), 0, "mse")


# ---------------------------------------------------------------------------------------------------- chain_counts
VOCAB_IDS = torch.tensor([3, 7, 10, 20, 42])  # draft index -> target id
TOKENS = [3, 7, 10, 20, 42, 11, 3, 7]  # the target's greedy token at each row; 11 is outside the draft vocab
# draft index proposed at each row, per step (row 7 is never valid; row 6 only at step 0)
PROPOSALS = [
    [0, 1, 2, 3, 0, 2, 0, 1],  # step 0 vs TOKENS[t]:   correct at rows 0 1 2 3 6; row 4 wrong, row 5 cannot be
    [1, 0, 3, 4, 1, 0, 0, 0],  # step 1 vs TOKENS[t+1]: correct at rows 0 2 3 5;  row 1 wrong, row 4 cannot be
    [2, 3, 0, 4, 0, 0, 0, 0],  # step 2 vs TOKENS[t+2]: correct at rows 0 1 4;    row 1's chain broke at step 1
]


def _onehot_logits(proposals, n=5, scale=3.0):
    z = torch.randn(len(proposals), n, generator=torch.Generator().manual_seed(4))
    z[torch.arange(len(proposals)), torch.tensor(proposals)] = scale + 10.0
    return z


def _chain_teacher():
    token = torch.tensor(TOKENS)
    dv = V.DraftVocab(VOCAB_IDS, 50)
    return Teacher(token, dv.target_to_draft()[token], torch.zeros(8, 5))


def _chain(proposals=PROPOSALS, vocab_ids=VOCAB_IDS, input_ids=None, losses=None):
    steps = [_onehot_logits(p) for p in proposals]
    input_ids = torch.tensor([5, 3, 7, 99, 98, 41, 11, 3]) if input_ids is None else input_ids
    return chain_counts(steps, _chain_teacher(), torch.ones(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int64),
                        input_ids, vocab_ids, most_frequent=3, losses=losses)


def test_chain_counts_by_hand():
    c = _chain()
    assert c.steps == 3
    assert c.valid == [7, 6, 5]
    assert c.full == [5, 3, 1]  # accepted through k: {0,1,2,3,6}, {0,2,3}, {0}
    assert c.cond_total == [7, 4, 3]  # valid rows accepted through k-1
    assert c.cond == [5, 3, 1]
    assert c.baseline_hits == 2  # rows 0 and 6: target token 3 (the most frequent)
    assert c.greedy_path == 4  # input_ids[t+1] == token[t] at rows 0, 1, 5, 6
    m = c.metrics("heldout_")
    assert m["heldout_acc_pos0"] == pytest.approx(5 / 7)
    assert m["heldout_acc_pos1"] == pytest.approx(3 / 6)
    assert m["heldout_acc_pos2"] == pytest.approx(1 / 5)
    assert m["heldout_cond_acc_pos0"] == pytest.approx(5 / 7)
    assert m["heldout_cond_acc_pos1"] == pytest.approx(3 / 4)
    assert m["heldout_cond_acc_pos2"] == pytest.approx(1 / 3)
    a0, a1, a2 = 5 / 7, 3 / 4, 1 / 3
    assert m["heldout_tau_1"] == pytest.approx(1 + a0)
    assert m["heldout_tau_2"] == pytest.approx(1 + a0 + a0 * a1)
    assert m["heldout_tau_3"] == pytest.approx(1 + a0 + a0 * a1 + a0 * a1 * a2)
    assert m["heldout_baseline_acc_pos0"] == pytest.approx(2 / 7)
    assert m["heldout_greedy_path_fraction"] == pytest.approx(4 / 7)
    assert m["heldout_rows"] == 7
    assert not any(k.startswith("heldout_loss_pos") for k in m)


def test_chain_counts_wrong_d2t_accepts_nothing():
    # the same draft argmaxes read through a wrong mapping (a d2t off by two: every target id shifted)
    c = _chain(vocab_ids=VOCAB_IDS + 2)
    assert c.full == [0, 0, 0] and c.cond == [0, 0, 0]
    assert c.metrics()["tau_3"] == 1.0
    # a permuted mapping (another order of the same ids) also breaks it
    c = _chain(vocab_ids=VOCAB_IDS[[1, 0, 2, 3, 4]])
    assert c.full[0] == 2  # rows 2 and 3 only (indices 2, 3 unchanged); rows 0, 1, 6 now map to the wrong id


def test_chain_counts_break_when_an_earlier_step_was_wrong():
    wrong1 = [[(p + 1) % 5 for p in PROPOSALS[1]]]  # step 1 wrong everywhere
    c = _chain(proposals=[PROPOSALS[0]] + wrong1 + [PROPOSALS[2]])
    assert c.full == [5, 0, 0]
    assert c.cond_total == [7, 4, 0] and c.cond == [5, 0, 0]
    m = c.metrics()
    assert m["cond_acc_pos2"] == 0.0 and m["tau_3"] == m["tau_2"] == pytest.approx(1 + 5 / 7)
    # only row 1 right at step 2 and at step 0, wrong at step 1: not accepted at step 2
    p2 = [0] * 8
    p2[1] = 3  # TOKENS[3] = 20 -> draft index 3
    c = _chain(proposals=[PROPOSALS[0], PROPOSALS[1], p2])
    assert c.full[2] == 0 and c.cond[2] == 0 and c.cond_total[2] == 3


def test_chain_counts_respects_loss_mask_and_samples():
    steps = [_onehot_logits(p) for p in PROPOSALS]
    mask = torch.tensor([1, 1, 1, 0, 1, 1, 1, 1])
    doc = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    c = chain_counts(steps, _chain_teacher(), mask, doc, torch.zeros(8, dtype=torch.int64), VOCAB_IDS, 3)
    # step 0 valid rows: 0, 1, 4, 5, 6 (row 2's target is unmasked, row 3 is unmasked): correct at 0, 1, 6
    assert c.valid[0] == 5 and c.full[0] == 3
    assert c.valid[1] == 3 and c.full[1] == 1  # valid rows 0, 4, 5: accepted row 0 only (5 broke at step 0)
    assert c.valid[2] == 1 and c.full[2] == 0 and c.cond_total[2] == 0  # row 4; step 0 was wrong there


def test_chain_counts_losses_and_metrics_loss_pos():
    losses = [(torch.tensor(0.5), 7), (torch.tensor(1.0), 6), (torch.tensor(2.0), 0)]
    c = _chain(losses=losses)
    assert c.loss_sum == [3.5, 6.0, 0.0] and c.loss_rows == [7, 6, 0]
    m = c.metrics()
    assert m["loss_pos0"] == pytest.approx(0.5) and m["loss_pos1"] == pytest.approx(1.0) and "loss_pos2" not in m


def test_metrics_of_empty_counts_are_zero():
    m = ChainCounts(2).metrics()
    assert m == {"acc_pos0": 0.0, "cond_acc_pos0": 0.0, "tau_1": 1.0, "acc_pos1": 0.0, "cond_acc_pos1": 0.0,
                 "tau_2": 1.0, "baseline_acc_pos0": 0.0, "greedy_path_fraction": 0.0, "rows": 0}


def test_chain_counts_tensor_round_trip_and_add():
    c = _chain(losses=[(torch.tensor(0.5), 7), (torch.tensor(1.0), 6), (torch.tensor(2.0), 5)])
    t = c.as_tensor()
    assert t.dtype == torch.float64 and t.shape == (6 * 3 + 2,)
    back = ChainCounts.from_tensor(3, t)
    assert back == c
    other = ChainCounts(3, valid=[1, 1, 1], full=[1, 0, 0], cond_total=[1, 1, 0], cond=[1, 0, 0],
                        loss_sum=[0.1, 0.2, 0.3], loss_rows=[1, 1, 1], baseline_hits=1, greedy_path=0)
    c.add(other)
    assert c.valid == [8, 7, 6] and c.full == [6, 3, 1] and c.cond_total == [8, 5, 3] and c.cond == [6, 3, 1]
    assert c.loss_sum == pytest.approx([3.6, 6.2, 10.3]) and c.loss_rows == [8, 7, 6]
    assert c.baseline_hits == 3 and c.greedy_path == 4
    assert c.metrics()["acc_pos0"] == pytest.approx(6 / 8)


def test_servable_check_refuses_what_sglang_does_not_read():
    from eagle3kit.drafter.model import DrafterError, check_servable

    for bad in ({"norm_before_residual": True}, {"norm_before_fc": True},
                {"transformer_layer_config": {"sliding_window": 2048}},
                {"transformer_layer_config": {"layer_types": ["sliding_attention"]}}):
        with pytest.raises(DrafterError):
            check_servable(bad)
    check_servable({"norm_before_residual": False, "norm_before_fc": False, "fc_norm": True, "norm_output": True,
                    "transformer_layer_config": {"sliding_window": None}})


def test_regeneration_stops_at_the_context_and_empty_conversations_are_skipped():
    from eagle3kit.data.regenerate import ContextFull, regenerate
    from eagle3kit.extract import prepare_samples

    def gen(messages, n):
        if sum(len(m["content"]) for m in messages) > 20:
            raise ContextFull("full")
        return "ok"
    convs = [{"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"},
                                      {"role": "user", "content": "a long question " * 3},
                                      {"role": "assistant", "content": "y"}]},
             {"id": "b", "messages": [{"role": "user", "content": "too long already " * 3},
                                      {"role": "assistant", "content": "z"}]}]
    a, b = list(regenerate(convs, gen, 8))
    assert [m["content"] for m in a["messages"]] == ["hi", "ok"] and a["cut_at_context"] == "full"
    assert b["messages"] == []

    class Tok:  # prepare_samples must skip b before rendering it (rendering [] fails)
        chat_template = "x"

        def apply_chat_template(self, messages, **kw):
            if not messages:
                raise IndexError("empty conversation rendered")
            return "".join(m["content"] for m in messages)

        def __call__(self, text, **kw):
            return {"input_ids": list(range(len(text))), "offset_mapping": [(i, i + 1) for i in range(len(text))]}
    assert [s.conv_id for s in prepare_samples([a, b], Tok(), max_tokens=64)] == ["a"]


# ------------------------------------------------------------------------------------------------------ epoch plans
def test_epoch_plan_has_the_same_number_of_batches_every_epoch():
    """Another permutation packs into another number of batches: training's fixed step -> (epoch, batch) map
    ran out of batches in the second epoch of the GPU run (StopIteration at step 516 of 805)."""
    import random

    from eagle3kit.drafter.data import epoch_plan, plan

    rng = random.Random(0)
    lengths = [rng.randint(20, 700) for _ in range(300)]
    counts = {e: len(plan(lengths, 1024, 0, e)) for e in range(20)}
    n = sorted(counts.values())[len(counts) // 2]  # as if epoch 0 had packed into this many
    short = [e for e, c in counts.items() if c < n]
    long = [e for e, c in counts.items() if c > n]
    assert short and long, counts  # the situation exists with these lengths
    for e in (short[0], long[0]):
        b = epoch_plan(lengths, 1024, 0, e, n)
        own = plan(lengths, 1024, 0, e)
        assert len(b) == n and b[:min(n, len(own))] == own[:n]
        assert all(sum(min(lengths[i] - 1, 1024) for i in batch) <= 1024 for batch in b)
    e = short[0]
    b = epoch_plan(lengths, 1024, 0, e, n)
    assert b[len(plan(lengths, 1024, 0, e)):] == plan(lengths, 1024, 0, e)[: n - counts[e]]  # its own first batches
    with pytest.raises(ValueError, match="no sample"):
        epoch_plan([1, 1], 1024, 0, 0, 3)


def test_the_serving_walk_counts_what_sglang_accepts_not_the_position_average():
    """Easy and hard stretches of a reply, 8 positions each: at an easy position every draft is right, at a hard one
    none. Serving (chain of 3) spends 2 rounds on an easy stretch and 8 on a hard one: 16 tokens in 10 rounds, an
    accept length of 1.6, while tau, averaging positions alike, says 2.5. All right: n + 1; none right: 1."""
    from eagle3kit.drafter.objective import Teacher, serving_walk
    from eagle3kit.drafter.ttt import shifted

    S, V, steps = 16 * 20 + 4, 50, 3
    token = torch.randint(1, V, (S,), generator=torch.Generator().manual_seed(0))
    t = Teacher(token, token, torch.zeros(S, V))
    mask, doc, ids = torch.ones(S, dtype=torch.long), torch.zeros(S, dtype=torch.long), torch.arange(V)

    def logits_for(easy):
        out = []
        for k in range(steps):
            want = shifted(token, k, 0)
            pick = torch.where(easy, want, (want + 1) % V)
            out.append(torch.nn.functional.one_hot(pick, V).float())
        return out
    blocks = (torch.arange(S) // 8) % 2 == 0
    walk = serving_walk(logits_for(blocks), t, mask, doc, ids)
    assert walk[2, 0] / walk[2, 1] == pytest.approx(1.6, abs=0.02)
    assert walk[0, 0] / walk[0, 1] == pytest.approx(16 / 12, abs=0.02)  # n = 1: 4 rounds easy, 8 hard
    every = serving_walk(logits_for(torch.ones(S, dtype=torch.bool)), t, mask, doc, ids)
    assert every[2, 0] / every[2, 1] > 3.9 and every[0, 0] / every[0, 1] > 1.95
    none = serving_walk(logits_for(torch.zeros(S, dtype=torch.bool)), t, mask, doc, ids)
    assert (none[:, 0] == none[:, 1]).all()


def test_collate_rows_pads_each_row_with_rows_no_loss_or_count_sees_and_refuses_a_longer_row():
    from eagle3kit.drafter import data as D

    def part(n, tok):
        return {"aux": torch.ones(n, 4, dtype=torch.bfloat16), "final": torch.ones(n, 2, dtype=torch.bfloat16),
                "input_ids": torch.full((n,), tok), "loss_mask": torch.ones(n, dtype=torch.int64)}
    b = D.collate_rows([[part(3, 7), part(2, 8)], [], [part(6, 9)]], 6, 4, 2)
    assert b["input_ids"].shape == (18,) and b["aux"].shape == (18, 4) and b["aux"].dtype == torch.bfloat16
    assert b["doc_ids"].tolist() == [0, 0, 0, 1, 1, -1] + [-2] * 6 + [2] * 6  # unique across rows, padding negative
    assert b["position_ids"][:6].tolist() == [1, 2, 3, 1, 2, 1]
    assert b["loss_mask"].tolist() == [1] * 5 + [0] * 7 + [1] * 6 and D.real_rows(b) == 11
    with pytest.raises(ValueError, match="longer than row_len 5"):
        D.collate_rows([[part(6, 9)]], 5, 4, 2)


@pytest.mark.parametrize("kind", ["kl", "ce_masked"])
def test_step_loss_equals_the_textbook_formula_with_its_gradient(kind):
    """The sliced, batched-dot form of step_loss gives the direct formula's loss and gradient (rows whose teacher row
    exists; the last k rows never count), for every TTT step; the same comparison against the teacher one row off
    fails."""
    g = torch.Generator().manual_seed(7)
    vocab_ids = torch.tensor([0, 2, 3, 5, 6, 9, 10])
    t = _teacher(torch.randn(12, 12, generator=g) * 3, vocab_ids, 12)
    logits = torch.randn(12, 7, generator=g)

    def textbook(x, k, off=0):
        p_log = shifted(t.logp, k + off)
        q_log = torch.log_softmax(x, -1)
        per_row = (p_log.exp() * (p_log - q_log)).sum(-1) if kind == "kl" else -(p_log.exp() * q_log).sum(-1)
        rows = valid & (shifted(t.draft_index, k + off, -1) >= 0) if kind == "ce_masked" else valid
        return torch.where(rows, per_row, 0.0).sum() / rows.sum().clamp(min=1)

    for k in range(4):
        valid = torch.arange(12) + k < 11  # the rows with a teacher row, as valid_rows gives them
        valid[3] = False
        a = logits.clone().requires_grad_()
        b = logits.clone().requires_grad_()
        la, _ = step_loss(a, t, valid, k, kind)
        lb = textbook(b, k)
        la.backward()
        lb.backward()
        assert float(la) == pytest.approx(float(lb), rel=1e-5, abs=1e-6), k
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
        assert float(la) != pytest.approx(float(textbook(logits, k, off=1)), rel=1e-3)
    bf16 = step_loss(logits.bfloat16(), t, valid, 1, kind)[0]  # bf16 logits: the float32 log-softmax reads them
    assert bf16.dtype == torch.float32 and float(bf16) == pytest.approx(
        float(step_loss(logits.bfloat16().float(), t, valid, 1, kind)[0]), rel=1e-6)


def test_the_validation_carve_out_is_fixed_disjoint_and_never_the_whole_train_split():
    """val_percent of the train split's samples, drawn by a seeded permutation: the same ones at every call (a resume,
    another training seed), apart from the samples trained on, each in the source's order; 0: none; all: refused."""
    from eagle3kit.drafter import data as D

    class Src:
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

        def length(self, i):
            return 10 + i

    train, val = D.carve_validation(Src(40), 10)
    again_train, again_val = D.carve_validation(Src(40), 10)
    assert len(val) == 4 and len(train) == 36 and val.indices == again_val.indices and train.indices == again_train.indices
    assert not set(val.indices) & set(train.indices) and sorted(val.indices + train.indices) == list(range(40))
    assert val.indices == sorted(val.indices) and val.indices != [0, 1, 2, 3]  # drawn, not the first ones
    assert [val.length(i) for i in range(len(val))] == [10 + j for j in val.indices]  # read through to the source
    assert len(D.carve_validation(Src(7), 5)[1]) == 1  # at least one sample where the share rounds to none
    src = Src(5)
    assert D.carve_validation(src, 0) == (src, None)
    with pytest.raises(ValueError, match="val_percent=90: 2 of the 2 training samples.*none left to train on"):
        D.carve_validation(Src(2), 90)
    capped = D.carve_validation(Src(400), 10, max_samples=7)[1]  # a large split: the cap, not the share
    assert len(capped) == 7 and capped.indices == D.carve_validation(Src(400), 10, max_samples=7)[1].indices
    assert len(D.carve_validation(Src(40), 10, max_samples=7)[1]) == 4  # under the cap: the share
    assert len(D.carve_validation(Src(400), 10, max_samples=0)[1]) == 40  # 0: no cap


def test_the_teacher_from_known_greedy_tokens_equals_the_full_heads():
    """An evaluation's later passes know each row's greedy token and compute only the draft vocabulary's columns of
    the head: the same token, draft index and log-probabilities as the full head (a float sum in another order at
    most); given other tokens, the teacher follows them (the shortcut trusts its cache, so the cache must be right)."""
    from eagle3kit.drafter.model import TargetHead
    from eagle3kit.drafter.objective import greedy_tokens

    g = torch.Generator().manual_seed(0)
    head = TargetHead(torch.rand(32, generator=g) + 0.5, torch.randn(1000, 32, generator=g), 1e-6)
    final = torch.randn(50, 32, generator=g) * 3
    vocab_ids = torch.sort(torch.randperm(1000, generator=g)[:100]).values
    t2d = torch.full((1000,), -1, dtype=torch.long)
    t2d[vocab_ids] = torch.arange(100)
    full = teacher(head, final, vocab_ids, t2d, chunk=16)
    known = teacher(head, final, vocab_ids, t2d, chunk=16, token=greedy_tokens(head, final, chunk=7))
    assert torch.equal(known.token, full.token) and torch.equal(known.draft_index, full.draft_index)
    torch.testing.assert_close(known.logp, full.logp, rtol=1e-6, atol=1e-6)
    other = teacher(head, final, vocab_ids, t2d, token=vocab_ids[:50])
    assert torch.equal(other.draft_index, torch.arange(50)) and not torch.equal(other.token, full.token)
