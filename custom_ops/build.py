"""Build the custom-op library (``loopcast build-ops``): CPU kernels, plus CUDA kernels when nvcc
is available, in one shared object.

The ONNX Runtime C/C++ headers are not in the onnxruntime wheels. They are looked up in
``$LOOPCAST_ORT_INCLUDE``, then in the repository's ``.cdeps`` (``tools/c_generate/fetch_deps.sh``
unpacks Debian's libonnxruntime-dev there), then in ``/usr/include/onnxruntime``. The C API is
forward compatible, so a library built against older headers loads in a newer runtime.

CUDA: nvcc is ``$LOOPCAST_NVCC`` or the one on PATH; ``LOOPCAST_NO_CUDA=1`` turns it off. The
kernels target sm_90 (plus compute_90 PTX) and link cudart statically, with its symbols kept
private, so the library has no libcudart dependency, still loads in a CPU-only runtime on a
machine without a GPU, and never mixes its runtime with the host process's (torch, ORT).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from loopcast.errors import LoopcastError

LIBRARY_NAME = "libloopcast_ops.so"
SOURCES = ("loopcast_ops.cc", "matmul_cpu.cc", "attention_cpu.cc", "residual_norm_cpu.cc", "swiglu_cpu.cc")
CUDA_SOURCES = ("cuda_ops.cc",)             # host glue, compiled by the C++ compiler
CUDA_KERNELS = ("matmul_cuda.cu", "attention_cuda.cu", "residual_norm_cuda.cu", "swiglu_cuda.cu",
                "decoder_layer_cuda.cu")
_HERE = Path(__file__).resolve().parent
_CXXFLAGS = ["-O3", "-std=c++17", "-fPIC", "-Wall", "-Werror"]
_NVCCFLAGS = ["-O3", "-std=c++17", "-gencode", "arch=compute_90,code=[sm_90,compute_90]",
              "-Xcompiler", "-fPIC,-Wall", "--cudart", "static"]


def find_ort_include() -> Path | None:
    candidates = [os.environ.get("LOOPCAST_ORT_INCLUDE"),
                  _HERE.parent / ".cdeps" / "usr" / "include" / "onnxruntime",
                  "/usr/include/onnxruntime"]
    for candidate in candidates:
        if candidate and (Path(candidate) / "onnxruntime_cxx_api.h").is_file():
            return Path(candidate)
    return None


def find_nvcc() -> Path | None:
    """nvcc from ``$LOOPCAST_NVCC`` or PATH; None when absent or ``LOOPCAST_NO_CUDA=1``."""
    if os.environ.get("LOOPCAST_NO_CUDA") == "1":
        return None
    found = shutil.which(os.environ.get("LOOPCAST_NVCC") or "nvcc")
    return Path(found) if found else None


def has_cuda(library: str | os.PathLike) -> bool:
    """Whether a built library carries the CUDA kernels (loading it touches no GPU)."""
    return bool(ctypes.CDLL(str(library)).loopcast_ops_has_cuda())


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines() or ["(no output)"]
        first = next((line for line in lines if "error" in line.lower()), lines[0])
        raise LoopcastError(f"building {LIBRARY_NAME} failed ({what}): {first}")


def build_library(out_dir: str | os.PathLike | None = None, ort_include: str | os.PathLike | None = None,
                  cuda: bool | None = None) -> Path:
    """Compile the kernels into ``out_dir/libloopcast_ops.so`` and return its path.

    ``cuda``: None builds the CUDA kernels when nvcc is found, True requires them, False skips them.
    """
    include = Path(ort_include) if ort_include else find_ort_include()
    if include is None or not (include / "onnxruntime_cxx_api.h").is_file():
        raise LoopcastError("ONNX Runtime C++ headers not found (set LOOPCAST_ORT_INCLUDE or run "
                            "tools/c_generate/fetch_deps.sh)")
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if compiler is None:
        raise LoopcastError("no C++ compiler found (install g++ or set CXX)")
    nvcc = find_nvcc() if cuda is not False else None
    if cuda is True and nvcc is None:
        raise LoopcastError("CUDA kernels requested but nvcc not found (set LOOPCAST_NVCC or put nvcc on PATH; "
                            "LOOPCAST_NO_CUDA=1 disables it)")
    out = Path(out_dir) if out_dir else _HERE / "build"
    out.mkdir(parents=True, exist_ok=True)
    target = out / LIBRARY_NAME
    # A private work directory per build: concurrent builds into one folder (parallel test
    # workers, two exports) must not share object files or a staging name.
    work = Path(tempfile.mkdtemp(prefix=".build.", dir=out))
    staging = work / LIBRARY_NAME
    src = _HERE / "src"
    try:
        if nvcc is None:
            _run([compiler, *_CXXFLAGS, "-shared", f"-I{include}", *[str(src / s) for s in SOURCES],
                  "-o", str(staging)], "C++")
        else:
            objs = work
            objects = []
            for s in (*SOURCES, *CUDA_SOURCES):
                obj = objs / f"{s}.o"
                _run([compiler, *_CXXFLAGS, "-DLOOPCAST_WITH_CUDA", f"-I{include}", "-c", str(src / s),
                      "-o", str(obj)], s)
                objects.append(str(obj))
            for s in CUDA_KERNELS:
                obj = objs / f"{s}.o"
                _run([str(nvcc), *_NVCCFLAGS, f"-I{src}", "-c", str(src / s), "-o", str(obj)], s)
                objects.append(str(obj))
            # --exclude-libs keeps the static cudart's symbols private; -Bsymbolic binds our own
            # calls to our copy even when the process has loaded another libcudart.
            _run([str(nvcc), "-shared", "--cudart", "static", "-Xcompiler", "-fPIC",
                  "-Xlinker", "--exclude-libs,ALL", "-Xlinker", "-Bsymbolic", *objects, "-o", str(staging)],
                 "link")
        staging.replace(target)  # never leave a half-written library under the real name
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # A library this user compiled is trusted by hash when an artifact carries it (docs/trust.md).
    from loopcast.ops_trust import record_local_build
    record_local_build(target)
    return target
