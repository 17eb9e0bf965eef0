"""The bad-input trial (#12): every kind of mistake a user can make, run through the real command line.

``run_trial(folder)`` makes real inputs in ``folder`` (conversation files, a data set captured by the reference engine
from the embedded target, a drafter trained on it for two steps, and broken copies of each), then runs each case of
``CASES`` through ``eagle3kit.cli.main`` (in this process, its output captured: a process per case cost most of the
trial's time; a case that needs a process of its own says ``process=True``) and judges what the user would see:

  refused  exit status not 0, no traceback, the message names the input (and, where the case says, the fix), and
           nothing was written where the case says nothing may be
  counted  exit 0 (the good part of the input is used), the message reports the bad part with a count or reason

A case may also plant a user's file where the command is pointed (``user_files``: it must stay) and give the corrected
command (``then``: it must then run, so the refusal left no state in its way). The metrics count ``user_files_deleted``
(files that were there before a case and are gone after it) and ``silent_wrong_results`` (bad input taken, exit 0).

A case that ends otherwise (exit 0 with bad input taken as data, a traceback, a message that does not name the input,
a folder written by a refused run) is a failure of the product; ``eagle3kit trial`` exits 1 when one is found.
The trial's own negative control: a good command judged as a case must fail (``tests/test_trial.py``).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

CONVERSATION = {"messages": [{"role": "user", "content": "Hello, tell me about the sea and the sky."},
                             {"role": "assistant", "content": "The sea is wide and blue, and the sky above it is "
                                                              "bright in the morning."}]}
SMALL = ["--max-tokens", "64"]
TINY_TRAIN = ["--set", "max_steps=2", "--set", "draft_vocab_size=64", "--set", "ttt_steps=3", "--set",
              "tokens_per_batch=128", "--set", "workers=0", "--set", "progress=false"]

NB = ["--notebooks", str(Path(__file__).resolve().parents[2] / "notebooks")]  # the repository's pipeline notebooks


@dataclass
class Case:
    name: str  # the mistake, as a user would describe it
    argv: list  # eagle3kit's arguments, run in the trial folder
    words: tuple  # what the message must hold (the input named, the fix)
    outcome: str = "refused"  # or "counted"
    untouched: tuple = ()  # paths (in the trial folder) a refused run must not create or change
    kind: str = ""  # the group: data file, option, data set, drafter, params, ...
    busy: str = ""  # a folder (in the trial folder) that another run holds while the case runs (the trial holds it)
    user_files: tuple = ()  # files (in the trial folder) made as a user's own before the case runs: must stay
    then: tuple = ()  # the corrected command, which must then run (exit 0): the refusal left nothing in its way
    process: bool = False  # run as its own process (else ``cli.main`` in this one, with its output captured)


def _g(i: int) -> dict:
    return {"id": f"c{i}", **CONVERSATION}


def _files() -> dict:
    good = json.dumps([_g(i) for i in range(6)])
    return {
        "good.json": good, "empty.jsonl": "", "blank.jsonl": "\n\n  \n", "broken.json": good[: len(good) // 2],
        "noassist.jsonl": "\n".join(json.dumps({"id": f"n{i}", "messages": [{"role": "user", "content": "hi"}]})
                                    for i in range(3)),
        "dup.json": json.dumps([_g(0), {**_g(1), "id": "c0"}, _g(2)]),
        "badline.jsonl": json.dumps(_g(0)) + "\n{not json\n" + json.dumps(_g(1)) + "\n",
        "notobjects.json": "[1, 2, 3]", "nomessages.jsonl": json.dumps({"id": "x", "text": "hello"}) + "\n",
        "badrole.jsonl": json.dumps({"id": "r", "messages": [{"role": "wizard", "content": "hi"}]}) + "\n",
        "afile": "x", "notjson.json": "{not json",
        "ok-drafter-config.json": json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}),
        "params-typo-key.yaml": "experiment: x\nstep: [03_extract]\n",
        "params-list.yaml": "- 03_extract\n- 04_train\n",
        "params-notyaml.yaml": "experiment: [x,\n",
        "params-unknown-step.yaml": "experiment: x\nsteps: [03_extrakt]\n",
        "params-wrong-type.yaml": "experiment: x\nsteps: [03_extract]\nnotebooks:\n  03_extract:\n    max_samples: many\n",
        "params-unknown-key.yaml": "experiment: x\nsteps: [03_extract]\nnotebooks:\n  03_extract:\n    max_sample: 4\n",
        "params-notebooks-list.yaml": "experiment: x\nsteps: [03_extract]\nnotebooks: [03_extract]\n",
        "params-common-list.yaml": "experiment: x\nsteps: [03_extract]\ncommon: [max_samples, 4]\n",
        "messages-null.jsonl": json.dumps({"id": "m", "messages": None}) + "\n",
        "messages-strings.jsonl": json.dumps({"id": "m", "messages": ["hello", "hi, how can I help?"]}) + "\n",
    }


CASES = [
    # conversation files given to extract
    Case("empty data file", ["extract", "--data", "empty.jsonl", "--out", "o-empty", *SMALL],
         ("empty.jsonl", "nothing to capture"), untouched=("o-empty",), kind="data file"),
    Case("data file of blank lines", ["extract", "--data", "blank.jsonl", "--out", "o-blank", *SMALL],
         ("blank.jsonl", "nothing to capture"), untouched=("o-blank",), kind="data file"),
    Case("JSON list broken mid-file", ["extract", "--data", "broken.json", "--out", "o-broken", *SMALL],
         ("broken.json", "breaks at byte"), untouched=("o-broken",), kind="data file"),
    Case("no assistant turns", ["extract", "--data", "noassist.jsonl", "--out", "o-noassist", *SMALL],
         ("noassist.jsonl", "nothing to capture"), untouched=("o-noassist",), kind="data file"),
    Case("a line that is not JSON", ["extract", "--data", "badline.jsonl", "--out", "o-badline", *SMALL],
         ("badline.jsonl:2", "not valid JSON"), untouched=("o-badline",), kind="data file"),
    Case("records that are not objects", ["extract", "--data", "notobjects.json", "--out", "o-notobj", *SMALL],
         ("notobjects.json",), untouched=("o-notobj",), kind="data file"),
    Case("records without messages", ["extract", "--data", "nomessages.jsonl", "--out", "o-nomsg", *SMALL],
         ("nomessages.jsonl",), untouched=("o-nomsg",), kind="data file"),
    Case("an unknown role", ["extract", "--data", "badrole.jsonl", "--out", "o-badrole", *SMALL],
         ("badrole.jsonl",), untouched=("o-badrole",), kind="data file"),
    Case("data is a folder", ["extract", "--data", "adir", "--out", "o-adir", *SMALL],
         ("adir is a folder",), untouched=("o-adir",), kind="data file"),
    Case("data file missing", ["extract", "--data", "missing.jsonl", "--out", "o-missing", *SMALL],
         ("missing.jsonl", "does not exist"), untouched=("o-missing",), kind="data file"),
    Case("data not UTF-8", ["extract", "--data", "binary.jsonl", "--out", "o-binary", *SMALL],
         ("binary.jsonl", "not UTF-8"), untouched=("o-binary",), kind="data file"),
    Case("every conversation over the limit", ["extract", "--data", "good.json", "--out", "o-over", "--max-tokens", "8"],
         ("good.json", "nothing to capture", "--max-tokens"), untouched=("o-over",), kind="data file"),
    Case("duplicate conversation ids", ["extract", "--data", "dup.json", "--out", "o-dup", *SMALL],
         ("duplicate id",), outcome="counted", kind="data file"),
    Case("unknown embedded data", ["extract", "--data", "embedded:nosuch", "--out", "o-emb", *SMALL],
         ("embedded:nosuch",), untouched=("o-emb",), kind="data file"),
    # extract's options
    Case("--max-tokens 0", ["extract", "--data", "good.json", "--out", "o-mt0", "--max-tokens", "0"],
         ("--max-tokens 0",), untouched=("o-mt0",), kind="option"),
    Case("--max-tokens negative", ["extract", "--data", "good.json", "--out", "o-mtn", "--max-tokens", "-5"],
         ("--max-tokens -5",), untouched=("o-mtn",), kind="option"),
    Case("--max-samples 0", ["extract", "--data", "good.json", "--out", "o-ms0", "--max-samples", "0", *SMALL],
         ("--max-samples 0",), untouched=("o-ms0",), kind="option"),
    Case("unsorted layer ids", ["extract", "--data", "good.json", "--out", "o-l1", "--layers", "15", "2", "27", *SMALL],
         ("--layers 15 2 27", "fix: --layers 2 15 27"), untouched=("o-l1",), kind="option"),
    Case("repeated layer ids", ["extract", "--data", "good.json", "--out", "o-l2", "--layers", "2", "2", "27", *SMALL],
         ("--layers 2 2 27", "distinct"), untouched=("o-l2",), kind="option"),
    Case("layer id past the target", ["extract", "--data", "good.json", "--out", "o-l3", "--layers", "2", "15", "40",
                                      *SMALL], ("--layers 2 15 40", "from 1 to 29"), untouched=("o-l3",), kind="option"),
    Case("layer id 0", ["extract", "--data", "good.json", "--out", "o-l4", "--layers", "0", "15", "27", *SMALL],
         ("--layers 0 15 27",), untouched=("o-l4",), kind="option"),
    Case("--prefill-graph with the transformers engine", ["extract", "--data", "good.json", "--out", "o-pg1",
                                                           "--prefill-graph", *SMALL],
         ("--prefill-graph", "--engine sglang"), untouched=("o-pg1",), kind="option"),
    Case("--prefill-graph with --final-normed", ["extract", "--engine", "sglang", "--data", "good.json", "--out", "o-pg2",
                                                 "--prefill-graph", "--final-normed", *SMALL],
         ("--final-normed", "drop --final-normed"), untouched=("o-pg2",), kind="option"),
    Case("--heldout-percent over 100", ["extract", "--data", "good.json", "--out", "o-h1", "--heldout-percent", "150",
                                        *SMALL], ("--heldout-percent 150",), untouched=("o-h1",), kind="option"),
    Case("--heldout-percent negative", ["extract", "--data", "good.json", "--out", "o-h2", "--heldout-percent", "-1",
                                        *SMALL], ("--heldout-percent -1",), untouched=("o-h2",), kind="option"),
    Case("--rank past --world-size", ["extract", "--data", "good.json", "--out", "o-rk", "--rank", "2",
                                      "--world-size", "2", *SMALL], ("--rank 2 --world-size 2",),
         untouched=("o-rk",), kind="option"),
    Case("--out is a file", ["extract", "--data", "good.json", "--out", "afile", *SMALL], ("afile is a file",),
         untouched=("afile",), kind="option"),
    Case("--out inside a file", ["extract", "--data", "good.json", "--out", "afile/out", *SMALL], ("afile is a file",),
         untouched=("afile",), kind="option"),
    Case("--concurrency 0", ["extract", "--data", "good.json", "--out", "o-c0", "--concurrency", "0", *SMALL],
         ("--concurrency 0",), untouched=("o-c0",), kind="option"),
    Case("capture server not running", ["extract", "--engine", "sglang", "--urls", "http://127.0.0.1:9", "--data",
                                        "good.json", "--out", "o-url", *SMALL], ("http://127.0.0.1:9", "Fix"),
         kind="option"),
    Case("target folder missing", ["extract", "--target", "nomodel", "--data", "good.json", "--out", "o-t1", *SMALL],
         ("nomodel",), untouched=("o-t1",), kind="target"),
    Case("target folder without tokenizer", ["extract", "--target", "model-notok", "--data", "good.json", "--out",
                                             "o-t2", *SMALL], ("model-notok", "tokenizer"), untouched=("o-t2",),
         kind="target"),
    Case("target folder without weights", ["extract", "--target", "model-noweights", "--data", "good.json", "--out",
                                           "o-t3", *SMALL], ("model-noweights", "weights"), untouched=("o-t3",),
         kind="target"),
    Case("resume with another --seed", ["extract", "--data", "good.json", "--out", "ds", "--heldout-percent", "34",
                                        "--seed", "1", *SMALL], ("other settings", "split"), untouched=("ds",),
         kind="resume"),
    Case("resume with another --storage", ["extract", "--data", "good.json", "--out", "ds", "--heldout-percent", "34",
                                           "--storage", "fp8", *SMALL], ("other settings", "storage"),
         untouched=("ds",), kind="resume"),
    Case("resume with other layers", ["extract", "--data", "good.json", "--out", "ds", "--heldout-percent", "34",
                                      "--layers", "3", "16", "28", *SMALL], ("other settings",), untouched=("ds",),
         kind="resume"),
    Case("resume over a corrupt sample and a garbled manifest line",
         ["extract", "--data", "good.json", "--out", "ds-repair", "--heldout-percent", "34", *SMALL],
         ("captured again", "1 malformed manifest lines dropped"), outcome="counted", kind="resume"),
    # data sets given to verify, derive, export, train
    Case("verify: a folder that is not a data set", ["verify", "adir"], ("adir", "not an eagle3kit data set"),
         kind="data set"),
    Case("verify: a file", ["verify", "afile"], ("afile", "not an eagle3kit data set"), kind="data set"),
    Case("verify: a bit-flipped sample", ["verify", "ds-flip"], ("s0000000", "checksum"), kind="data set"),
    Case("verify: a sample file missing", ["verify", "ds-missing"], ("s0000001", "missing"), kind="data set"),
    Case("verify: a malformed manifest line", ["verify", "ds-badmanifest"], ("manifest.jsonl",), kind="data set"),
    Case("derive: not a data set", ["derive", "adir", "d-1", "--storage", "fp8"], ("adir", "not an eagle3kit data set"),
         untouched=("d-1",), kind="data set"),
    Case("derive: a bit-flipped sample", ["derive", "ds-flip", "d-2", "--storage", "fp8"], ("s0000000", "checksum"),
         untouched=("d-2",), kind="data set"),
    Case("derive: into a folder that is not empty", ["derive", "ds", "ds-flip", "--storage", "fp8"],
         ("ds-flip", "not empty"), untouched=("ds-flip",), kind="data set"),
    Case("derive: post-norm without final-normed states", ["derive", "ds", "d-3", "--final-slot", "post_norm"],
         ("--final-normed",), untouched=("d-3",), kind="data set"),
    Case("export: speculators from a bit-flipped data set", ["export", "speculators", "ds-flip", "x-1"],
         ("s0000000", "checksum"), outcome="counted", kind="data set"),
    Case("export: specforge without final-normed states", ["export", "specforge", "ds", "x-2"], ("--final-normed",),
         untouched=("x-2",), kind="data set"),
    Case("export: sglang from a data set", ["export", "sglang", "ds", "x-3"], ("not a drafter", "eagle3kit train"),
         untouched=("x-3",), kind="data set"),
    Case("train: a folder that is not a data set", ["train", "--data", "adir", "--out", "t-1"],
         ("adir", "Fix"), untouched=("t-1",), kind="data set"),
    Case("train: a bit-flipped sample", ["train", "--data", "ds-flip", "--out", "t-2", *TINY_TRAIN],
         ("skipped sample", "checksum"), outcome="counted", kind="data set"),
    # training settings
    Case("train: a setting of the wrong type", ["train", "--data", "ds", "--out", "t-3", "--set", "lr=abc"],
         ("lr='abc'", "float"), untouched=("t-3",), kind="train setting"),
    Case("train: an unknown setting", ["train", "--data", "ds", "--out", "t-4", "--set", "learning_rate=1e-4"],
         ("learning_rate",), untouched=("t-4",), kind="train setting"),
    Case("train: --set without =", ["train", "--data", "ds", "--out", "t-5", "--set", "lr"], ("--set 'lr'", "KEY=VALUE"),
         untouched=("t-5",), kind="train setting"),
    Case("train: a negative learning rate", ["train", "--data", "ds", "--out", "t-6", "--set", "lr=-1"], ("lr > 0",),
         untouched=("t-6",), kind="train setting"),
    Case("train: TTT shallower than serving", ["train", "--data", "ds", "--out", "t-7", "--set", "ttt_steps=2"],
         ("ttt_steps=2 < serving_steps=3",), untouched=("t-7",), kind="train setting"),
    Case("train: --out is a file", ["train", "--data", "ds", "--out", "afile", *TINY_TRAIN], ("afile is a file",),
         untouched=("afile",), kind="train setting"),
    Case("train: a resume with other settings", ["train", "--data", "ds", "--out", "tr", *TINY_TRAIN, "--set",
                                                 "lr=0.1"], ("lr",), untouched=("tr",), kind="train setting"),
    Case("train: into a folder another training is writing", ["train", "--data", "ds", "--out", "tr-busy",
                                                              *TINY_TRAIN],
         ("tr-busy", "another training is writing there", "pid"), untouched=("tr-busy",), kind="drafter",
         busy="tr-busy"),
    Case("train: a planted pickle in the checkpoint", ["train", "--data", "ds", "--out", "tr-pickle", *TINY_TRAIN],
         ("last.pt",), untouched=("tr-pickle",), kind="drafter"),
    # drafters given to export and doctor
    Case("export: sglang from a folder that is not a drafter", ["export", "sglang", "adir", "x-4"], ("adir",),
         untouched=("x-4",), kind="drafter"),
    Case("export: a drafter whose weights were cut", ["export", "sglang", "tr-cut", "x-5"], ("model.safetensors",),
         untouched=("x-5",), kind="drafter"),
    Case("doctor: a config that is not JSON", ["doctor", "--capture-layers", "2", "15", "27", "--drafter-config",
                                               "notjson.json"], ("notjson.json", "not a readable JSON"), kind="doctor"),
    Case("doctor: layers past the target", ["doctor", "--capture-layers", "2", "15", "99", "--drafter-config",
                                            "ok-drafter-config.json"], ("--capture-layers 2 15 99", "from 1 to 29"),
         kind="doctor"),
    Case("doctor: a folder that is not a drafter", ["doctor", "--drafter", "adir"], ("adir",), kind="doctor"),
    Case("doctor: nothing to check", ["doctor"], ("--drafter",), kind="doctor"),
    # params of `eagle3kit run`
    Case("run: params file missing", ["run", "params-nope.yaml"], ("params-nope.yaml", "does not exist"), kind="params"),
    Case("run: params not YAML", ["run", "params-notyaml.yaml"], ("params-notyaml.yaml",), kind="params"),
    Case("run: params a list", ["run", "params-list.yaml"], ("params-list.yaml",), kind="params"),
    Case("run: a misspelt key", ["run", "params-typo-key.yaml", *NB], ("params-typo-key.yaml", "step"), kind="params"),
    Case("run: an unknown step", ["run", "params-unknown-step.yaml", *NB], ("03_extrakt",), kind="params"),
    Case("run: a parameter of the wrong type", ["run", "params-wrong-type.yaml", *NB], ("max_samples", "many"),
         kind="params"),
    Case("run: an unknown parameter", ["run", "params-unknown-key.yaml", *NB], ("max_sample",), kind="params"),
    Case("run: --set without =", ["run", "params-unknown-step.yaml", *NB, "--set", "oops"], ("oops",), kind="params"),
    Case("compare: no run with figures", ["compare", "adir", "--out", "cmp"], ("adir",), untouched=("cmp",),
         kind="params"),
    Case("run: notebooks given as a list", ["run", "params-notebooks-list.yaml", *NB],
         ("params-notebooks-list.yaml", "notebooks: a list", "Fix"), kind="params"),
    Case("run: common given as a list", ["run", "params-common-list.yaml", *NB, "--set", "max_samples=2"],
         ("params-common-list.yaml", "common: a list", "Fix"), kind="params"),
    # a folder the user named holds the user's own files: refused, nothing deleted (--force is the user's to give)
    *[Case(f"{what} into a folder holding the user's files", argv,
           (argv[-1], "thesis.txt", "--force"), untouched=(argv[-1],), user_files=(f"{argv[-1]}/thesis.txt",),
           kind="user files")
      for what, argv in (("trial", ["trial", "--only", "verify", "--folder", "mine-trial"]),
                         ("export sglang of a drafter", ["export", "sglang", "tr", "mine-x1"]),
                         ("export speculators of a drafter", ["export", "speculators", "tr", "mine-x2"]),
                         ("export speculators of a data set", ["export", "speculators", "ds", "mine-x3"]),
                         ("derive", ["derive", "ds", "--storage", "fp8", "mine-d"]),
                         ("compare", ["compare", "tr", "--out", "mine-c"]))],
    # broken drafters given to the doctor: refused naming the tensor or the key, no serving command
    Case("doctor: config.json with hidden_size edited", ["doctor", "--drafter", "tr-hidden"],
         ("hidden_size=640", "layers.0.self_attn.q_proj.weight", "export"), kind="doctor"),
    Case("doctor: draft_vocab_size disagreeing with the weights", ["doctor", "--drafter", "tr-dvocab"],
         ("draft_vocab_size=32", "lm_head.weight", "d2t"), kind="doctor"),
    Case("doctor: model.safetensors cut in half", ["doctor", "--drafter", "tr-cut/best"],
         ("model.safetensors", "cut short"), kind="doctor"),
    Case("doctor: a drafter config that is a JSON list", ["doctor", "--drafter", "tr-list"],
         ("config.json", "list", "Fix"), kind="doctor"),
    # settings refused before anything is written, the corrected command then runs; numbers as users write them
    Case("train: a negative weight_decay, then the corrected command",
         ["train", "--data", "ds", "--out", "t-wd", *TINY_TRAIN, "--set", "weight_decay=-0.1"],
         ("weight_decay=-0.1", ">= 0"), untouched=("t-wd",), kind="train setting",
         then=("train", "--data", "ds", "--out", "t-wd", *TINY_TRAIN, "--set", "weight_decay=0.01", "--set",
               "lr=3e-4")),
    Case("train: a negative max_minutes", ["train", "--data", "ds", "--out", "t-mm", "--set", "max_minutes=-5"],
         ("max_minutes=-5", ">= 0"), untouched=("t-mm",), kind="train setting"),
    Case("train: a CUDA device this machine has not", ["train", "--data", "ds", "--out", "t-dev", "--set",
                                                        "device=cuda:99"],
         ("device=cuda:99", "CUDA device"), untouched=("t-dev",), kind="train setting"),
    Case("extract: a CUDA device this machine has not", ["extract", "--data", "good.json", "--out", "o-dev",
                                                          "--reference-device", "cuda:99", *SMALL],
         ("--reference-device cuda:99", "CUDA device"), untouched=("o-dev",), kind="option"),
    Case("trial: --only matching no case", ["trial", "--folder", "trial-none", "--only", "nosuchword"],
         ("nosuchword", "nothing was run"), untouched=("trial-none",), kind="option"),
    # damaged inputs: named in one line
    Case("train: a sample cut short", ["train", "--data", "ds-cutsample", "--out", "t-cut", *TINY_TRAIN],
         ("skipped sample", "s0000000"), outcome="counted", kind="data set"),
    Case("verify: the manifest gone", ["verify", "ds-nomanifest"],
         ("manifest.jsonl: missing", "s0000000.rank0.safetensors"), kind="data set"),
    Case("extract: the target's model.safetensors cut short", ["extract", "--target", "model-cut", "--data",
                                                                "good.json", "--out", "o-tcut", *SMALL],
         ("model-cut", "model.safetensors", "cut short"), untouched=("o-tcut",), kind="target"),
    Case('extract: "messages": null', ["extract", "--data", "messages-null.jsonl", "--out", "o-mnull", *SMALL],
         ("messages-null.jsonl", "'messages' is null", "Fix"), untouched=("o-mnull",), kind="data file"),
    Case("extract: messages given as a list of strings", ["extract", "--data", "messages-strings.jsonl", "--out",
                                                           "o-mstr", *SMALL],
         ("messages-strings.jsonl", "list holding strs", "Fix"), untouched=("o-mstr",), kind="data file"),
]


def prepare(folder: Path, force: bool = False, *, main) -> dict:
    """The trial's inputs in ``folder``; returns how long each real one took to make (seconds). ``folder`` must be
    new, empty or an earlier trial's (``folders.claim``; ``force``: any folder, emptied). The data set and the drafter
    are made by ``main`` in this process (``in_process``), as the cases run."""
    from eagle3kit.folders import claim, mark

    claim(folder, "trial", force)  # raises before anything is deleted: a user's files stay
    folder.mkdir(parents=True, exist_ok=True)
    for p in folder.iterdir():  # a fresh start but for the real inputs a trial made before (they take a minute)
        if p.name not in ("ds", "tr"):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    mark(folder, "trial")
    for name, text in _files().items():
        (folder / name).write_text(text)
    (folder / "binary.jsonl").write_bytes(b'{"id": "a"}\n\xff\xfe\x00')
    (folder / "adir").mkdir(exist_ok=True)
    from eagle3kit.target import materialize

    model = Path(materialize())
    for name, keep in (("model-notok", lambda f: "token" not in f.name and f.suffix != ".jinja"),
                       ("model-noweights", lambda f: f.suffix not in (".safetensors", ".bin", ".gguf")),
                       ("model-cut", lambda f: f.suffix != ".safetensors")):
        (folder / name).mkdir(exist_ok=True)
        for f in model.iterdir():
            if f.is_file() and keep(f) and not (folder / name / f.name).exists():
                os.symlink(f, folder / name / f.name)
    with open(model / "model.safetensors", "rb") as f:  # an interrupted download: the first MiB of the weights
        (folder / "model-cut" / "model.safetensors").write_bytes(f.read(1 << 20))
    took = {}
    for what, argv, out in (("data set", ["extract", "--data", "good.json", "--out", "ds", "--heldout-percent", "34",
                                          *SMALL], "ds"),
                            ("drafter", ["train", "--data", "ds", "--out", "tr", *TINY_TRAIN], "tr")):
        if not (folder / out).exists():
            t0 = time.time()
            rc, out = in_process(argv, folder, main)
            if rc != 0:
                raise RuntimeError(f"the trial's {what} could not be made: {out[-2000:]}")
            took[what] = round(time.time() - t0, 1)
    _broken_copies(folder)
    mark(folder, "trial")
    return took


def _broken_copies(folder: Path) -> None:
    ds, tr = folder / "ds", folder / "tr"
    for name in ("tr-hidden", "tr-dvocab", "tr-list"):  # exported drafters (tr's best/) edited
        shutil.rmtree(folder / name, ignore_errors=True)
        shutil.copytree(tr / "best", folder / name)
    for name, edit in (("tr-hidden", {"hidden_size": 640}), ("tr-dvocab", {"draft_vocab_size": 32})):
        cfg = json.loads((folder / name / "config.json").read_text())
        (folder / name / "config.json").write_text(json.dumps({**cfg, **edit}, indent=1))
    (folder / "tr-list" / "config.json").write_text(json.dumps([json.loads((tr / "best" / "config.json").read_text())]))
    for name in ("ds-flip", "ds-missing", "ds-badmanifest", "ds-repair", "tr-pickle", "tr-cut", "tr-busy",
                 "ds-cutsample", "ds-nomanifest"):
        shutil.rmtree(folder / name, ignore_errors=True)
        shutil.copytree(ds if name.startswith("ds") else tr, folder / name)
    for d in ("ds-flip", "ds-repair"):
        f = folder / d / "samples" / "s0000000.rank0.safetensors"
        b = bytearray(f.read_bytes())
        b[-10] ^= 0xFF  # a hidden-state byte (the token ids come first): only the checksum can tell
        f.write_bytes(bytes(b))
    (folder / "ds-missing" / "samples" / "s0000001.rank0.safetensors").unlink()
    for d in ("ds-badmanifest", "ds-repair"):
        m = folder / d / "manifest.jsonl"
        lines = m.read_text().splitlines(keepends=True)
        m.write_text("".join(lines[:2]) + '{"key": "torn", "file": \n' + "".join(lines[2:]))
    import pickle

    class Planted:  # a checkpoint that runs code when unpickled without weights_only
        def __reduce__(self):
            return (os.system, ("echo planted",))
    (folder / "tr-pickle" / "checkpoints" / "last.pt").write_bytes(pickle.dumps({"model": Planted()}))
    w = folder / "tr-cut" / "best" / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    f = folder / "ds-cutsample" / "samples" / "s0000000.rank0.safetensors"
    f.write_bytes(f.read_bytes()[:300])  # an interrupted copy: its header, not its tensors
    (folder / "ds-nomanifest" / "manifest.jsonl").unlink()


def _snapshot(path: Path):
    if not path.exists():
        return None
    if path.is_file():
        return (path.stat().st_size, path.stat().st_mtime_ns)
    return sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in path.rglob("*") if p.is_file())


def judge(case: Case, rc: int, out: str, before: dict, after: dict) -> str | None:
    """None when the product handled ``case`` as it must; otherwise what went wrong."""
    if "Traceback (most recent call last)" in out:
        return "a traceback"
    missing = [w for w in case.words if w not in out]
    if case.outcome == "counted":
        if rc != 0:
            return f"exit {rc}: the good part of the input was not used"
    elif rc == 0:
        return "exit 0: the bad input was taken"
    if missing:
        return f"the message lacks {missing}"
    changed = [p for p in case.untouched if before.get(p) != after.get(p)]
    if case.outcome == "refused" and changed:
        return f"a refused run wrote {changed}"
    return None


def run_case(case: Case, folder: Path, python: str = sys.executable, timeout: float = 300, *, main) -> dict:
    import contextlib

    from eagle3kit.pipeline import exclusive

    with exclusive(folder / case.busy, "training") if case.busy else contextlib.nullcontext():
        return _run_case(case, folder, python, timeout, main)


def in_process(argv: list, folder: Path, main) -> tuple[int, str]:
    """``main(argv)`` (``eagle3kit.cli.main``, handed in by the command line that runs the trial: the trial is one of
    its commands) run in this process with ``folder`` as its working directory: (exit status, stdout and stderr
    together). An exception that escapes ``main`` is printed as the traceback a user would see."""
    import contextlib
    import io
    import traceback

    buf = io.StringIO()
    cwd, progress = os.getcwd(), os.environ.get("EAGLE3KIT_PROGRESS")
    os.environ["EAGLE3KIT_PROGRESS"] = "0"
    os.chdir(folder)
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            try:
                rc = main([str(a) for a in argv])
            except SystemExit as e:  # argparse's refusals
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:  # noqa: BLE001 - what a user would see as a traceback, judged as one
                traceback.print_exc(file=buf)
                rc = 1
    finally:
        os.chdir(cwd)
        if progress is None:
            os.environ.pop("EAGLE3KIT_PROGRESS", None)
        else:
            os.environ["EAGLE3KIT_PROGRESS"] = progress
    return rc, buf.getvalue()


def in_subprocess(argv: list, folder: Path, python: str = sys.executable, timeout: float = 300) -> tuple[int, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "EAGLE3KIT_PROGRESS": "0"}
    try:
        r = subprocess.run([python, "-m", "eagle3kit.cli", *map(str, argv)], cwd=folder, capture_output=True,
                           text=True, timeout=timeout, env=env)
        return r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        return -9, f"timed out after {timeout} s: {e.stdout or ''}{e.stderr or ''}"


def _run_case(case: Case, folder: Path, python: str, timeout: float, main) -> dict:
    for name in case.user_files:  # a user's file in a folder the command is pointed at
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("the user's own")
    before = {p: _snapshot(folder / p) for p in case.untouched}
    t0 = time.time()
    rc, out = in_subprocess(case.argv, folder, python, timeout) if case.process else in_process(case.argv, folder, main)
    after = {p: _snapshot(folder / p) for p in case.untouched}
    deleted = len({name for name in case.user_files if not (folder / name).exists()} | {  # files there before, gone
        str(Path(p) / f) if isinstance(before[p], list) else p for p in case.untouched if before[p] is not None
        for f in ({x[0] for x in before[p]} - {x[0] for x in after[p] or []} if isinstance(before[p], list)
                  else ({""} if after[p] is None else set()))})
    problem = judge(case, rc, out, before, after)
    then_rc, then_out = None, ""
    if problem is None and case.then:  # the corrected command must run: the refused one left nothing in its way
        then_rc, then_out = in_process(case.then, folder, main)
        if then_rc != 0:
            problem = f"the corrected command `eagle3kit {' '.join(case.then)}` failed (exit {then_rc}): " + \
                (then_out.strip().splitlines() or [""])[-1][:200]
    message = [ln for ln in out.strip().splitlines() if ln.startswith("eagle3kit ") or "skipped" in ln or
               "duplicate" in ln or "checksum" in ln or "problems" in ln or ln.startswith("[error]")] or \
        out.strip().splitlines()[-1:]
    return {"case": case.name, "kind": case.kind, "command": "eagle3kit " + " ".join(case.argv), "exit": rc,
            "outcome": case.outcome, "ok": problem is None, "problem": problem, "seconds": round(time.time() - t0, 1),
            "message": (message[0] if message else "")[:400], "user_files_deleted": deleted,
            "silent_wrong_result": rc == 0 and case.outcome == "refused",
            **({"then_exit": then_rc} if case.then else {}), "process": "subprocess" if case.process else "in-process"}


def run_trial(folder, cases=None, python: str = sys.executable, log=print, force: bool = False, *, main) -> dict:
    """Every case in ``folder`` (made by ``prepare``; ``force``: see there); returns the metrics and writes
    ``trial.jsonl`` there."""
    from eagle3kit.folders import mark

    folder = Path(folder)
    t0 = time.time()
    took = prepare(folder, force, main=main)
    rows = []
    with open(folder / "trial.jsonl", "w") as f:
        for case in cases or CASES:
            row = run_case(case, folder, python, main=main)
            mark(folder, "trial", extra=("metrics.json",))  # what the case wrote is the trial's own
            rows.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
            log(f"{'ok  ' if row['ok'] else 'FAIL'} {row['case']}: exit {row['exit']}"
                + (f" -- {row['problem']}" if row["problem"] else "") + f" | {row['message'][:160]}")
    bad = [r["case"] for r in rows if not r["ok"]]
    return {"bad_inputs_tried": len(rows), "bad_inputs_handled": len(rows) - len(bad), "bad_inputs_unhandled": bad,
            "bad_inputs_refused": sum(r["ok"] and r["outcome"] == "refused" for r in rows),
            "bad_inputs_counted": sum(r["ok"] and r["outcome"] == "counted" for r in rows),
            "user_files_deleted": sum(r["user_files_deleted"] for r in rows),
            "silent_wrong_results": sum(r["silent_wrong_result"] for r in rows),
            "bad_inputs_in_subprocess": sum(r["process"] == "subprocess" for r in rows),
            "bad_input_kinds": sorted({r["kind"] for r in rows}), "bad_input_setup_seconds": took,
            "bad_input_trial_seconds": round(time.time() - t0, 1)}
