"""CUDA kernels of the custom-op library, second part: ResidualRMSNorm, SwiGLU and the
SwiGLU-fused matmul through their C entry points with torch device tensors, against the ops' own
roundings (tests/custom_ops/fused_reference.py) and the CPU op when onnxruntime is importable,
rows invariant to the call's row count, and CUDA-graph replay. The helpers are
tests/custom_ops/test_cuda_kernels.py's."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from tests.custom_ops import fused_reference  # noqa: E402  (after the module-level CUDA skip)
from tests.custom_ops.test_cuda_kernels import (  # noqa: E402
    CODES,
    NORM_WEIGHTS,
    TORCH,
    _capture,
    _check,
    _dev,
    _host,
    _lib,
    as_dtype,
    cuda_matmul,
    session,
)

try:  # the CPU op as a second reference, when onnxruntime (and onnx, ml_dtypes) are there
    from tests.custom_ops.ops_models import residual_norm_model, swiglu_model
except ImportError:  # pragma: no cover - GPU machine without onnxruntime
    pass

NORM_COMBOS = [
    tuple(w for w, on in zip(NORM_WEIGHTS, mask) if on)
    for mask in ((0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 0), (1, 0, 1), (0, 1, 1), (1, 1, 1))
]
MAX_NORM_HIDDEN = 16384  # kLoopcastMaxNormHidden


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(None if t is None else t.data_ptr())


def cuda_residual_norm(
    lib, branch, residual, weights: dict, eps: float = 1e-6, sum_out=None, check: bool = True
):
    """(sum, normed or None) from device tensors [rows, H]; the return code instead when not `check`."""
    rows, H = branch.shape
    sum_out = torch.empty_like(branch) if sum_out is None else sum_out
    normed = torch.empty_like(branch) if "out_weight" in weights else None
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    code = lib.loopcast_cuda_residual_rms_norm(
        CODES[{v: k for k, v in TORCH.items()}[branch.dtype]],
        _ptr(branch),
        _ptr(residual),
        *(_ptr(weights.get(w)) for w in NORM_WEIGHTS),
        _ptr(sum_out),
        _ptr(normed),
        ctypes.c_int64(rows),
        ctypes.c_int64(H),
        ctypes.c_float(eps),
        stream,
    )
    if not check:
        return code
    _check(lib, code)
    torch.cuda.synchronize()
    return sum_out, normed


def cuda_swiglu(lib, gate_up: torch.Tensor) -> torch.Tensor:
    rows, width = gate_up.shape
    out = torch.empty((rows, width // 2), dtype=gate_up.dtype, device="cuda")
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    _check(
        lib,
        lib.loopcast_cuda_swiglu(
            CODES[{v: k for k, v in TORCH.items()}[gate_up.dtype]],
            _ptr(gate_up),
            _ptr(out),
            ctypes.c_int64(rows),
            ctypes.c_int64(width // 2),
            stream,
        ),
    )
    torch.cuda.synchronize()
    return out


def _misaligned(x: torch.Tensor) -> torch.Tensor:
    """The same values at an address that is not 16-byte aligned (the kernels' scalar path)."""
    flat = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
    view = flat[1:].view(x.shape)
    view.copy_(x)
    return view


def _norm_inputs(rng: np.random.Generator, rows: int, H: int, dtype: str, weights) -> tuple:
    dev = lambda a: _dev(as_dtype(a, dtype), dtype)  # noqa: E731
    branch, residual = dev(rng.standard_normal((rows, H))), dev(2 * rng.standard_normal((rows, H)))
    return branch, residual, {w: dev(1 + 0.5 * rng.standard_normal(H)) for w in weights}


# H = 7 and 1001: scalar loads; 384 (demo), 2048 (Ouro-1.4B), 8192, and the largest row taken.
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("H", [7, 384, 1001, 2048, 8192, MAX_NORM_HIDDEN])
@pytest.mark.parametrize("weights", NORM_COMBOS, ids=lambda w: "+".join(w) or "none")
def test_residual_norm_matches_reference_and_rows_are_invariant(
    cuda_library: Path, dtype: str, H: int, weights: tuple
) -> None:
    lib = _lib(cuda_library)
    rng = np.random.default_rng(H + len(weights))
    branch, residual, w = _norm_inputs(rng, 32, H, dtype, weights)
    full = cuda_residual_norm(lib, branch, residual, w)
    want = fused_reference.residual_rms_norm(branch, residual, w)
    for got, ref in zip(full, want):
        assert (got is None) == (ref is None)
        if got is not None:
            fused_reference.assert_close(got, ref, dtype)
    if session is not None and H <= 2048:
        host = lambda t: _host(t).astype(np.float16) if dtype == "float16" else _host(t)  # noqa: E731
        feeds = {
            "branch": host(branch)[None],
            "residual": host(residual)[None],
            **{k: host(v) for k, v in w.items()},
        }
        cpu = session(residual_norm_model(H, dtype, weights), cuda_library).run(None, feeds)
        for got, ref in zip(full, cpu):
            fused_reference.assert_close(got, fused_reference.to_torch(ref[0], dtype), dtype)
    single = [cuda_residual_norm(lib, branch[i : i + 1], residual[i : i + 1], w) for i in range(32)]
    for k in range(2 if "out_weight" in weights else 1):
        rows = torch.cat([s[k] for s in single])
        for m in range(1, 33):
            assert torch.equal(cuda_residual_norm(lib, branch[:m], residual[:m], w)[k], rows[:m]), (k, m)
    # Scalar loads (misaligned rows) reduce in the same order as vector loads: the same bits.
    odd = cuda_residual_norm(
        lib, _misaligned(branch), _misaligned(residual), {k: _misaligned(v) for k, v in w.items()}
    )
    assert all(a is None or torch.equal(a, b) for a, b in zip(odd, full))


def test_residual_norm_in_place_and_argument_errors(cuda_library: Path) -> None:
    lib = _lib(cuda_library)
    rng = np.random.default_rng(12)
    branch, residual, w = _norm_inputs(rng, 5, 2048, "float16", NORM_WEIGHTS)
    want = cuda_residual_norm(lib, branch, residual, w)
    stream = residual.clone()
    got = cuda_residual_norm(lib, branch, stream, w, sum_out=stream)  # the residual stream updated in place
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    invalid = 1  # cudaErrorInvalidValue
    assert cuda_residual_norm(lib, branch, residual, {"loop_weight": w["loop_weight"]}, check=False) == 0
    no_normed = lib.loopcast_cuda_residual_rms_norm(
        1,
        _ptr(branch),
        _ptr(residual),
        None,
        None,
        _ptr(w["out_weight"]),
        _ptr(torch.empty_like(branch)),
        None,
        ctypes.c_int64(5),
        ctypes.c_int64(2048),
        ctypes.c_float(1e-6),
        None,
    )
    assert no_normed == invalid
    big = torch.zeros((1, MAX_NORM_HIDDEN + 8), dtype=torch.float16, device="cuda")
    assert cuda_residual_norm(lib, big, big, {}, check=False) == invalid


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_residual_norm_without_residual_matches_the_fused_normed_output(
    cuda_library: Path, dtype: str
) -> None:
    # How a verify_tail graph opens its stack: it must give the fused op's bits for the same sum.
    lib = _lib(cuda_library)
    branch, residual, w = _norm_inputs(np.random.default_rng(13), 5, 2048, dtype, NORM_WEIGHTS)
    s, h = cuda_residual_norm(lib, branch, residual, w)
    s2, h2 = cuda_residual_norm(lib, s, None, {"out_weight": w["out_weight"]})
    assert torch.equal(s2, s) and torch.equal(h2, h)


def test_residual_norm_in_cuda_graph_replays(cuda_library: Path) -> None:
    lib = _lib(cuda_library)
    rng = np.random.default_rng(13)
    branch, residual, w = _norm_inputs(rng, 3, 2048, "bfloat16", NORM_WEIGHTS)
    eager = cuda_residual_norm(lib, branch, residual, w)
    out, normed = torch.empty_like(branch), torch.empty_like(branch)

    def call() -> None:
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        _check(
            lib,
            lib.loopcast_cuda_residual_rms_norm(
                2,
                _ptr(branch),
                _ptr(residual),
                *(_ptr(w[k]) for k in NORM_WEIGHTS),
                _ptr(out),
                _ptr(normed),
                ctypes.c_int64(3),
                ctypes.c_int64(2048),
                ctypes.c_float(1e-6),
                stream,
            ),
        )

    g = _capture(call)
    out.zero_()
    normed.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager[0]) and torch.equal(normed, eager[1])


# I = 8: one granule a row; 11: scalar path; 1408 and 5632 (Ouro-1.4B): many granules.
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("I", [1, 8, 11, 1408, 5632])
def test_swiglu_matches_reference_and_rows_are_invariant(cuda_library: Path, dtype: str, I: int) -> None:
    lib = _lib(cuda_library)
    rng = np.random.default_rng(I)
    host_in = as_dtype(3 * rng.standard_normal((32, 2 * I)), dtype)
    gate_up = _dev(host_in, dtype)
    full = cuda_swiglu(lib, gate_up)
    fused_reference.assert_close(full, fused_reference.swiglu(gate_up), dtype)
    if session is not None:
        cpu = session(swiglu_model(2 * I, dtype), cuda_library).run(None, {"gate_up": host_in[None]})[0]
        fused_reference.assert_close(full, fused_reference.to_torch(cpu[0], dtype), dtype)
    rows = torch.cat([cuda_swiglu(lib, gate_up[i : i + 1]) for i in range(32)])
    for m in range(1, 33):
        assert torch.equal(cuda_swiglu(lib, gate_up[:m]), rows[:m]), m
    assert torch.equal(cuda_swiglu(lib, _misaligned(gate_up)), full)


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("K,N", [(5632, 2048), (384, 640), (37, 100)])
def test_swiglu_matmul_is_swiglu_then_matmul(
    cuda_library: Path, dtype: str, trans_b: bool, K: int, N: int
) -> None:
    """The down projection reading [gate | up]: the bits of the SwiGLU kernel followed by the plain
    product, for every row count (1..32 and 40: one and two row tiles, and a second launch)."""
    lib = _lib(cuda_library)
    rng = np.random.default_rng(K)
    gate_up = _dev(as_dtype(2 * rng.standard_normal((40, 2 * K)), dtype), dtype)
    dB = _dev(as_dtype(rng.standard_normal((N, K) if trans_b else (K, N)) / np.sqrt(K), dtype), dtype)
    want = _host(cuda_matmul(lib, cuda_swiglu(lib, gate_up), dB, dtype, trans_b))
    assert np.array_equal(_host(cuda_matmul(lib, gate_up, dB, dtype, trans_b, swiglu=True)), want)
    for m in (1, 5, 16, 17, 32):
        assert np.array_equal(
            _host(cuda_matmul(lib, gate_up[:m], dB, dtype, trans_b, swiglu=True)), want[:m]
        ), m


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_swiglu_staging_keeps_the_bits(
    cuda_library: Path, dtype: str, trans_b: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to 5 rows the SwiGLU matmul stages SwiGLU(A) once per warp in shared memory; per chunk
    (LOOPCAST_SWIGLU_STAGE=0, more rows, or a staging that would not fit, as 5 rows at K = 32768)
    it computes the same values, so the bits are the same."""
    lib = _lib(cuda_library)
    for K, N in ((5632, 2048), (32768, 1024)):
        rng = np.random.default_rng(K)
        gate_up = _dev(as_dtype(2 * rng.standard_normal((16, 2 * K)), dtype), dtype)
        dB = _dev(as_dtype(rng.standard_normal((N, K) if trans_b else (K, N)) / np.sqrt(K), dtype), dtype)
        want = _host(cuda_matmul(lib, cuda_swiglu(lib, gate_up), dB, dtype, trans_b))
        for m in (1, 5, 16):
            staged = _host(cuda_matmul(lib, gate_up[:m], dB, dtype, trans_b, swiglu=True))
            with monkeypatch.context() as env:
                env.setenv("LOOPCAST_SWIGLU_STAGE", "0")
                per_chunk = _host(cuda_matmul(lib, gate_up[:m], dB, dtype, trans_b, swiglu=True))
            assert np.array_equal(staged, want[:m]), (K, m)
            assert np.array_equal(per_chunk, want[:m]), (K, m)
