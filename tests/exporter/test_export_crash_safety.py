"""Export under kills and OS errors (loopcast/swap.py): the artifact path is never left missing
for good, leftovers are cleaned, and an OS error is one `error:` line with nothing replaced.

Kills are real SIGKILLs of a subprocess at the swap's documented test hook
(``LOOPCAST_TEST_CRASH_AT``); the full disk is a real EFBIG from a file-size limit."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from loopcast.exporter.export import ExportOptions, export_checkpoint
from loopcast.ort_runtime import load

from loopcast.errors import ExportError
from loopcast.swap import Staging, recover
from tests.artifacts import checkpoint
from tests.cli.test_cli_foundation import assert_one_error_line


def _export_cli(ckpt: Path, out: Path, *extra: str, env: dict | None = None, preexec=None, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "loopcast.cli", "export", str(ckpt), "-o", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
        preexec_fn=preexec,
        cwd=cwd,
    )


def _last_line(stderr: str) -> str:
    """The error line, past the progress bar's carriage-return updates."""
    return stderr.replace("\r", "\n").splitlines()[-1] + "\n"


def _width(out: Path) -> int:
    return json.loads((out / "manifest.json").read_text())["verify_width"]


def _hidden(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.fixture()
def old(tmp_path) -> tuple[Path, Path]:
    ckpt = checkpoint("ouro-r3")
    out = tmp_path / "art"
    export_checkpoint(ckpt, out, ExportOptions(verify_width=5))
    return ckpt, out


def test_kill_between_the_two_renames_is_recovered_by_the_next_load(old) -> None:
    ckpt, out = old
    proc = _export_cli(
        ckpt,
        out,
        "--overwrite",
        "--verify-width",
        "3",
        env={"LOOPCAST_SWAP": "rename", "LOOPCAST_TEST_CRASH_AT": "aside"},
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not out.exists()  # the moment the old code never recovered
    assert load(out).generate([5, 6, 7], 3).tokens  # the load puts the old artifact back
    assert _width(out) == 5
    export_checkpoint(ckpt, out, ExportOptions(verify_width=3), overwrite=True)
    assert _width(out) == 3 and _hidden(out.parent) == []  # the killed run's staging is gone too


def test_kill_after_the_atomic_exchange_leaves_the_new_artifact(old) -> None:
    ckpt, out = old
    proc = _export_cli(
        ckpt, out, "--overwrite", "--verify-width", "3", env={"LOOPCAST_TEST_CRASH_AT": "swapped"}
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert _width(out) == 3  # never missing: old or new, whole
    assert len(_hidden(out.parent)) == 1  # the old copy, not yet removed
    export_checkpoint(ckpt, out, ExportOptions(verify_width=4), overwrite=True)
    assert _width(out) == 4 and _hidden(out.parent) == []


def test_full_disk_is_one_error_line_and_keeps_the_old_artifact(old) -> None:
    ckpt, out = old

    def small_files():  # writes past 64 KiB fail with EFBIG, as ENOSPC would on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))

    before = (out / "weights.safetensors").read_bytes()
    proc = _export_cli(ckpt, out, "--overwrite", "--verify-width", "3", preexec=small_files)
    assert_one_error_line(
        proc.returncode,
        proc.stdout,
        _last_line(proc.stderr),
        "cannot write the artifact",
        "nothing was replaced",
    )
    assert "Traceback" not in proc.stderr
    assert _width(out) == 5 and (out / "weights.safetensors").read_bytes() == before
    assert _hidden(out.parent) == []


def test_output_is_the_current_directory(old) -> None:
    ckpt, out = old
    proc = _export_cli(ckpt, ".", "--overwrite", cwd=out)
    assert_one_error_line(proc.returncode, proc.stdout, _last_line(proc.stderr), "current directory")
    assert _width(out) == 5


def test_unwritable_destination(tmp_path) -> None:
    with pytest.raises(ExportError, match="cannot write the artifact"):
        export_checkpoint(checkpoint("ouro-r3"), "/proc/loopcast-test/art")


def test_cleanup_spares_a_live_export(tmp_path) -> None:
    out = tmp_path / "art"
    live = Staging(out)  # another export, still writing
    dead = tmp_path / f".{out.name}.staging.killed"  # one whose process is gone
    dead.mkdir()
    (dead / "weights.safetensors").write_bytes(b"partial")
    assert recover(out) is False
    assert live.path.is_dir() and not dead.exists()
    live.discard()
    assert _hidden(tmp_path) == []


def test_with_verify_width_records_hashes_and_leaves_nothing(old, tmp_path) -> None:
    from loopcast.exporter.export import with_verify_width

    from loopcast.manifest import Manifest
    from loopcast.manifest_schema import verify_hashes

    _, src = old
    out = tmp_path / "w3"
    with_verify_width(src, out, 3)
    with_verify_width(src, out, 3, overwrite=True)
    assert Manifest.read(out).verify_width == 3 and _hidden(tmp_path) == []
    assert len(verify_hashes(Manifest.read(out), out)) == len(Manifest.read(out).files)
