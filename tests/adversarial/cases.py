"""Table machinery for the adversarial suite: rows of (category, name, payload), parametrized by
surface, counted by category (tests/adversarial/conftest.py prints the counts after a run), and
run under a deadline so that a hang is a failure, not a stuck suite.

A table is a list of ``Case`` rows. ``Table.parametrize(surface)`` gives the pytest decorator
for every row that applies to a surface (``"api"``, ``"cli"``, ``"c"``, or whatever a test
module names); the ids are ``category/name``. ``Table.counts()`` is what the closing note of
a hardening pass reports (``python -m pytest tests/adversarial -q --co`` lists every case).

Add rows to a module's table, or a table of your own, instead of writing one test per case:

    TABLE = Table([
        Case("fifo", "manifest", "manifest.json", surfaces=("api", "cli", "c")),
        ...
    ])

    @TABLE.parametrize("api")
    def test_api(case): ...
"""

from __future__ import annotations

import faulthandler
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

DEADLINE_S = 20.0  # far above any refusal (milliseconds), far below a stuck suite


@dataclass(frozen=True)
class Case:
    """One adversarial input: its category (what kind of attack or mistake), a short name, the
    payload a test module interprets (a file name, a command line, a mutation), which surfaces
    it applies to, and a fragment the one error line must contain (None: the module's own)."""

    category: str  # an identifier (the summary in conftest.py parses ids): symlink_out, fifo, ...
    name: str
    payload: Any = None
    surfaces: tuple[str, ...] = ("api", "cli")
    expect: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.category}/{self.name}"


class Table:
    def __init__(self, cases: Iterable[Case]) -> None:
        self.cases = list(cases)
        ids = [c.id for c in self.cases]
        duplicated = sorted({i for i in ids if ids.count(i) > 1})
        assert not duplicated, f"duplicate case ids: {duplicated}"

    def on(self, surface: str) -> list[Case]:
        return [c for c in self.cases if surface in c.surfaces]

    def parametrize(self, surface: str, argname: str = "case"):
        cases = self.on(surface)
        return pytest.mark.parametrize(argname, cases, ids=[c.id for c in cases])

    def counts(self) -> dict[tuple[str, str], int]:
        """(category, surface) -> number of cases."""
        return dict(Counter((c.category, s) for c in self.cases for s in c.surfaces))


def within_deadline(
    fn: Callable[[], Any], *, unblock: Sequence[Path] = (), seconds: float = DEADLINE_S
) -> Any:
    """``fn()``'s result (or its exception, re-raised), failing the test if it took ``seconds``
    or more. A call stuck opening one of the ``unblock`` FIFOs for reading is released after
    ``seconds`` by a separate process (a native reader may hold the GIL while it blocks, so no
    thread of this process could) that opens each FIFO for writing and closes it."""
    releaser = None
    if unblock:
        script = (
            "import os, sys, time\n"
            "time.sleep(float(sys.argv[1]))\n"
            "for path in sys.argv[2:]:\n"
            "    try: os.close(os.open(path, os.O_RDWR | os.O_NONBLOCK))\n"
            "    except OSError: pass\n"
        )
        releaser = subprocess.Popen([sys.executable, "-c", script, str(seconds), *map(str, unblock)])
    # last resort for a hang nothing releases (a native loop): end the run with every
    # thread's traceback rather than leave the suite stuck
    faulthandler.dump_traceback_later(seconds + 60, exit=True)
    start = time.monotonic()
    try:
        result = fn()
    except BaseException:
        if time.monotonic() - start >= seconds:
            pytest.fail(f"hung: no answer within {seconds:.0f} s (a FIFO or an unbounded read?)")
        raise
    finally:
        faulthandler.cancel_dump_traceback_later()
        if releaser is not None:
            releaser.kill()
            releaser.wait()
    if time.monotonic() - start >= seconds:
        pytest.fail(f"hung: no answer within {seconds:.0f} s (a FIFO or an unbounded read?)")
    return result


def assert_one_error_line(returncode: int, stdout: str, stderr: str, *fragments: str) -> None:
    """The CLI's contract for an error the user can fix: one ``error:`` line, exit status 2."""
    assert returncode == 2, (returncode, stdout, stderr)
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert "Traceback" not in stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
