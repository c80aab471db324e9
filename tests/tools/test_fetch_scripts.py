"""The header and dependency fetch scripts: valid shell, and a privileged step that cannot run
says what it needs instead of failing inside apt-get."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = [
    ROOT / "tools" / "c_generate" / "fetch_deps.sh",
    ROOT / "custom_ops" / "fetch_ort_headers.sh",
]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse(script: Path) -> None:
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


def test_installing_cjson_without_root_says_which_command_to_run(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "id").write_text('#!/bin/sh\n[ "$1" = -u ] && echo 1000 || echo user\n')
    (fake / "sudo").write_text("#!/bin/sh\nexit 1\n")  # no passwordless sudo either
    for tool in ("id", "sudo"):
        (fake / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:/usr/bin:/bin", "LOOPCAST_CJSON_HEADER": str(tmp_path / "none.h")}
    proc = subprocess.run(["bash", str(SCRIPTS[0])], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: the C example needs cJSON, and installing it needs root")
    assert "sudo apt-get install libcjson-dev" in proc.stderr
