"""The adversarial suite's summary: cases run per category and test (surface), and how many
failed, printed after the run (``python -m pytest tests/adversarial -q``)."""

from __future__ import annotations

import re
from collections import Counter

# a case id is CATEGORY/NAME (tests/adversarial/cases.py; categories are identifiers)
_CASE_ID = re.compile(r"::(?P<test>\w+)\[(?:.*-)?(?P<category>\w+)/")


def pytest_terminal_summary(terminalreporter) -> None:
    ran, failed = Counter(), Counter()
    for outcome in ("passed", "failed", "error"):
        for report in terminalreporter.stats.get(outcome, []):
            match = _CASE_ID.search(getattr(report, "nodeid", ""))
            if match is None or "tests/adversarial/" not in report.nodeid or report.when != "call":
                continue
            key = (match["category"], match["test"])
            ran[key] += 1
            failed[key] += outcome != "passed"
    if not ran:
        return
    terminalreporter.section("adversarial cases (category, test: run / failed)")
    for (category, test), n in sorted(ran.items()):
        terminalreporter.write_line(f"{category:<24} {test:<40} {n:>4} / {failed[(category, test)]}")
    terminalreporter.write_line(f"{'total':<65} {sum(ran.values()):>4} / {sum(failed.values())}")
