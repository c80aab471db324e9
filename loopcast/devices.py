"""Which devices this install can run on, and where loopcast keeps its cache. Torch-free.

CUDA counts as available only when both halves are there: an onnxruntime build with the CUDA
execution provider (onnxruntime-gpu lists it even on a machine without a GPU) and a GPU the
driver reports (``cuDeviceGetCount`` through libcuda, so no torch import is needed to ask).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from loopcast.errors import RequestError


def cache_root() -> Path:
    """``$LOOPCAST_CACHE``, else ``~/.cache/loopcast``: exports, op builds and bench results."""
    return Path(os.environ.get("LOOPCAST_CACHE", Path.home() / ".cache" / "loopcast"))


def gpu_count() -> int:
    """GPUs the CUDA driver reports; 0 without a driver."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def cuda_available() -> bool:
    import onnxruntime as ort

    return "CUDAExecutionProvider" in ort.get_available_providers() and gpu_count() > 0


def default_device() -> str:
    return "cuda" if cuda_available() else "cpu"


# The one advice for a CPU-only onnxruntime asked for CUDA (both wheels install the module
# `onnxruntime`, so the CPU one goes first).
CUDA_INSTALL_ADVICE = "pip uninstall -y onnxruntime && pip install -e '.[cuda]' (onnxruntime-gpu replaces it)"


def check_device(device: str) -> str:
    """``device`` if this install can run it; a one-line RequestError saying what is missing."""
    if device == "cpu":
        return device
    if device != "cuda":
        raise RequestError(f"unknown device {device!r}; choose cpu or cuda")
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise RequestError(
            "--device cuda: this onnxruntime has no CUDAExecutionProvider (a CPU-only install): "
            f"{CUDA_INSTALL_ADVICE}, or use --device cpu"
        )
    if gpu_count() == 0:
        raise RequestError("--device cuda: the CUDA driver reports no GPU on this machine, use --device cpu")
    return device
