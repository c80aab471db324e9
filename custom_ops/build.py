"""Build the custom-op library (``loopcast build-ops``): CPU kernels, one shared object.

The ONNX Runtime C/C++ headers are not in the onnxruntime wheels. They are looked up in
``$LOOPCAST_ORT_INCLUDE``, then in the repository's ``.cdeps`` (``tools/c_generate/fetch_deps.sh``
unpacks Debian's libonnxruntime-dev there), then in ``/usr/include/onnxruntime``. The C API is
forward compatible, so a library built against older headers loads in a newer runtime.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from loopcast.errors import LoopcastError

LIBRARY_NAME = "libloopcast_ops.so"
SOURCES = ("loopcast_ops.cc",)
_HERE = Path(__file__).resolve().parent


def find_ort_include() -> Path | None:
    candidates = [os.environ.get("LOOPCAST_ORT_INCLUDE"),
                  _HERE.parent / ".cdeps" / "usr" / "include" / "onnxruntime",
                  "/usr/include/onnxruntime"]
    for candidate in candidates:
        if candidate and (Path(candidate) / "onnxruntime_cxx_api.h").is_file():
            return Path(candidate)
    return None


def build_library(out_dir: str | os.PathLike | None = None, ort_include: str | os.PathLike | None = None) -> Path:
    """Compile the CPU kernels into ``out_dir/libloopcast_ops.so`` and return its path."""
    include = Path(ort_include) if ort_include else find_ort_include()
    if include is None or not (include / "onnxruntime_cxx_api.h").is_file():
        raise LoopcastError("ONNX Runtime C++ headers not found (set LOOPCAST_ORT_INCLUDE or run "
                            "tools/c_generate/fetch_deps.sh)")
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if compiler is None:
        raise LoopcastError("no C++ compiler found (install g++ or set CXX)")
    out = Path(out_dir) if out_dir else _HERE / "build"
    out.mkdir(parents=True, exist_ok=True)
    target = out / LIBRARY_NAME
    staging = out / f".{LIBRARY_NAME}.tmp"
    cmd = [compiler, "-O2", "-std=c++17", "-fPIC", "-shared", "-Wall", "-Werror", f"-I{include}",
           *[str(_HERE / "src" / s) for s in SOURCES], "-o", str(staging)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        staging.unlink(missing_ok=True)
        first = (proc.stderr.strip().splitlines() or ["(no output)"])[0]
        raise LoopcastError(f"building {LIBRARY_NAME} failed: {first}")
    staging.replace(target)  # never leave a half-written library under the real name
    return target
