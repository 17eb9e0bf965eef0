"""The bad-input trial (#12) through the command line's code (``cli.main`` in this process; the cases that need a
process of their own run in one): every case of ``eagle3kit.trial.CASES`` (data files,
options, targets, resumes, data sets, training settings, drafters, doctor, params) is refused naming the input, or
counted and reported, with no traceback and nothing written where a refused run may not write. The trial's own
negative controls: a good command, a message that does not name the input, a refused run that wrote, a traceback,
a user's file deleted and a corrected command that fails are each judged a failure."""
import json

import pytest

from eagle3kit.cli import main
from eagle3kit.trial import CASES, Case, judge, run_case


@pytest.mark.slow
def test_every_bad_input_is_refused_or_counted(tmp_path, capsys):
    rc = main(["trial", "--folder", str(tmp_path / "trial")])  # the command line's code, in this process
    m = json.loads((tmp_path / "trial" / "metrics.json").read_text())
    assert rc == 0 and m["bad_inputs_unhandled"] == [], capsys.readouterr().out[-4000:]
    assert m["bad_inputs_tried"] == len(CASES) >= 60 and m["bad_inputs_handled"] == len(CASES)
    rows = [json.loads(line) for line in (tmp_path / "trial" / "trial.jsonl").read_text().splitlines()]
    assert len(rows) == len(CASES) and all(r["ok"] for r in rows)
    # the trial also proved the check it exists for: run on a good command, the judge fails it
    good = run_case(Case("a good command", ["verify", "ds"], ("ds",)), tmp_path / "trial", main=main)
    assert not good["ok"] and good["problem"].startswith("exit 0")
    # and the busy folder's case holds only because the folder is held: free, that training runs (exit 0)
    busy = next(c for c in CASES if c.busy)
    free = run_case(Case(busy.name, busy.argv, busy.words, untouched=busy.untouched, kind=busy.kind),
                    tmp_path / "trial", main=main)
    assert not free["ok"] and free["problem"].startswith("exit 0")
    # the counters see what they count: the user's file deleted by an export the user forced, taken (exit 0)
    forced = run_case(Case("forced", ["export", "sglang", "tr", "mine-forced", "--force"], ("mine-forced",),
                           untouched=("mine-forced",), user_files=("mine-forced/thesis.txt",)), tmp_path / "trial",
                      main=main)
    assert forced["user_files_deleted"] == 1 and forced["silent_wrong_result"] and not forced["ok"]
    assert m["user_files_deleted"] == 0 and m["silent_wrong_results"] == 0
    # and the corrected command of a case must run: one that fails again is judged a failure
    blocked = run_case(Case("blocked", ["train", "--data", "ds", "--out", "t-blocked", "--set", "lr=-1"], ("lr",),
                            then=("train", "--data", "ds", "--out", "t-blocked", "--set", "lr=-2")),
                       tmp_path / "trial", main=main)
    assert not blocked["ok"] and blocked["problem"].startswith("the corrected command"), blocked


def test_the_judge_fails_what_a_user_must_not_see():
    case = Case("x", ["extract"], ("--data x.jsonl",), untouched=("out",))
    fine = "eagle3kit extract: --data x.jsonl: nothing to capture"
    assert judge(case, 2, fine, {"out": None}, {"out": None}) is None
    assert judge(case, 0, fine, {"out": None}, {"out": None}).startswith("exit 0")
    assert "lacks" in judge(case, 2, "eagle3kit extract: nothing to capture", {"out": None}, {"out": None})
    assert "wrote" in judge(case, 2, fine, {"out": None}, {"out": [("a", 1, 2)]})
    assert judge(case, 1, fine + "\nTraceback (most recent call last):\n", {}, {}) == "a traceback"
    counted = Case("y", ["extract"], ("duplicate id",), outcome="counted")
    assert judge(counted, 0, "1 duplicate id skipped", {}, {}) is None
    assert "not used" in judge(counted, 2, "1 duplicate id skipped", {}, {})
