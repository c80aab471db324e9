"""The CUDA BatchInvariantMatMulNBits kernel (matmul_nbits_kernel.cuh) through its C entry point
(matmul_nbits_cuda.cu) with torch device tensors, beside tests/custom_ops/test_cuda_kernels.py
(whose helpers it uses): int4 and int8 codes in MatMulNBits' layout, symmetric and with zero
points, blocks 32/64/128, against a float64 product with a numpy dequantisation written here, and
row invariance: every row of an M-row call (M = 1..16, and past 16: more passes) is bit-identical
to the same row alone. Also the SwiGLU-fused form, the scalar paths (misaligned activations,
K % 8 != 0), CUDA-graph replay and, when onnxruntime is importable, the CPU op of the same library.

Runs on a GPU machine without the editable install (LOOPCAST_OPS_LIB=path/to/libloopcast_ops.so):
nothing from loopcast is imported."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from tests.custom_ops.test_cuda_kernels import (  # noqa: E402  (after the module-level CUDA skip)
    CODES,
    TOL,
    TORCH,
    _capture,
    _check,
    _dev,
    _host,
    _lib,
    as_dtype,
    session,
)
from tests.custom_ops.test_cuda_norm_kernels import _misaligned, cuda_swiglu  # noqa: E402

SCHEMES = [(4, 32, True), (4, 32, False), (4, 64, True), (4, 128, False), (8, 32, True), (8, 128, False)]
# int4 blocks of 16 (two blocks a 16-byte chunk) take the CUDA-core kernel for every dtype
SCHEMES_16 = [(4, 16, True), (4, 16, False)]


def nbits_weights(rng: np.random.Generator, N: int, K: int, bits: int, block: int, symmetric: bool) -> dict:
    """Random codes, scales and (asymmetric) zero points of an [N, K] weight, host arrays."""
    nb = -(-K // block)
    out = {
        "B": rng.integers(0, 256, (N, nb, block * bits // 8), dtype=np.uint8),
        "scales": (0.002 + 0.02 * rng.random(N * nb)).astype(np.float32),
    }
    if not symmetric:
        out["zero_points"] = rng.integers(0, 256, N * (-(-nb * bits // 8)), dtype=np.uint8)
    return out


def dequantize(w: dict, N: int, K: int, bits: int, block: int) -> np.ndarray:
    """(q - zero point) · scale per block, fp32 [N, K]; 4 bits: the low nibble first."""
    nb = -(-K // block)
    packed = w["B"]
    q = np.stack([packed & 0xF, packed >> 4], -1).reshape(N, nb, block) if bits == 4 else packed
    if "zero_points" not in w:
        zp = np.full((N, nb), 1 << (bits - 1), np.float32)
    elif bits == 4:
        z = w["zero_points"].reshape(N, -1)
        zp = np.stack([z & 0xF, z >> 4], -1).reshape(N, -1)[:, :nb].astype(np.float32)
    else:
        zp = w["zero_points"].reshape(N, nb).astype(np.float32)
    deq = (q.astype(np.float32) - zp[:, :, None]) * w["scales"].reshape(N, nb)[:, :, None]
    return deq.reshape(N, nb * block)[:, :K]


def cuda_matmul_nbits(
    lib, A: torch.Tensor, w: dict, N: int, K: int, bits: int, block: int, swiglu: bool = False
):
    """A·Wᵀ for device A [M, K] (swiglu: [M, 2K]) and the device tensors of ``w``."""
    dtype = {v: k for k, v in TORCH.items()}[A.dtype]
    M = A.shape[0]
    Y = torch.empty((M, N), dtype=A.dtype, device="cuda")
    zp = w.get("zero_points")
    _check(
        lib,
        lib.loopcast_cuda_matmul_nbits(
            CODES[dtype],
            ctypes.c_void_p(A.data_ptr()),
            ctypes.c_void_p(w["B"].data_ptr()),
            ctypes.c_void_p(w["scales"].data_ptr()),
            ctypes.c_void_p(zp.data_ptr() if zp is not None else 0),
            ctypes.c_void_p(Y.data_ptr()),
            ctypes.c_int64(M),
            ctypes.c_int64(K),
            ctypes.c_int64(N),
            bits,
            block,
            1 if swiglu else 0,
            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
        ),
    )
    torch.cuda.synchronize()
    return Y


def _on_device(w: dict) -> dict:
    return {k: torch.from_numpy(v).cuda() for k, v in w.items()}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("bits,block,symmetric", SCHEMES)
@pytest.mark.parametrize("K,N", [(2048, 1000), (5632, 64), (200, 37), (100, 9)])
def test_matches_reference_and_rows_are_invariant(
    cuda_library: Path, dtype: str, bits: int, block: int, symmetric: bool, K: int, N: int
) -> None:
    """fp16 / bf16: the tensor-core kernel (matmul_nbits_mma.cuh); fp32: the CUDA-core kernel."""
    _reference_and_rows(cuda_library, dtype, bits, block, symmetric, K, N)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("bits,block,symmetric", SCHEMES + SCHEMES_16)
@pytest.mark.parametrize("K,N", [(2048, 1000), (200, 37)])
def test_cuda_core_kernel_matches_reference_and_rows_are_invariant(
    cuda_library: Path, dtype: str, bits: int, block: int, symmetric: bool, K: int, N: int, monkeypatch
) -> None:
    """The CUDA-core kernel on 16-bit activations: LOOPCAST_NBITS_MMA=0 (read at every launch), and
    int4 blocks of 16 whatever the switch says."""
    if block != 16:
        monkeypatch.setenv("LOOPCAST_NBITS_MMA", "0")
    _reference_and_rows(cuda_library, dtype, bits, block, symmetric, K, N)


def _reference_and_rows(
    cuda_library: Path, dtype: str, bits: int, block: int, symmetric: bool, K: int, N: int
) -> None:
    lib = _lib(cuda_library)
    rng = np.random.default_rng(K + N + bits + block)
    host = nbits_weights(rng, N, K, bits, block, symmetric)
    w = _on_device(host)
    A = as_dtype(rng.standard_normal((40, K)), dtype)
    dA = _dev(A, dtype)
    full = _host(cuda_matmul_nbits(lib, dA, w, N, K, bits, block))
    W = torch.from_numpy(dequantize(host, N, K, bits, block)).double().cuda()
    ref = (dA.double() @ W.t()).to(TORCH[dtype]).float().cpu().numpy()
    scale = max(1.0, float(np.abs(ref).max()))
    np.testing.assert_allclose(full, ref, rtol=TOL[dtype], atol=TOL[dtype] * scale)
    if session is not None:
        from tests.custom_ops.ops_models import matmul_nbits_model

        cpu = session(matmul_nbits_model(K, N, bits, block, dtype, zero_points=not symmetric), cuda_library)
        got = cpu.run(None, {"A": A, **host})[0].astype(np.float32)
        np.testing.assert_allclose(full, got, rtol=TOL[dtype], atol=TOL[dtype] * scale)
    single = np.concatenate(
        [_host(cuda_matmul_nbits(lib, dA[i : i + 1], w, N, K, bits, block)) for i in range(40)]
    )
    for m in [*range(1, 18), 31, 40]:
        assert np.array_equal(_host(cuda_matmul_nbits(lib, dA[:m], w, N, K, bits, block)), single[:m]), m
    # misaligned activations take the scalar load path: the same bits
    assert np.array_equal(
        _host(cuda_matmul_nbits(lib, _misaligned(dA[:5]), w, N, K, bits, block)), single[:5]
    )


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("bits", [4, 8])
def test_swiglu_form_is_swiglu_then_the_product(cuda_library: Path, dtype: str, bits: int) -> None:
    """The down projection reading [gate | up] (Ouro-1.4B's 5632 -> 2048): the SwiGLU kernel's
    bits followed by the plain product, for every row count."""
    lib = _lib(cuda_library)
    K, N = 5632, 2048
    rng = np.random.default_rng(bits)
    w = _on_device(nbits_weights(rng, N, K, bits, 32, False))
    gate_up = _dev(as_dtype(2 * rng.standard_normal((17, 2 * K)), dtype), dtype)
    want = _host(cuda_matmul_nbits(lib, cuda_swiglu(lib, gate_up), w, N, K, bits, 32))
    for m in (1, 2, 5, 8, 16, 17):
        got = _host(cuda_matmul_nbits(lib, gate_up[:m], w, N, K, bits, 32, swiglu=True))
        assert np.array_equal(got, want[:m]), m


def test_replays_in_a_cuda_graph(cuda_library: Path) -> None:
    lib = _lib(cuda_library)
    K, N = 2048, 2048
    rng = np.random.default_rng(0)
    w = _on_device(nbits_weights(rng, N, K, 4, 32, True))
    A = _dev(as_dtype(rng.standard_normal((5, K)), "float16"), "float16")
    eager = cuda_matmul_nbits(lib, A, w, N, K, 4, 32)
    out = torch.empty_like(eager)
    stream = lambda: ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)  # noqa: E731

    def call():
        _check(
            lib,
            lib.loopcast_cuda_matmul_nbits(
                CODES["float16"],
                ctypes.c_void_p(A.data_ptr()),
                ctypes.c_void_p(w["B"].data_ptr()),
                ctypes.c_void_p(w["scales"].data_ptr()),
                ctypes.c_void_p(0),
                ctypes.c_void_p(out.data_ptr()),
                ctypes.c_int64(5),
                ctypes.c_int64(K),
                ctypes.c_int64(N),
                4,
                32,
                0,
                stream(),
            ),
        )

    graph = _capture(call)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_argument_errors(cuda_library: Path) -> None:
    lib = _lib(cuda_library)
    w = _on_device(nbits_weights(np.random.default_rng(0), 8, 64, 4, 32, True))
    A = torch.zeros((1, 64), dtype=torch.float16, device="cuda")
    Y = torch.empty((1, 8), dtype=torch.float16, device="cuda")
    for bits, block in ((3, 32), (4, 48), (8, 512)):
        code = lib.loopcast_cuda_matmul_nbits(
            CODES["float16"],
            ctypes.c_void_p(A.data_ptr()),
            ctypes.c_void_p(w["B"].data_ptr()),
            ctypes.c_void_p(w["scales"].data_ptr()),
            ctypes.c_void_p(0),
            ctypes.c_void_p(Y.data_ptr()),
            ctypes.c_int64(1),
            ctypes.c_int64(64),
            ctypes.c_int64(8),
            bits,
            block,
            0,
            ctypes.c_void_p(0),
        )
        assert code != 0 and b"invalid argument" in lib.loopcast_cuda_error_string(code), (bits, block)
