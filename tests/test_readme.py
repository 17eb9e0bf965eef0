"""The README's commands are checked: every command in its ```bash blocks is run by a named test of the suite, run
here (the cheap `--help` forms), or marked GPU-only with a trailing `# GPU` comment. A README command that is none
of these fails this test, so a command cannot enter the README untested."""
import ast
import contextlib
import io
import re
import shlex

import pytest

from tests.conftest import ROOT

README = ROOT / "README.md"
MAX_LINES = 160
GPU_ONLY = "GPU"  # the whole trailing comment of a command that only runs on the GPU machine

# A README command (as written, its trailing comment dropped, whitespace collapsed) -> the test that runs it.
RUN_BY = {
    # `make demo` is setup + `eagle3kit run params/demo.yaml` (test_make_targets_are_the_readmes_commands); the
    # pipeline of that file runs in the test, with small parameters
    "make demo": "tests/test_pipeline_notebooks.py::test_demo_pipeline_small",
    "make test": "tests/test_readme.py::test_make_targets_are_the_readmes_commands",
    ".venv/bin/eagle3kit run params/demo.yaml": "tests/test_pipeline_notebooks.py::test_demo_pipeline_small",
    ".venv/bin/eagle3kit run params/demo.yaml --only 01_tp_check --set 01_tp_check.num_prompts=2":
        "tests/test_pipeline_notebooks.py::test_tp_check_under_dp_attention_says_not_applicable",
    "eagle3kit extract --out data/run1 --max-samples 32 --max-tokens 128":
        "tests/test_extract.py::test_resume_after_a_real_kill",
    "eagle3kit verify data/run1": "tests/test_spot_check.py::test_wrong_states_with_good_checksums_fail",
    "eagle3kit verify data/run1 --reference 3": "tests/test_spot_check.py::test_a_good_data_set_passes",
    "eagle3kit train --data data/run1 --out drafters/run1 --set ttt_steps=3":
        "tests/test_train.py::test_interrupted_run_resumes_exactly",
    "eagle3kit doctor --drafter drafters/run1/best":
        "tests/test_layers.py::test_doctor_prints_the_serving_command_only_for_a_drafter_it_passes",
    # the export this command calls (eagle3kit.export.to_speculators), on an extracted data set
    "eagle3kit export speculators data/run1 data/run1-spec": "tests/test_extract.py::test_exporters_speculators_and_specforge",
    "eagle3kit compare outputs/ --out outputs/compare":
        "tests/test_acceptance_units.py::test_compare_cli_names_each_run_left_out_and_fails_when_a_given_run_gives_no_row",
    "eagle3kit trial --folder /tmp/trial": "tests/test_trial.py::test_every_bad_input_is_refused_or_counted",
    # the same command line (train --live, --live-set), on the embedded conversations with smaller settings
    "eagle3kit train --live --data embedded:sharegpt --out drafters/live1 --live-set max_samples=64":
        "tests/test_live.py::test_live_training_killed_resumed_equals_training_from_files",
}


def bash_commands(text):
    """(command, trailing comment) for every command line of the text's ```bash blocks; a line ending in a backslash
    continues on the next, comment-only and blank lines are not commands."""
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        joined = re.sub(r"\\\n", " ", block)
        for line in joined.splitlines():
            m = re.match(r"^(.*?)(?:\s+#\s*(.*))?$", line.strip())
            command, comment = " ".join(m.group(1).split()), (m.group(2) or "").strip()
            if command and not command.startswith("#"):
                out.append((command, comment))
    return out


def is_cheap(command):
    """The `--help` forms of the CLI: run by this test itself."""
    argv = shlex.split(command)
    return bool(argv) and argv[0].endswith("eagle3kit") and argv[-1] == "--help"


def test_exists(test_id):
    """Whether `path::name` names a test function in the suite."""
    path, _, name = test_id.partition("::")
    file = ROOT / path
    if not file.is_file():
        return False
    tree = ast.parse(file.read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body)


test_exists.__test__ = False  # a helper, not a test


def unaccounted(commands, run_by):
    """One line per README command that is neither run by an existing test, cheap, nor marked GPU-only."""
    problems = []
    for command, comment in commands:
        if comment == GPU_ONLY or is_cheap(command):
            continue
        test_id = run_by.get(command)
        if test_id is None:
            problems.append(f"README command not run by any test and not marked '# {GPU_ONLY}': {command}")
        elif not test_exists(test_id):
            problems.append(f"README command mapped to {test_id}, which does not exist: {command}")
    return problems


def test_every_readme_command_is_tested_or_marked_gpu_only():
    commands = bash_commands(README.read_text())
    assert len(commands) >= 10, commands  # the parser found the README's blocks
    assert unaccounted(commands, RUN_BY) == []
    # the map holds only commands the README still shows (a removed command leaves no stale entry)
    assert set(RUN_BY) <= {c for c, _ in commands}, set(RUN_BY) - {c for c, _ in commands}


def test_the_checker_fails_a_command_that_is_neither_tested_nor_marked():
    text = README.read_text()
    bogus = text.replace("```bash\nmake demo", "```bash\neagle3kit bogus --flag   # untested\nmake demo", 1)
    assert bogus != text
    problems = unaccounted(bash_commands(bogus), RUN_BY)
    assert problems == ["README command not run by any test and not marked '# GPU': eagle3kit bogus --flag"]
    # the same line marked GPU-only, or as a --help form, passes; a map entry naming a missing test fails
    assert unaccounted([("eagle3kit bogus --flag", "GPU")], RUN_BY) == []
    assert unaccounted([("eagle3kit bogus --help", "")], RUN_BY) == []
    missing = unaccounted([("make demo", "")], {"make demo": "tests/test_readme.py::test_that_is_not_there"})
    assert missing == ["README command mapped to tests/test_readme.py::test_that_is_not_there, which does not exist: "
                       "make demo"]


def test_a_continued_line_is_one_command_and_comments_are_split_off():
    text = "```bash\npython -m x --a 1 \\\n    --b 2   # GPU\n# only a comment\n\neagle3kit --help\n```\n"
    assert bash_commands(text) == [("python -m x --a 1 --b 2", "GPU"), ("eagle3kit --help", "")]


@pytest.mark.parametrize("command", [c for c, _ in bash_commands(README.read_text()) if is_cheap(c)])
def test_the_readmes_help_commands_run(command):
    from eagle3kit import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        cli.main(shlex.split(command)[1:])
    assert e.value.code == 0 and "usage: eagle3kit" in out.getvalue()


def test_make_targets_are_the_readmes_commands():
    """`make test` is what CI runs and runs pytest; `make demo` runs the pipeline of params/demo.yaml."""
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^test: setup\n\t\.venv/bin/python -m pytest", make, flags=re.M)
    assert re.search(r"^PARAMS \?= params/demo\.yaml$", make, flags=re.M)
    assert re.search(r"^demo: setup\n\t\.venv/bin/eagle3kit run \$\(PARAMS\)$", make, flags=re.M)


def test_the_readme_is_short_and_its_links_exist():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_LINES
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert links and all((ROOT / link).exists() for link in links), [l for l in links if not (ROOT / l).exists()]
