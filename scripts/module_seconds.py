"""tests/module_seconds.json from a `make test PYTEST_ARGS=--durations=0` log: each test module's seconds (setup, call
and teardown summed), which tests/conftest.py orders the modules by, longest first, for the two xdist workers.

    python scripts/module_seconds.py LOG
"""
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
seconds = {p.name: 0 for p in (ROOT / "tests").glob("test_*.py")}
for m in re.finditer(r"^([0-9.]+)s (?:call|setup|teardown) +tests/(test_\w+\.py)::", Path(sys.argv[1]).read_text(), re.M):
    seconds[m.group(2)] = seconds.get(m.group(2), 0) + float(m.group(1))
(ROOT / "tests" / "module_seconds.json").write_text(json.dumps({k: round(v) for k, v in sorted(seconds.items())},
                                                               indent=0) + "\n")
