"""Training under DDP on the CPU: two gloo ranks (torchrun, or torch's launcher from preloaded processes) equal one rank with the same global batch, resume
exactly after a kill, fit their schedule together and refuse a folder another training holds; each rank's own GPU."""
import json
import os
import signal
import subprocess
import time

import pytest
import torch

from eagle3kit.drafter.train import TrainConfig, TrainError, train
from tests.conftest import TINY_DRAFTER as TINY
from tests.training_runs import cli, env, launch, start_ranks, train_args, weights


# the DDP tests' training: 12 steps, a checkpoint every 2, an evaluation every 6
DDP = {"max_steps": 12, "save_every": 2, "eval_every": 6, "grad_accum": 1}


@pytest.fixture(scope="module")
def two_rank_run(small_dataset, tmp_path_factory):
    """A whole training of two gloo ranks (torchrun, DDP settings): what the other DDP runs must equal."""
    out = tmp_path_factory.mktemp("ddp") / "whole2"
    codes, logs = launch(train_args(small_dataset, out, DDP))
    assert codes == {0: 0, 1: 0}, logs[0][-3000:]
    return out


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_rank_with_the_same_global_batch(small_dataset, two_rank_run, tmp_path):
    one = tmp_path / "one"
    train(TrainConfig(data=str(small_dataset), out_dir=str(one), **{**TINY, **DDP, "grad_accum": 2}))
    a, b = weights(one), weights(two_rank_run)
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6), (k, (a[k] - b[k]).abs().max())
    moved = max((a[k] - b[k]).abs().max().item() for k in a)
    start = json.loads((one / "metrics.json").read_text())
    assert start["train_steps"] == 12 and json.loads((two_rank_run / "metrics.json").read_text())[
        "train_tokens_seen"] == start["train_tokens_seen"], "both runs must see the same global batches"
    assert moved < 1e-4


@pytest.mark.slow
def test_two_gloo_ranks_resume_exactly_after_a_kill(small_dataset, two_rank_run, tmp_path):
    """Exact resume under DDP: two gloo ranks killed (SIGKILL to the launcher's whole group) after a checkpoint, then
    resumed, end with the weights of an uninterrupted two-rank run (each rank's data position, the optimizer and the
    schedule come back; a rank resuming elsewhere in its shard would train on other batches)."""
    cut = tmp_path / "cut2"
    p = start_ranks(train_args(small_dataset, cut, DDP), tmp_path / "cut2.log")  # the agent and its two ranks
    ckpt, killed_at, ranks = cut / "checkpoints" / "last.pt", None, []
    deadline = time.time() + 600
    while time.time() < deadline and p.is_alive():
        if ckpt.exists():
            try:
                step = torch.load(ckpt, map_location="cpu", weights_only=True)["state"]["step"]
            except Exception:  # being replaced at this moment
                step = 0
            if step >= 4:  # the machine dies: the agent and its ranks, one process group
                ranks = [int(x) for x in open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()]
                os.killpg(p.pid, signal.SIGKILL)
                killed_at = step
                break
        time.sleep(0.05)
    p.join()
    for pid in ranks:
        while os.path.exists(f"/proc/{pid}") and "Z" not in open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1][:3]:
            time.sleep(0.05)  # gone (or a zombie until init reaps it)
    left = torch.load(ckpt, map_location="cpu", weights_only=True)["state"]["step"]  # what the kill left on disk
    assert killed_at is not None and left < 12 and not (cut / "metrics.json").exists(), "not interrupted"
    codes, logs = launch(train_args(small_dataset, cut, DDP))  # the same ranks again, from the same folder
    assert codes == {0: 0, 1: 0}, logs[0][-3000:]
    assert f"resumed from {ckpt} at step {left} of 12" in logs[0]
    a, b = weights(two_rank_run), weights(cut)
    for k in a:
        assert torch.equal(a[k], b[k]), (k, (a[k] - b[k]).abs().max())
    ma, mb = (json.loads((d / "metrics.json").read_text()) for d in (two_rank_run, cut))
    assert ma["train_steps"] == mb["train_steps"] == 12 and ma["train_tokens_seen"] == mb["train_tokens_seen"]


def test_a_second_training_into_the_same_folder_is_refused(small_dataset, tmp_path):
    """Two trainings writing one out_dir would interleave checkpoints and logs (torchrun's orphaned workers did, while
    the run was resumed: a checkpoint renamed from under the other). While one holds the folder another is refused
    at once, naming the holder, on one rank and on every rank under DDP (none left waiting in a collective); the
    folder's contents stay as they were; once it is released, training there works."""
    from eagle3kit.pipeline import exclusive

    out = tmp_path / "busy"
    train(TrainConfig(data=str(small_dataset), out_dir=str(out), max_steps=2, **TINY))
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with exclusive(out, "training"):
        with pytest.raises(TrainError, match=f"another training is writing there \\(pid {os.getpid()}"):
            train(TrainConfig(data=str(small_dataset), out_dir=str(out), max_steps=2, **TINY))
        codes, logs = launch(train_args(small_dataset, out, {"max_steps": 2}))
        assert 0 not in codes.values() and "another training is writing there" in logs[0]
        assert "rank 0 found another training writing there" in logs[1]  # and no rank waits in a collective
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before
    s = train(TrainConfig(data=str(small_dataset), out_dir=str(out), max_steps=2, **TINY))  # the same run, resumed
    assert s["train_steps"] == 2 and not (out / ".lock").exists()


@pytest.mark.slow
def test_two_gloo_ranks_fit_their_schedule_together(small_dataset, tmp_path):
    """fit_schedule and max_minutes under DDP: every look at the pace (a third of the plan's steps, or a third of the
    time left, whichever comes first) and the budget's stop happen at the same step on every rank, whichever rank's
    clock called them, and the plan is the one that ends in time on every rank's clock (the least). Rank 1's steps
    take 3x as long on its clock from the first fit on (its pace seems to slow; rank 0's does not): a rank that looked alone
    would enter a collective the other does not (the flags unsynced: a hang, caught by the timeout). Both end
    together, at the minimum lr, in time by either clock. The first fit after 3 steps, not 20: a plan of 59 steps left
    no later look (stopped at 37), and the stretch after the last look (under 2 x FIT_AFTER steps) must fit in the
    plan's 5 % of slack on rank 1's clock. With so many looks an averaged plan also ends in time (it did stop at 24 of
    42 steps with the first fit after 5): the least is kept because it is in time by construction."""
    out = tmp_path / "fit2"
    wrapper = tmp_path / "fast_clock_rank1.py"
    wrapper.write_text("import os, sys\n"
                       "import eagle3kit.drafter.train as T\n"
                       # a simulated clock: 0.5 s an optimizer step (1 ms a reading), 1.5 s on rank 1 after its first
                       # fit, so the budget runs out after a few real steps at the pace set, whatever the load
                       "now, switched, fit, forward = [0.0], [], T._fitted_steps, T.forward_batch\n"
                       "def step(run, module, batch, ttt, with_loss=True, **kw):\n"
                       "    if with_loss:\n"
                       "        now[0] += 1.5 if switched else 0.5\n"
                       "    return forward(run, module, batch, ttt, with_loss, **kw)\n"
                       "def clock():\n"
                       "    now[0] += 1e-3\n"
                       "    return now[0]\n"
                       "def fitted(*a):\n"
                       "    if os.environ.get('RANK') == '1' and not switched:\n"
                       "        switched.append(True)\n"
                       "    return fit(*a)\n"
                       "T._now, T.forward_batch, T._fitted_steps = clock, step, fitted\n"
                       "T.FIT_AFTER = 3\n"  # later looks need 2 x FIT_AFTER steps left: a loaded machine's short plan
                       "from eagle3kit.cli import main\n"
                       "sys.exit(main(sys.argv[1:]))\n")
    extra = {"epochs": 500, "max_minutes": 0.3, "eval_every": 100000, "fit_schedule": True, "save_every": 100000,
             "tokens_per_batch": 64}  # steps of 64 tokens: the logic counts steps on the simulated clock
    cmd = cli(small_dataset, out, extra, torchrun=2)
    cmd[cmd.index("-m", 3):cmd.index("eagle3kit.cli") + 1] = [str(wrapper)]  # torchrun runs the wrapper
    try:
        r = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=240, start_new_session=True)
    except subprocess.TimeoutExpired:
        subprocess.run(["pkill", "-9", "-f", str(wrapper)])
        raise AssertionError("the ranks hung: one entered a collective the other did not") from None
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((out / "metrics.json").read_text())
    assert 0 < m["train_steps"] == m["train_total_steps_fitted"] < m["train_total_steps_planned"], m
    assert not m["train_stopped_early"]
    rows = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == m["train_steps"]
    assert rows[-1]["lr"] == pytest.approx(TINY["lr"] * TrainConfig.min_lr_ratio, rel=1e-6)
    assert "fit_schedule:" in r.stdout


def test_each_rank_trains_on_its_own_gpu():
    """Under torchrun, device=cuda means each rank's own GPU (NCCL refuses two ranks on one: "Duplicate GPU"), and one
    GPU index for every rank is refused naming the fix; a single process keeps the device it was given."""
    from eagle3kit.drafter.training_setup import Dist, _device

    assert _device(TrainConfig(data="d", out_dir="o", device="cuda"), Dist(1, 2, 1)) == torch.device("cuda", 1)
    assert _device(TrainConfig(data="d", out_dir="o", device="cuda"), Dist(3, 4, 1)) == torch.device("cuda", 1)
    assert _device(TrainConfig(data="d", out_dir="o", device="cuda:2"), Dist()) == torch.device("cuda", 2)
    assert _device(TrainConfig(data="d", out_dir="o", device="cpu"), Dist(1, 2, 1)) == torch.device("cpu")
    with pytest.raises(TrainError, match="every rank would train on GPU 0.*device=cuda or auto"):
        _device(TrainConfig(data="d", out_dir="o", device="cuda:0"), Dist(1, 2, 1))
