"""Live training (eagle3kit.live): the stream's accounting on real sample files (a feeder that writes them, pure
logic), then the real thing on the CPU: the reference engine captures while the trainer trains, a killed trainer
resumes, and the drafter equals the one trained from files of the same conversations."""
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from eagle3kit.capture.format import write_sample
from eagle3kit.drafter.data import SourceInfo
from eagle3kit.live.config import LiveConfig, LiveError
from eagle3kit.live.source import LiveSample, LiveSource, StreamError
from eagle3kit.live.stream import LiveStream

H, N_STATES = 64, 2


def _tensors(ids, seed):
    g = torch.Generator().manual_seed(seed)
    return {"hidden_states": torch.randn(len(ids), N_STATES, H, generator=g).to(torch.bfloat16),
            "token_ids": torch.tensor(ids, dtype=torch.int64)}


class FileFeeder:
    """Writes real sample files (format.write_sample), with faults on demand: ``fail`` keys fail their first capture,
    ``corrupt`` keys get wrong token ids the first time, ``always_fail`` keys never succeed."""

    timeout = 5

    def __init__(self, fail=(), corrupt=(), always_fail=()):
        self.fail, self.corrupt, self.always_fail = set(fail), set(corrupt), set(always_fail)
        self.asked = []

    def prepare(self, samples_dir):
        samples_dir.mkdir(parents=True, exist_ok=True)

    def run(self, samples_dir, take, on_done):
        while True:
            got = take(4)
            if got is None:
                return
            if not got:
                time.sleep(0.001)
                continue
            for key, ids in got:
                self.asked.append(key)
                if key in self.always_fail or key in self.fail:
                    self.fail.discard(key)
                    on_done(key, {"status": "error", "key": key, "reason": "injected"})
                    continue
                wrong = key in self.corrupt
                self.corrupt.discard(key)
                t = _tensors([x + 1 for x in ids] if wrong else ids, seed=len(ids))
                on_done(key, write_sample(samples_dir, key, 0, t, {"model": "test"}))

    def recover(self, reason):
        return False

    def close(self):
        pass


def _stream(tmp_path, n=12, budget=1 << 30, feeder=None, cache=False, max_attempts=5, **kw):
    samples = [LiveSample(i * 10, f"c{i}", list(range(3, 8 + i)), [0, 0] + [1] * (3 + i)) for i in range(n)]
    info = SourceInfo([1, 2], H, N_STATES, "t", True)
    src = LiveSource(samples, tmp_path / "stream", info, [1, 2], timeout_s=5, cache=cache)
    per_token = N_STATES * H * 2
    st = LiveStream(feeder or FileFeeder(), src, per_token, budget, cache_bytes=1 << 30 if cache else 0,
                    max_attempts=max_attempts, status_every=0.0, **kw)
    st.prepare()
    src.stream = st
    return src, st


def _read_epoch(src, order):
    return [src.load(i) for i in order]


def test_every_sample_once_in_order_and_the_stream_emptied(tmp_path):
    src, st = _stream(tmp_path)
    order = [3, 1, 4, 0, 5, 9, 2, 6, 8, 7, 11, 10]
    src.schedule(0, order)
    got = _read_epoch(src, order)
    for i, t in zip(order, got):  # each sample is the capture of its own request
        assert t["token_ids"].tolist() == src.samples[i].input_ids
        assert t["loss_mask"].tolist() == src.samples[i].loss_mask
    s = st.close(last_epoch_complete=True)
    assert (s["live_samples_trained"], s["live_samples_lost"], s["live_samples_duplicated"]) == (12, 0, 0)
    assert not list((tmp_path / "stream" / "samples").glob("*.safetensors"))  # consumed samples leave the stream


def test_a_live_sample_keeps_its_tokens_compact_and_gives_them_back_exactly():
    """Every training conversation stays in the trainer's RAM for the whole run: 5 bytes a token, not a list's ~44."""
    ids, mask = [0, 5, 49151, 163839, 7], [0, 0, 1, 1, 1]
    s = LiveSample(3, "c", ids, mask)
    assert (s.input_ids, s.loss_mask, s.n_tokens) == (ids, mask, 5)
    t_ids, t_mask = s.tensors()
    assert t_ids.dtype == t_mask.dtype == torch.int64 and t_ids.tolist() == ids and t_mask.tolist() == mask
    big = LiveSample(0, "c", list(range(40_000, 50_000)), [1] * 10_000)
    import sys
    assert sys.getsizeof(big._ids) + sys.getsizeof(big._mask) < 6 * 10_000
    with pytest.raises(ValueError, match="5 token ids, 4 loss-mask entries"):
        LiveSample(3, "c", ids, mask[:4])


def test_the_capture_pace_log_counts_every_capture_once(tmp_path):
    """The capture side's tokens/s through a run (one line per interval, in a file beside the checkpoints): its
    lines add up to what was captured and trained, token for token."""
    log = tmp_path / "stream_log.jsonl"
    src, st = _stream(tmp_path, feeder=FileFeeder(fail={"e000s0000020"}), log_path=log, log_every=0.002)
    order = list(range(12))
    src.schedule(0, order)
    _read_epoch(src, order)
    s = st.close(last_epoch_complete=True)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert rows == json.loads(json.dumps(st.log_rows)) and len(rows) >= 2
    assert sum(r["captured"] for r in rows) == s["live_samples_captured"] == 12
    assert sum(r["captured_tokens"] for r in rows) == sum(len(x.input_ids) for x in src.samples)
    assert sum(r["trained"] for r in rows) == 12 and sum(r["failed"] for r in rows) == 1
    # tokens/s is the interval's tokens over its length (``seconds``, rounded to the millisecond)
    assert all(abs(r["capture_tokens_per_s"] * r["seconds"] - r["captured_tokens"]) <= r["capture_tokens_per_s"] * 5e-4
               for r in rows) and any(r["captured_tokens"] for r in rows)
    assert s["live_capture_minutes_logged"] == sum(r["seconds"] >= 0.001 for r in rows)


def test_the_bound_holds_the_stream(tmp_path):
    src, st = _stream(tmp_path, budget=16 << 10)  # a few of these samples (1.3-4 KB each, and the header)
    order = list(range(12))
    src.schedule(0, order)
    time.sleep(0.3)  # the producer runs ahead as far as the bound lets it, then waits for the trainer
    files = list((tmp_path / "stream" / "samples").glob("*.safetensors"))
    assert 1 <= len(files) < 12 and sum(f.stat().st_size for f in files) <= st.budget
    _read_epoch(src, order)
    s = st.close(True)
    assert s["live_peak_accounted_mb"] <= s["live_stream_bound_mb"]
    assert s["live_peak_stream_mb"] <= s["live_stream_bound_mb"]


def test_a_failed_capture_and_a_rejected_one_are_asked_again_never_trained_on(tmp_path, capsys):
    feeder = FileFeeder(fail={"e000s0000020"}, corrupt={"e000s0000050"})
    src, st = _stream(tmp_path, feeder=feeder)
    order = list(range(8))
    src.schedule(0, order)
    got = _read_epoch(src, order)
    assert all(t["token_ids"].tolist() == src.samples[i].input_ids for i, t in zip(order, got))
    s = st.close(True)
    assert s["live_capture_failures"] == 1 and s["live_samples_rejected"] == 1
    assert s["live_samples_trained"] == 8 and s["live_samples_lost"] == 0 and s["live_samples_duplicated"] == 0
    assert feeder.asked.count("e000s0000020") == 2 and feeder.asked.count("e000s0000050") == 2
    assert "rejected by the trainer's check (token ids differ" in capsys.readouterr().out


def test_a_sample_that_never_comes_stops_the_run_naming_it(tmp_path):
    src, st = _stream(tmp_path, feeder=FileFeeder(always_fail={"e000s0000010"}), max_attempts=3)
    src.schedule(0, [0, 1, 2])
    src.load(0)
    with pytest.raises(StreamError, match=r"sample 10 \(e000s0000010\) failed 3 times; last: capture failed: injected"):
        src.load(1)
    st.close()


def test_repeats_in_an_epoch_and_the_epoch_cache(tmp_path):
    feeder = FileFeeder()
    src, st = _stream(tmp_path, n=4, feeder=feeder, cache=True)
    src.schedule(0, [0, 1, 2, 3, 0])  # a plan completed with its own first batch again: sample 0 twice
    _read_epoch(src, [0, 1, 2, 3, 0])
    src.schedule(1, [2, 0, 3, 1])
    second = _read_epoch(src, [2, 0, 3, 1])
    assert all(t["token_ids"].tolist() == src.samples[i].input_ids for i, t in zip([2, 0, 3, 1], second))
    s = st.close(True)
    assert s["live_samples_lost"] == 0 and s["live_samples_duplicated"] == 0 and s["live_epochs_complete"] == 2
    assert s["live_samples_from_cache"] >= 3 and sum(k.startswith("e001") for k in feeder.asked) <= 1


def test_live_settings_are_checked(capsys):
    with pytest.raises(LiveError, match="stream_gb=0"):
        LiveConfig.from_dict({"stream_gb": 0})
    with pytest.raises(LiveError, match="unknown live settings"):
        LiveConfig.from_dict({"stream_size": 3})
    with pytest.raises(LiveError, match="sglang engine's"):
        LiveConfig.from_dict({"urls": ["http://127.0.0.1:1"]})
    from eagle3kit.cli import main

    assert main(["train", "--data", "embedded:sharegpt", "--out", "/tmp/x-never", "--engine", "sglang"]) != 0
    assert "engine: live settings; add --live" in capsys.readouterr().err
    assert not Path("/tmp/x-never").exists()


# -- the real stream on the CPU: the reference engine captures while the trainer trains --

RECIPE = {"target": "embedded:smollm2", "draft_vocab_size": 1024, "ttt_steps": 2, "serving_steps": 2,
          "tokens_per_batch": 64, "epochs": 1, "workers": 1, "progress": False, "save_every": 1, "lr": 1e-3}
LIVE = {"engine": "transformers", "max_samples": 16, "max_tokens": 64, "heldout_percent": 25, "stream_gb": 0.001}


@pytest.fixture(scope="module")
def file_run(tmp_path_factory, target_path):
    """The same conversations captured to files by extract, and a drafter trained on them."""
    from eagle3kit.drafter.train import TrainConfig, train
    from eagle3kit.pipeline import run_extraction

    root = tmp_path_factory.mktemp("live")
    run_extraction(target=str(target_path), out_dir=root / "data", engine="transformers",
                   max_samples=LIVE["max_samples"], max_tokens=LIVE["max_tokens"], heldout_percent=25, progress=False)
    summary = train(TrainConfig.from_dict({**RECIPE, "data": str(root / "data"), "out_dir": str(root / "file")}))
    assert summary["heldout_samples"] > 0 and summary["val_samples"] > 0  # held out and validation, apart
    return root, summary


@pytest.mark.slow
def test_live_training_killed_resumed_equals_training_from_files(file_run):
    """One recipe, the same conversations: trained live (killed with SIGKILL after a checkpoint, then resumed) and from
    files. The reference engine is deterministic, so the drafters are the same; no hidden state reached the disk."""
    from safetensors.torch import load_file

    from eagle3kit.drafter.train import TrainConfig, train

    from tests.training_runs import start

    root, file_summary = file_run
    out = root / "live"
    args = ["train", "--live", "--data", "embedded:sharegpt", "--out", str(out)]
    args += [a for k, v in RECIPE.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    args += [a for k, v in LIVE.items() for a in ("--live-set", f"{k}={json.dumps(v)}")]
    p = start(args, root / "live.log")  # the CLI in a session of its own, forked from the preloaded forkserver
    log = out / "train_log.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and p.is_alive():
        if log.exists() and len(log.read_text().splitlines()) >= 2 and (out / "checkpoints" / "last.pt").exists():
            break
        time.sleep(0.05)
    assert p.is_alive(), "the live training ended before it could be killed mid-run"
    os.killpg(p.pid, signal.SIGKILL)
    p.join()
    steps_before = len(log.read_text().splitlines())
    assert 2 <= steps_before < file_summary["train_steps"]
    s = train(TrainConfig.from_dict({**RECIPE, "data": "embedded:sharegpt", "out_dir": str(out), "live": LIVE}))
    assert s["train_steps"] == file_summary["train_steps"] and s["train_samples"] == file_summary["train_samples"]
    assert s["live_samples_lost"] == 0 and s["live_samples_duplicated"] == 0
    assert s["live_hidden_state_bytes_on_disk"] == 0 and s["live_peak_accounted_mb"] <= s["live_stream_bound_mb"] + \
        s["live_bytes_per_token"] * LIVE["max_tokens"] / 2 ** 20  # a sample larger than the bound goes alone
    live_w = load_file(str(out / "final" / "model.safetensors"))
    file_w = load_file(str(root / "file" / "final" / "model.safetensors"))
    assert live_w.keys() == file_w.keys() and all(torch.equal(live_w[k], file_w[k]) for k in live_w)
    assert s["heldout_tau_2"] == file_summary["heldout_tau_2"]
    assert not Path(s["live_stream_dir"]).exists()
    on_disk = [p for p in out.rglob("*.safetensors") if p.name != "model.safetensors"]
    assert not on_disk


def test_the_stream_folder_must_be_in_ram(tmp_path):
    """A stream folder on a disk would put hidden states on it: only tmpfs/ramfs pass (open_live refuses the rest)."""
    from eagle3kit.live.session import on_ram

    assert on_ram(Path("/dev/shm"))
    disk = Path(__file__).parent  # the checkout: a disk
    assert not on_ram(disk)


@pytest.mark.slow
def test_two_gloo_ranks_train_live_as_they_train_from_files(file_run, tmp_path):
    """DDP live: two gloo ranks (torch's launcher), each capturing only its own batches (batch j on rank j % 2) through its own
    stream, end with the weights of the same two ranks trained from files of the same conversations; no sample is
    lost or read twice on either rank, and no hidden state reaches the disk."""
    from safetensors.torch import load_file

    from tests.training_runs import launch

    root, _ = file_run
    recipe = {**RECIPE, "workers": 0}

    def torchrun(out, data, live):  # torch's launcher, its ranks forked from preloaded processes (launch)
        args = ["train", "--data", data, "--out", str(out)]
        args += [a for k, v in recipe.items() for a in ("--set", f"{k}={json.dumps(v)}")]
        if live:
            args += ["--live", *(a for k, v in LIVE.items() for a in ("--live-set", f"{k}={json.dumps(v)}"))]
        codes, logs = launch(args)
        assert codes == {0: 0, 1: 0}, logs[0][-3000:] + logs[1][-2000:]
        return json.loads((out / "metrics.json").read_text())

    f = torchrun(tmp_path / "file2", str(root / "data"), live=False)
    s = torchrun(tmp_path / "live2", "embedded:sharegpt", live=True)
    assert s["train_steps"] == f["train_steps"] > 0 and s["train_tokens_seen"] == f["train_tokens_seen"]
    assert s["live_samples_lost"] == 0 and s["live_samples_duplicated"] == 0
    assert s["live_hidden_state_bytes_on_disk"] == 0
    live_w = load_file(str(tmp_path / "live2" / "final" / "model.safetensors"))
    file_w = load_file(str(tmp_path / "file2" / "final" / "model.safetensors"))
    assert live_w.keys() == file_w.keys() and all(torch.equal(live_w[k], file_w[k]) for k in live_w)
    assert not [p for p in (tmp_path / "live2").rglob("*.safetensors") if p.name != "model.safetensors"]


@pytest.mark.slow
def test_live_with_regenerated_replies_trains_as_from_files_extracted_with_them(tmp_path, target_path):
    """``regenerate``: the target writes the replies before the stream captures them (as ``extract --regenerate``),
    kept in out_dir's regenerated.jsonl. The live drafter equals the one trained from files of an extraction that
    regenerated the same conversations; both trained on the target's replies, not the data set's. Both stop at
    max_steps, mid-epoch: the stream captures only the samples those steps read."""
    from safetensors.torch import load_file

    from eagle3kit.drafter.train import TrainConfig, train
    from eagle3kit.pipeline import run_extraction

    live = {**LIVE, "max_samples": 8, "regenerate": True, "regenerate_max_new_tokens": 12}
    recipe = {**RECIPE, "workers": 0, "max_steps": 1}
    run_extraction(target=str(target_path), out_dir=tmp_path / "data", max_samples=8, max_tokens=LIVE["max_tokens"],
                   heldout_percent=25, regenerate=True, regenerate_max_new_tokens=12, progress=False)
    f = train(TrainConfig.from_dict({**recipe, "data": str(tmp_path / "data"), "out_dir": str(tmp_path / "file")}))
    s = train(TrainConfig.from_dict({**recipe, "data": "embedded:sharegpt", "out_dir": str(tmp_path / "live"),
                                     "live": live}))
    replies = [json.loads(x) for x in (tmp_path / "live" / "regenerated.jsonl").read_text().splitlines()]
    assert len(replies) == 8 and all(r["regenerated"] for r in replies)
    assert replies == [json.loads(x) for x in (tmp_path / "data" / "regenerated.jsonl").read_text().splitlines()]
    assert s["train_steps"] == f["train_steps"] == 1 and s["train_tokens_seen"] == f["train_tokens_seen"]
    assert s["live_samples_lost"] == 0 and s["live_samples_duplicated"] == 0
    # nothing captured past the last step (before, the stream asked the whole epoch's plan)
    assert s["live_samples_asked"] == s["live_samples_trained"] < s["live_train_conversations"]
    live_w = load_file(str(tmp_path / "live" / "final" / "model.safetensors"))
    file_w = load_file(str(tmp_path / "file" / "final" / "model.safetensors"))
    assert live_w.keys() == file_w.keys() and all(torch.equal(live_w[k], file_w[k]) for k in live_w)


def test_the_stream_captures_while_the_untrained_drafter_is_evaluated(tmp_path, monkeypatch):
    """The first epoch is handed to the stream before the initial evaluation, so its captures overlap that evaluation
    (~40 s on a GPU) instead of starting with the first step. The evaluation
    here waits until the stream holds a capture; a stream started only by the training loop never does (20 s)."""
    import eagle3kit.drafter.train as T
    from eagle3kit.drafter.train import TrainConfig, train

    seen, real = [], T.evaluate

    def evaluate(run, *a, **kw):
        if not seen:  # the first call: the untrained drafter's held-out evaluation
            deadline = time.time() + 20
            while time.time() < deadline and not run.train_src.stream.progress()["buffered"]:
                time.sleep(0.05)
            seen.append(run.train_src.stream.progress())
        return real(run, *a, **kw)

    monkeypatch.setattr(T, "evaluate", evaluate)
    s = train(TrainConfig.from_dict({**RECIPE, "data": "embedded:sharegpt", "out_dir": str(tmp_path / "live"),
                                     "max_steps": 2, "live": {**LIVE, "max_samples": 8}}))
    assert seen and seen[0]["buffered"] > 0, seen
    assert s["train_steps"] == 2 and s["live_samples_lost"] == 0 and s["live_samples_duplicated"] == 0
