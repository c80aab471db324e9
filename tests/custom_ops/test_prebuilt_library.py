"""The prebuilt library: tools/release/build_ops_wheel.py makes an installable wheel, exports use its
library when it matches the kernel sources, and fall back to a local build, announced on
stderr, when it does not. CPU kernels only (the CUDA wheel is built on release, see
docs/install.md); each export runs in a fresh interpreter
with the wheel installed into its own directory and an empty loopcast cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from loopcast.custom_ops.build import find_ort_include, source_digest

from tests.artifacts import checkpoint
from tests.custom_ops.conftest import require_c_toolchain

pytestmark = pytest.mark.slow  # a wheel build (~15 s) and two exports in fresh interpreters

ROOT = Path(__file__).resolve().parents[2]

EXPORT = """
import json, sys
from loopcast.exporter.export import ExportOptions, export_checkpoint
from loopcast.custom_ops.library import usable_prebuilt
manifest = export_checkpoint(sys.argv[1], sys.argv[2], ExportOptions(max_length=32, batch_invariant=True))
prebuilt, why = usable_prebuilt()
print(json.dumps([manifest.custom_op_library, str(prebuilt.library) if prebuilt else None, why]))
"""


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory) -> Path:
    """The CPU-only wheel, built by the release script and installed with pip into a directory."""
    require_c_toolchain()
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "release" / "build_ops_wheel.py"),
            "--no-cuda",
            "--out",
            str(tmp / "dist"),
            "--ort-include",
            str(find_ort_include()),
        ],
        check=True,
        capture_output=True,
    )
    wheel = next((tmp / "dist").glob("loopcast_ops-*.whl"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--target",
            str(tmp / "site"),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    return tmp / "site"


def _export(site: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess, list[str]]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
        "LOOPCAST_CACHE": str(tmp_path / "cache"),
        "LOOPCAST_NO_CUDA": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", EXPORT, str(checkpoint("llama-tied-gqa")), str(tmp_path / "art")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads(proc.stdout.strip().splitlines()[-1])


def test_export_uses_the_matching_prebuilt_library(installed_wheel: Path, tmp_path: Path) -> None:
    info = json.loads((installed_wheel / "loopcast_ops" / "build_info.json").read_text())
    assert info["source_digest"] == source_digest() and info["cuda_archs"] == []
    proc, (name, prebuilt, _) = _export(installed_wheel, tmp_path)
    assert prebuilt == str(installed_wheel / "loopcast_ops" / "libloopcast_ops.so")
    assert (tmp_path / "art" / name).read_bytes() == Path(prebuilt).read_bytes()
    assert "building the custom-op library" not in proc.stderr
    assert not list(
        (tmp_path / "cache").glob("ops-*")
    )  # nothing compiled (the cache holds only the trust registry)


def test_a_prebuilt_library_from_other_sources_is_not_used(installed_wheel: Path, tmp_path: Path) -> None:
    stale = tmp_path / "site"
    (stale / "loopcast_ops").mkdir(parents=True)
    for item in (installed_wheel / "loopcast_ops").iterdir():
        if item.is_file():
            (stale / "loopcast_ops" / item.name).write_bytes(item.read_bytes())
    info = json.loads((stale / "loopcast_ops" / "build_info.json").read_text())
    (stale / "loopcast_ops" / "build_info.json").write_text(json.dumps({**info, "source_digest": "0" * 64}))
    proc, (name, prebuilt, why) = _export(stale, tmp_path)
    assert prebuilt is None and "other kernel sources" in why
    assert "building the custom-op library (CPU kernels" in proc.stderr  # the visible fallback
    built = list((tmp_path / "cache").glob("ops-*/libloopcast_ops.so"))
    assert len(built) == 1 and (tmp_path / "art" / name).read_bytes() == built[0].read_bytes()


def test_a_cpu_only_prebuilt_library_yields_to_a_local_cuda_build(installed_wheel: Path) -> None:
    """With nvcc present and CUDA kernels wanted (a GPU, or LOOPCAST_CUDA=1) the export would lack
    kernels it can have: build instead. On a machine without a GPU the prebuilt one serves."""

    def usable(**extra: str) -> str:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(installed_wheel), str(ROOT)]),
            "LOOPCAST_NVCC": sys.executable,  # any executable: only its presence is asked
            **extra,
        }
        env.pop("LOOPCAST_NO_CUDA", None)
        if not extra:
            env.pop("LOOPCAST_CUDA", None)
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                "from loopcast.custom_ops.library import usable_prebuilt; print(usable_prebuilt())",
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    wanted = usable(LOOPCAST_CUDA="1")
    assert "None" in wanted and "no CUDA kernels and they can be built here" in wanted
    from loopcast.custom_ops.build import gpu_present

    if not gpu_present():
        assert "Prebuilt(" in usable()
