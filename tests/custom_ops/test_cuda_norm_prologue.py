"""The norm prologue of the CUDA projections (norm_prologue.cuh) through loopcast_cuda_norm_matmul
and loopcast_cuda_norm_matmul_nbits: the fused call is ResidualRMSNorm's kernel followed by the
plain projection bit for bit (Y and the sum), for every M (so rows stay invariant to the row
count: the unfused chain's rows are, tests/custom_ops/test_cuda_norm_kernels.py), on the staged
and unstaged paths, inside a captured CUDA graph, and a call without norm_weight is refused.
The helpers are tests/custom_ops/test_cuda_*kernels.py's."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from tests.custom_ops.test_cuda_kernels import CODES, TORCH, _capture, _check, _dev, _lib, cuda_matmul  # noqa: E402
from tests.custom_ops.test_cuda_nbits_kernels import _on_device, cuda_matmul_nbits, nbits_weights  # noqa: E402
from tests.custom_ops.test_cuda_norm_kernels import _misaligned, _ptr, cuda_residual_norm  # noqa: E402

# (residual, branch_weight, loop_weight) as the fused stack uses them, and the stack's first norm
FORMS = [(1, 1, 0), (1, 1, 1), (1, 0, 0), (0, 0, 0)]
MS = [1, 2, 5, 16, 17, 32, 40]  # 17..32: two row tiles (h formed per chunk); 40: two launches


def _inputs(rng, M: int, K: int, dtype: str, form) -> tuple:
    dev = lambda a: _dev(a, dtype)  # noqa: E731
    A = dev(rng.standard_normal((M, K)))
    residual = dev(2 * rng.standard_normal((M, K))) if form[0] else None
    w = {"out_weight": dev(1 + 0.5 * rng.standard_normal(K))}
    for name, on in zip(("branch_weight", "loop_weight"), form[1:]):
        if on:
            w[name] = dev(1 + 0.5 * rng.standard_normal(K))
    return A, residual, w


def _norm_args(A, residual, w, sum_out):
    return [
        _ptr(A),
        _ptr(residual),
        _ptr(w.get("branch_weight")),
        _ptr(w.get("loop_weight")),
        _ptr(w["out_weight"]),
        ctypes.c_float(1e-6),
        _ptr(sum_out),
    ]


def fused_matmul(lib, A, residual, w, B, trans_b: bool, check: bool = True):
    M, K = A.shape
    N = B.shape[0] if trans_b else B.shape[1]
    Y = torch.empty((M, N), dtype=A.dtype, device="cuda")
    s = torch.empty_like(A)
    code = lib.loopcast_cuda_norm_matmul(
        CODES[{v: k for k, v in TORCH.items()}[A.dtype]],
        *_norm_args(A, residual, w, s),
        _ptr(B),
        _ptr(Y),
        ctypes.c_int64(M),
        ctypes.c_int64(K),
        ctypes.c_int64(N),
        int(trans_b),
        ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
    )
    if not check:
        return code
    _check(lib, code)
    torch.cuda.synchronize()
    return Y, s


def fused_nbits(lib, A, residual, w, q: dict, N: int, bits: int, block: int):
    M, K = A.shape
    Y = torch.empty((M, N), dtype=A.dtype, device="cuda")
    s = torch.empty_like(A)
    _check(
        lib,
        lib.loopcast_cuda_norm_matmul_nbits(
            CODES[{v: k for k, v in TORCH.items()}[A.dtype]],
            *_norm_args(A, residual, w, s),
            _ptr(q["B"]),
            _ptr(q["scales"]),
            _ptr(q.get("zero_points")),
            _ptr(Y),
            ctypes.c_int64(M),
            ctypes.c_int64(K),
            ctypes.c_int64(N),
            bits,
            block,
            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
        ),
    )
    torch.cuda.synchronize()
    return Y, s


def _unfused(lib, A, residual, w):
    """ResidualRMSNorm's kernel: (sum, normed)."""
    return cuda_residual_norm(lib, A, residual if residual is not None else None, w)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize(
    "K,N,trans_b", [(2048, 6144, False), (2048, 11264, False), (384, 1000, True), (200, 72, False)]
)
def test_fused_matmul_is_the_norm_kernel_then_the_matmul(
    cuda_library: Path, dtype: str, K, N, trans_b
) -> None:
    lib = _lib(cuda_library)
    rng = np.random.default_rng(K + N + len(dtype))
    B = _dev(rng.standard_normal((N, K) if trans_b else (K, N)) * 0.05, dtype)
    for form in FORMS:
        for M in MS if dtype != "float32" else [1, 5, 40]:
            A, residual, w = _inputs(rng, M, K, dtype, form)
            Y, s = fused_matmul(lib, A, residual, w, B, trans_b)
            s_ref, h = _unfused(lib, A, residual, w)
            assert torch.equal(s, s_ref), (form, M)
            assert torch.equal(Y, cuda_matmul(lib, h, B, dtype, trans_b)), (form, M)
            assert Y.abs().max() > 0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("bits,block,symmetric", [(4, 32, False), (4, 128, True), (8, 64, False)])
@pytest.mark.parametrize("K,N", [(2048, 6144), (200, 37)])
def test_fused_nbits_is_the_norm_kernel_then_the_product(
    cuda_library: Path, dtype: str, bits: int, block: int, symmetric: bool, K: int, N: int
) -> None:
    lib = _lib(cuda_library)
    rng = np.random.default_rng(bits * block + K)
    q = _on_device(nbits_weights(rng, N, K, bits, block, symmetric))
    for form in FORMS[:2] + FORMS[3:]:
        for M in (1, 3, 5, 16, 20):
            A, residual, w = _inputs(rng, M, K, dtype, form)
            Y, s = fused_nbits(lib, A, residual, w, q, N, bits, block)
            s_ref, h = _unfused(lib, A, residual, w)
            assert torch.equal(s, s_ref), (form, M)
            assert torch.equal(Y, cuda_matmul_nbits(lib, h, q, N, K, bits, block)), (form, M)


def test_misaligned_rows_keep_the_bits(cuda_library: Path) -> None:
    lib = _lib(cuda_library)
    rng = np.random.default_rng(5)
    A, residual, w = _inputs(rng, 3, 2048, "float16", (1, 1, 1))
    B = _dev(rng.standard_normal((2048, 512)) * 0.05, "float16")
    Y, s = fused_matmul(lib, A, residual, w, B, False)
    Y2, s2 = fused_matmul(
        lib, _misaligned(A), _misaligned(residual), {k: _misaligned(v) for k, v in w.items()}, B, False
    )
    assert torch.equal(Y, Y2) and torch.equal(s, s2)


def test_fused_matmul_replays_in_a_cuda_graph(cuda_library: Path) -> None:
    lib = _lib(cuda_library)
    rng = np.random.default_rng(9)
    A, residual, w = _inputs(rng, 5, 2048, "bfloat16", (1, 1, 0))
    B = _dev(rng.standard_normal((2048, 6144)) * 0.05, "bfloat16")
    Y_ref, s_ref = fused_matmul(lib, A, residual, w, B, False)
    Y = torch.empty_like(Y_ref)
    s = torch.empty_like(s_ref)

    def call() -> None:
        _check(
            lib,
            lib.loopcast_cuda_norm_matmul(
                CODES["bfloat16"],
                *_norm_args(A, residual, w, s),
                _ptr(B),
                _ptr(Y),
                ctypes.c_int64(5),
                ctypes.c_int64(2048),
                ctypes.c_int64(6144),
                0,
                ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
            ),
        )

    graph = _capture(call)
    Y.zero_()
    s.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(Y, Y_ref) and torch.equal(s, s_ref)


def test_a_call_without_norm_weight_is_refused(cuda_library: Path) -> None:
    lib = _lib(cuda_library)
    A = torch.ones((1, 64), dtype=torch.float16, device="cuda")
    B = torch.ones((64, 64), dtype=torch.float16, device="cuda")
    code = fused_matmul(lib, A, None, {"out_weight": None}, B, False, check=False)
    assert code != 0 and b"invalid argument" in lib.loopcast_cuda_error_string(code)
