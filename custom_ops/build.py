"""Build the custom-op library (``loopcast build-ops``): CPU kernels, plus CUDA kernels when nvcc
is available, in one shared object.

The ONNX Runtime C/C++ headers are not in the onnxruntime wheels. They are looked up in
``$LOOPCAST_ORT_INCLUDE``, then in the repository's ``.cdeps`` (``tools/c_generate/fetch_deps.sh``
unpacks Debian's libonnxruntime-dev there), then in ``/usr/include/onnxruntime``. The C API is
forward compatible, so a library built against older headers loads in a newer runtime.

CUDA: nvcc is ``$LOOPCAST_NVCC`` or the one on PATH; ``LOOPCAST_NO_CUDA=1`` turns it off. The
kernels target sm_90 by default (``cuda_archs`` / ``$LOOPCAST_CUDA_ARCHS``, e.g. ``90,100``; PTX
of the lowest is kept so newer GPUs can JIT it; sm_80 is not possible: the kernels use sm_90
PTX, griddepcontrol and TMA) and link cudart statically, with its symbols kept private, so the
library has no libcudart dependency, still loads in a CPU-only runtime on a machine without a
GPU, and never mixes its runtime with the host process's (torch, ORT).

Prebuilt copies (``tools/release/build_ops_wheel.py``) are found by ``custom_ops/library.py``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from loopcast.errors import LoopcastError

LIBRARY_NAME = "libloopcast_ops.so"
SOURCES = (
    "loopcast_ops.cc",
    "matmul_cpu.cc",
    "attention_cpu.cc",
    "row_attention_cpu.cc",
    "residual_norm_cpu.cc",
    "swiglu_cpu.cc",
    "lane_step_cpu.cc",
    "matmul_nbits_cpu.cc",
    "matmul_nbits_q8_cpu.cc",
    "matmul_nbits_q8_avx2.cc",
    "matmul_nbits_q8_rows.cc",
)
CUDA_SOURCES = ("cuda_ops.cc",)  # host glue, compiled by the C++ compiler
CUDA_KERNELS = (
    # the int4/int8 kernels' specializations, one (dtype, bits) a file: minutes each, so first
    *(f"matmul_nbits_{dtype}_int{bits}.cu" for dtype in ("f16", "bf16", "f32") for bits in (4, 8)),
    "matmul_cuda.cu",
    "matmul_mma_cuda.cu",
    "attention_cuda.cu",
    "residual_norm_cuda.cu",
    "swiglu_cuda.cu",
    "kv_move_cuda.cu",
    "lane_step_cuda.cu",
    "matmul_nbits_cuda.cu",
)
_HERE = Path(__file__).resolve().parent
# -ffp-contract=off: a kernel compiled for several ISAs (matmul_nbits_cpu.cc's target_clones)
# gives the same bits on each, FMA hardware or not.
_CXXFLAGS = ["-O3", "-std=c++17", "-fPIC", "-Wall", "-Werror", "-ffp-contract=off"]
_NVCCFLAGS = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC,-Wall", "--cudart", "static"]
DEFAULT_CUDA_ARCHS = ("90",)


def cuda_archs(requested: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """Sorted SM versions to compile: ``requested``, else ``$LOOPCAST_CUDA_ARCHS``, else sm_90."""
    archs = requested or tuple(
        a for a in os.environ.get("LOOPCAST_CUDA_ARCHS", "").replace(" ", "").split(",") if a
    )
    archs = (
        tuple(sorted(set(archs or DEFAULT_CUDA_ARCHS), key=int)) if all(a.isdigit() for a in archs) else ()
    )
    if not archs or int(archs[0]) < 90:
        raise LoopcastError(
            f"CUDA architectures must be SM numbers >= 90 (e.g. 90,100), got {requested or archs!r}: "
            "the kernels use sm_90 features (griddepcontrol, TMA)"
        )
    return archs


def _gencode(archs: tuple[str, ...]) -> list[str]:
    """SASS for each arch, plus PTX of the lowest so later GPUs can JIT-compile it."""
    flags = []
    for arch in archs:
        code = f"[sm_{arch},compute_{arch}]" if arch == archs[0] else f"sm_{arch}"
        flags += ["-gencode", f"arch=compute_{arch},code={code}"]
    return flags


def source_digest() -> str:
    """SHA-256 over the kernel sources and this build recipe: a prebuilt library is used only
    when it was built from exactly these (an edited kernel is rebuilt, never replaced)."""
    digest = hashlib.sha256()
    for source in sorted((_HERE / "src").iterdir()):
        if source.is_file():
            digest.update(source.name.encode() + source.read_bytes())
    digest.update(Path(__file__).read_bytes())
    return digest.hexdigest()


def fetched_headers_dir() -> Path:
    """Where ``fetch_ort_headers`` unpacks the headers on first use: the loopcast cache."""
    return Path(os.environ.get("LOOPCAST_CACHE", Path.home() / ".cache" / "loopcast")) / "ort-headers"


def find_ort_include() -> Path | None:
    candidates = [
        os.environ.get("LOOPCAST_ORT_INCLUDE"),
        _HERE.parent / ".cdeps" / "usr" / "include" / "onnxruntime",
        fetched_headers_dir() / "usr" / "include" / "onnxruntime",
        "/usr/include/onnxruntime",
    ]
    for candidate in candidates:
        if candidate and (Path(candidate) / "onnxruntime_cxx_api.h").is_file():
            return Path(candidate)
    return None


def fetch_ort_headers(log=print) -> Path:
    """Fetch the ONNX Runtime headers from the machine's package sources into the cache
    (``fetch_ort_headers.sh``: apt's configured sources, else Debian's package of them; no root,
    nothing installed). ``LOOPCAST_NO_FETCH=1`` turns it off. Raises with the fixing command."""
    fix = (
        "run tools/c_generate/fetch_deps.sh, or set LOOPCAST_ORT_INCLUDE to a folder holding "
        "onnxruntime_cxx_api.h"
    )
    if os.environ.get("LOOPCAST_NO_FETCH") == "1":
        raise LoopcastError(f"the ONNX Runtime C headers the op library compiles against are missing: {fix}")
    log("loopcast: fetching the ONNX Runtime C headers (libonnxruntime-dev, headers only) ...")
    script = _HERE / "fetch_ort_headers.sh"
    proc = subprocess.run(
        ["bash", str(script), str(fetched_headers_dir())], capture_output=True, text=True, timeout=300
    )
    include = find_ort_include()
    if proc.returncode != 0 or include is None:
        lines = (proc.stderr or proc.stdout).strip().splitlines() or ["(no output)"]
        raise LoopcastError(
            f"the ONNX Runtime C headers the op library compiles against are missing and could not be "
            f"fetched ({lines[-1][:200]}): {fix}"
        )
    return include


def find_nvcc() -> Path | None:
    """nvcc from ``$LOOPCAST_NVCC`` or PATH; None when absent or ``LOOPCAST_NO_CUDA=1``."""
    if os.environ.get("LOOPCAST_NO_CUDA") == "1":
        return None
    found = shutil.which(os.environ.get("LOOPCAST_NVCC") or "nvcc")
    return Path(found) if found else None


def gpu_present() -> bool:
    """Whether this machine has an NVIDIA GPU driver (its device nodes or its proc entry)."""
    return Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia/version").exists()


def cuda_on_first_use() -> bool:
    """Whether a build made on first use (an export) compiles the CUDA kernels: only where nvcc
    is here and a GPU is too, or ``LOOPCAST_CUDA=1`` asks for them (they take minutes to compile
    and nothing on a GPU-less machine runs them). ``loopcast build-ops`` builds them whenever
    nvcc is found."""
    if find_nvcc() is None:
        return False
    return os.environ.get("LOOPCAST_CUDA") == "1" or gpu_present()


def has_cuda(library: str | os.PathLike) -> bool:
    """Whether a built library carries the CUDA kernels (loading it touches no GPU)."""
    return bool(ctypes.CDLL(str(library)).loopcast_ops_has_cuda())


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines() or ["(no output)"]
        first = next((line for line in lines if "error" in line.lower()), lines[0])
        raise LoopcastError(f"building {LIBRARY_NAME} failed ({what}): {first}")


def _unwritable(out: Path, exc: OSError) -> LoopcastError:
    return LoopcastError(
        f"{out}: cannot build the op library there ({exc.strerror or exc}); choose a writable directory"
    )


def build_library(
    out_dir: str | os.PathLike | None = None,
    ort_include: str | os.PathLike | None = None,
    cuda: bool | None = None,
    archs: tuple[str, ...] | None = None,
    jobs: int | None = None,
) -> Path:
    """Compile the kernels into ``out_dir/libloopcast_ops.so`` and return its path.

    ``cuda``: None builds the CUDA kernels when nvcc is found, True requires them, False skips them.
    ``archs``: SM versions (default ``cuda_archs()``); ``jobs``: parallel compiles (default: CPUs).
    """
    out = Path(out_dir) if out_dir else _HERE / "build"
    target = out / LIBRARY_NAME
    if out.exists() and not out.is_dir():
        raise LoopcastError(f"{out}: not a directory; build-ops writes {LIBRARY_NAME} into a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file, an unwritable directory, /proc: the user's input, not a bug
        raise _unwritable(out, exc) from None
    try:
        # A private work directory per build: concurrent builds into one folder (parallel test
        # workers, two exports) must not share object files or a staging name.
        work = Path(tempfile.mkdtemp(prefix=".build.", dir=out))
    except OSError as exc:
        raise _unwritable(out, exc) from None
    staging = work / LIBRARY_NAME
    src = _HERE / "src"
    try:
        include = Path(ort_include) if ort_include else find_ort_include()
        if include is None or not (include / "onnxruntime_cxx_api.h").is_file():
            raise LoopcastError(
                "ONNX Runtime C++ headers not found (set LOOPCAST_ORT_INCLUDE or run "
                "tools/c_generate/fetch_deps.sh)"
            )
        compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
        if compiler is None:
            raise LoopcastError("no C++ compiler found (install g++ or set CXX)")
        nvcc = find_nvcc() if cuda is not False else None
        if cuda is True and nvcc is None:
            raise LoopcastError(
                "CUDA kernels requested but nvcc not found (set LOOPCAST_NVCC or put nvcc on PATH; "
                "LOOPCAST_NO_CUDA=1 disables it)"
            )
        gencode = _gencode(cuda_archs(archs)) if nvcc is not None else []
        if nvcc is None:
            _run(
                [
                    compiler,
                    *_CXXFLAGS,
                    "-shared",
                    f"-I{include}",
                    *[str(src / s) for s in SOURCES],
                    "-o",
                    str(staging),
                ],
                "C++",
            )
        else:
            compiles = [
                (
                    [
                        compiler,
                        *_CXXFLAGS,
                        "-DLOOPCAST_WITH_CUDA",
                        f"-I{include}",
                        "-c",
                        str(src / s),
                        "-o",
                        str(work / f"{s}.o"),
                    ],
                    s,
                )
                for s in (*SOURCES, *CUDA_SOURCES)
            ]
            # Kernels first: they take minutes each, the host files seconds.
            compiles = [
                (
                    [
                        str(nvcc),
                        *_NVCCFLAGS,
                        *gencode,
                        f"-I{src}",
                        "-c",
                        str(src / s),
                        "-o",
                        str(work / f"{s}.o"),
                    ],
                    s,
                )
                for s in CUDA_KERNELS
            ] + compiles
            with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
                list(pool.map(lambda job: _run(*job), compiles))  # list(): re-raises the first failure
            objects = [cmd[-1] for cmd, _ in compiles]
            # --exclude-libs keeps the static cudart's symbols private; -Bsymbolic binds our own
            # calls to our copy even when the process has loaded another libcudart.
            _run(
                [
                    str(nvcc),
                    "-shared",
                    "--cudart",
                    "static",
                    "-Xcompiler",
                    "-fPIC",
                    "-Xlinker",
                    "--exclude-libs,ALL",
                    "-Xlinker",
                    "-Bsymbolic",
                    *objects,
                    "-o",
                    str(staging),
                ],
                "link",
            )
        try:
            staging.replace(target)  # never leave a half-written library under the real name
        except OSError as exc:
            raise LoopcastError(f"{target}: cannot write the op library ({exc.strerror or exc})") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # A library this user compiled is trusted by hash when an artifact carries it (docs/trust.md).
    from loopcast.ops_trust import record_local_build

    record_local_build(target)
    return target
