"""The CPU's vector features that pick ONNX Runtime's (MLAS's) kernels. Torch-free.

Whether the stock MatMul and MatMulNBits keep a row's result independent of the row count
depends on the kernel MLAS picks, and MLAS picks by these features (on AVX-512 VNNI machines
MatMulNBits' int4 rows at accuracy level 4 are invariant, on AVX2-only ones they are not). The
exporter records the signature of the CPU it measured ``exact_verify["cpu"]`` on, for op sets
that use those kernels; the runtime trusts that declaration only on a CPU of the same signature
(ort_runtime/loading/artifact.py). The loopcast ops are row-invariant on every CPU.
"""

from __future__ import annotations

import platform
from functools import cache

# The flags (as /proc/cpuinfo spells them) that change which MLAS kernel runs.
KERNEL_FLAGS = (
    # x86-64
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512dq",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    # aarch64 ("Features")
    "asimd",
    "asimddp",
    "i8mm",
    "bf16",
    "sve",
    "sve2",
)


def signature_from_cpuinfo(text: str, machine: str) -> str | None:
    """``machine`` and the kernel flags present in ``text`` (/proc/cpuinfo's first processor),
    e.g. ``x86_64: avx avx2 f16c fma``; None when it lists no flags."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            present = set(value.split())
            return f"{machine}: " + " ".join(f for f in sorted(KERNEL_FLAGS) if f in present)
    return None


@cache
def cpu_signature() -> str | None:
    """This CPU's signature (``signature_from_cpuinfo``); None where /proc/cpuinfo is not there."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read(1 << 16)
    except OSError:
        return None
    return signature_from_cpuinfo(text, platform.machine())


def same_cpu_kernels(measured_on: str | None) -> bool:
    """Whether a CPU exactness declaration measured on ``measured_on`` holds here: yes when it
    names no CPU (the loopcast ops, or an artifact from before the field) or this CPU's
    signature cannot be read; else when the signatures are equal."""
    here = cpu_signature()
    return measured_on is None or here is None or measured_on == here
