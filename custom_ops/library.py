"""Which custom-op library an export uses: the prebuilt one when it fits, else a local build.

A prebuilt library comes from the ``loopcast-ops`` platform wheel (``tools/release/build_ops_wheel.py``
builds it once per release: CPU kernels plus CUDA kernels for sm_90 and sm_100), installed
as the data-only package ``loopcast_ops``: ``libloopcast_ops.so`` and ``build_info.json``
beside it. Nothing in that package is imported or executed to find it.

It is used when it was built from exactly these kernel sources (``build.source_digest()``)
and it has CUDA kernels or this machine could not add them anyway (no nvcc); otherwise the
library is compiled into the loopcast cache, once per source version, with a message on
stderr first, since a CUDA build takes minutes.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from loopcast.custom_ops import build

PREBUILT_PACKAGE = "loopcast_ops"
BUILD_INFO = "build_info.json"


@dataclass(frozen=True)
class Prebuilt:
    library: Path
    source_digest: str
    cuda_archs: tuple[str, ...]  # empty: CPU kernels only


def find_prebuilt() -> Prebuilt | None:
    """The installed ``loopcast_ops`` library and what it was built from; None when absent."""
    spec = importlib.util.find_spec(PREBUILT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        info_path = Path(location) / BUILD_INFO
        library = Path(location) / build.LIBRARY_NAME
        if info_path.is_file() and library.is_file():
            try:
                info = json.loads(info_path.read_text())
                return Prebuilt(library, str(info["source_digest"]), tuple(info["cuda_archs"]))
            except (OSError, ValueError, KeyError, TypeError):
                return None  # a damaged install is as good as none: build locally
    return None


def usable_prebuilt() -> tuple[Prebuilt | None, str]:
    """The prebuilt library if this export may use it, else None and the reason."""
    prebuilt = find_prebuilt()
    if prebuilt is None:
        return None, "no prebuilt library installed"
    if prebuilt.source_digest != build.source_digest():
        return None, "the installed prebuilt library was built from other kernel sources"
    if not prebuilt.cuda_archs and build.cuda_on_first_use():
        return None, "the installed prebuilt library has no CUDA kernels and they can be built here"
    return prebuilt, ""


SOURCE_STAMP = "source_digest.txt"  # beside a local build: the kernel sources' digest


def _build_dir() -> tuple[Path, Path | None]:
    """Where the local build for these sources and switches lives in the loopcast cache, and the
    nvcc it compiles CUDA kernels with (None: CPU kernels only)."""
    digest = hashlib.sha256(build.source_digest().encode())
    # Whether CUDA kernels can be built is part of the key: a CPU-only library cached before
    # nvcc was installed must not be reused.
    nvcc = build.find_nvcc() if build.cuda_on_first_use() else None
    digest.update(f"nvcc={nvcc} cxx={os.environ.get('CXX', '')}".encode())
    for var in (
        "LOOPCAST_NO_CUDA",
        "LOOPCAST_CUDA",
        "LOOPCAST_NVCC",
        "LOOPCAST_ORT_INCLUDE",
        "LOOPCAST_CUDA_ARCHS",
    ):
        digest.update(f"{var}={os.environ.get(var, '')}".encode())
    root = Path(os.environ.get("LOOPCAST_CACHE", Path.home() / ".cache" / "loopcast"))
    out = root / f"ops-{digest.hexdigest()[:12]}"
    return out, nvcc


def cached_build() -> Path | None:
    """The local build for these sources and switches, if one was made already."""
    library = _build_dir()[0] / build.LIBRARY_NAME
    return library if library.is_file() else None


def custom_op_library() -> Path:
    """A path to the library an export copies into its artifact: the prebuilt one, else the
    local build in the loopcast cache, compiled on first use (keyed by sources and switches,
    so an edited kernel is rebuilt and an unchanged one is reused by every export)."""
    prebuilt, why = usable_prebuilt()
    if prebuilt is not None:
        return prebuilt.library
    out, nvcc = _build_dir()
    library = out / build.LIBRARY_NAME
    if not library.is_file():
        if build.find_ort_include() is None:  # before announcing a build that could not start
            build.fetch_ort_headers(log=lambda line: print(line, file=sys.stderr, flush=True))
        what = (
            f"CPU kernels + CUDA kernels for sm_{', sm_'.join(build.cuda_archs())}: several minutes"
            if nvcc is not None
            else "CPU kernels: about 10 s"
        )
        print(
            f"loopcast: {why}; building the custom-op library ({what}) into {out} ...",
            file=sys.stderr,
            flush=True,
        )
        build.build_library(out, cuda=nvcc is not None)
        # what it was built from, for a copy carried to another machine (tools/gpu_machine)
        (out / SOURCE_STAMP).write_text(build.source_digest())
        print(f"loopcast: built {library}", file=sys.stderr, flush=True)
    return library
