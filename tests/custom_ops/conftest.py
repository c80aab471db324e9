"""The custom-op library, built once per test session: CPU kernels, plus the CUDA kernels only
where they can run (nvcc and a GPU, or LOOPCAST_CUDA=1: ``cuda_on_first_use``); the CUDA tests
build their own library (``cuda_library``) and skip without nvcc."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from loopcast.custom_ops.build import build_library, cuda_on_first_use, find_ort_include


def require_c_toolchain() -> None:
    if find_ort_include() is None or shutil.which("c++") is None:
        if os.environ.get("LOOPCAST_REQUIRE_C") == "1":
            pytest.fail("ORT C++ headers or a C++ compiler missing")
        pytest.skip("ORT C++ headers or a C++ compiler missing (tools/c_generate/fetch_deps.sh)")


@pytest.fixture(scope="session")
def library(tmp_path_factory) -> Path:
    require_c_toolchain()
    return build_library(tmp_path_factory.mktemp("ops"), cuda=cuda_on_first_use())


@pytest.fixture(scope="module")
def cuda_library(tmp_path_factory) -> Path:
    """The library with CUDA kernels, for the ctypes GPU tests: $LOOPCAST_OPS_LIB when set (a GPU
    machine without the editable install), else built here (skipped without nvcc)."""
    if os.environ.get("LOOPCAST_OPS_LIB"):
        return Path(os.environ["LOOPCAST_OPS_LIB"])
    from loopcast.custom_ops.build import find_nvcc

    require_c_toolchain()
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    return build_library(tmp_path_factory.mktemp("cuda_ops"), cuda=True)
