"""The C example (tools/c_generate) built once per test module: skipped where its prerequisites
are missing, failed instead when CI demands them (LOOPCAST_REQUIRE_C=1)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tools" / "c_generate"
HEADERS = ROOT / ".cdeps" / "usr" / "include" / "onnxruntime" / "onnxruntime_c_api.h"


def build_c_example(build: Path) -> Path:
    """Builds the example into ``build``; the program's path."""
    missing = [
        what
        for what, ok in [
            ("make", shutil.which("make")),
            ("a C compiler", shutil.which("cc")),
            ("ORT C headers (tools/c_generate/fetch_deps.sh)", HEADERS.is_file()),
            ("cJSON", Path("/usr/include/cjson/cJSON.h").is_file()),
        ]
        if not ok
    ]
    if missing:
        if os.environ.get("LOOPCAST_REQUIRE_C") == "1":
            pytest.fail(f"C example prerequisites missing: {', '.join(missing)}")
        pytest.skip(f"C example prerequisites missing: {', '.join(missing)}")
    proc = subprocess.run(
        ["make", "-C", str(SOURCE), f"BUILD={build}", f"PYTHON={sys.executable}"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return build / "c_generate"
