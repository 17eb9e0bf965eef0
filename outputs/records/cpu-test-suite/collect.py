"""metrics.json of this record from the two pytest logs (before: the tree at the branch point, serial; after: this
branch, two xdist workers) and their start/end epochs. Usage: python collect.py BEFORE_LOG BEFORE_START BEFORE_END
AFTER_LOG AFTER_START AFTER_END  (epochs as files holding one integer)."""
import json
import re
import sys
from pathlib import Path


def read(log, start, end):
    text = Path(log).read_text(errors="replace")
    seconds = int(Path(end).read_text()) - int(Path(start).read_text()) if Path(end).exists() else None
    summary = re.findall(r"^=+ (.* in [\d.]+s.*) =+$", text, re.M)  # pytest's last line (time -v's report follows)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary[-1])} if summary else {}
    total = re.search(r"^TOTAL\s+\d+\s+\d+\s+(\d+)%", text, re.M)
    return seconds, counts, (int(total.group(1)) / 100 if total else None)


b, a = read(*sys.argv[1:4]), read(*sys.argv[4:7])
out = {"make_test_seconds_before": b[0], "make_test_seconds_after": a[0],
       "tests_passed_before": b[1].get("passed"), "tests_passed_after": a[1].get("passed"),
       "tests_skipped_before": b[1].get("skipped"), "tests_skipped_after": a[1].get("skipped"),
       "tests_failed_before": b[1].get("failed", 0), "tests_failed_after": a[1].get("failed", 0),
       "line_coverage_before": b[2], "line_coverage_after": a[2]}
print(json.dumps(out, indent=1))
