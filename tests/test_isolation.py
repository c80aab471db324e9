"""The suite keeps off the user's files: HOME, the loopcast cache with its trusted-ops registry,
the temp dir and Ray's temp dir are the session's own (tests/conftest.py's ``isolation``), and a
library the suite builds or records is trusted there, never in the user's registry."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from loopcast.ops_trust import locally_built_hashes, record_local_build, registry_path


def _inside(path: Path, root: Path) -> bool:
    return Path(path).resolve().is_relative_to(Path(root).resolve())


def test_user_dirs_point_into_the_session_temp_dir(isolation) -> None:
    assert isolation.home != isolation.real_home
    for path in (
        Path.home(),
        Path(os.environ["LOOPCAST_CACHE"]),
        registry_path(),
        Path(tempfile.gettempdir()),
    ):
        assert _inside(path, isolation.root), path
        assert not _inside(path, isolation.real_home), path
    assert not _inside(os.environ["RAY_TMPDIR"], isolation.real_home)
    assert Path(os.environ["RAY_TMPDIR"]) != Path("/tmp/ray")


def test_a_recorded_library_is_trusted_in_the_session_registry_only(isolation, tmp_path) -> None:
    real_registry = isolation.real_cache / registry_path().name
    before = real_registry.read_bytes() if real_registry.is_file() else None
    library = tmp_path / "libtest.so"
    library.write_bytes(os.urandom(64))
    digest = record_local_build(library)
    assert digest in locally_built_hashes()
    assert _inside(registry_path(), isolation.root)
    assert (real_registry.read_bytes() if real_registry.is_file() else None) == before
    if before is not None:  # the libraries this session built are not trusted there either
        assert str(isolation.root) not in before.decode(errors="replace")


def test_subprocesses_inherit_the_isolation(isolation) -> None:
    code = "import os, pathlib, tempfile; print(pathlib.Path.home()); print(tempfile.gettempdir())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    home, tmp = out.stdout.split()
    assert _inside(Path(home), isolation.root) and _inside(Path(tmp), isolation.root)
