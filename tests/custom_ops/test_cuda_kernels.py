"""CUDA kernels of the custom-op library, called through their C entry points with torch device
tensors (no onnxruntime-gpu needed): against the CPU op of the same library, and row invariance.
The ORT-level CUDA checks (and benchmarks) are tools/check_ops_cuda.py."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import pytest

from loopcast.custom_ops.build import build_library, find_nvcc, has_cuda
from tests.custom_ops.conftest import require_c_toolchain
from tests.custom_ops.ops_models import as_dtype, attention_feeds, attention_model, matmul_model, session

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
OUTPUTS = ["output", "present_key", "present_value"]


@pytest.fixture(scope="module")
def cuda_library(tmp_path_factory) -> Path:
    if os.environ.get("LOOPCAST_OPS_LIB"):
        return Path(os.environ["LOOPCAST_OPS_LIB"])
    require_c_toolchain()
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    return build_library(tmp_path_factory.mktemp("cuda_ops"), cuda=True)


def _lib(path: Path) -> ctypes.CDLL:
    assert has_cuda(path)
    lib = ctypes.CDLL(str(path))
    lib.loopcast_cuda_error_string.restype = ctypes.c_char_p
    return lib


def _dev(x: np.ndarray, dtype: str) -> "torch.Tensor":
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to("cuda").to(TORCH[dtype])


def _host(x: "torch.Tensor") -> np.ndarray:
    return x.float().cpu().numpy()


def _check(lib: ctypes.CDLL, code: int) -> None:
    assert code == 0, lib.loopcast_cuda_error_string(code).decode()


def cuda_matmul(lib, A, B, dtype: str, trans_b: bool) -> "torch.Tensor":
    M, K = A.shape
    N = B.shape[0] if trans_b else B.shape[1]
    Y = torch.empty((M, N), dtype=TORCH[dtype], device="cuda")
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    _check(lib, lib.loopcast_cuda_matmul(CODES[dtype], ctypes.c_void_p(A.data_ptr()), ctypes.c_void_p(B.data_ptr()),
                                         ctypes.c_void_p(Y.data_ptr()), ctypes.c_int64(M), ctypes.c_int64(K),
                                         ctypes.c_int64(N), trans_b, stream))
    torch.cuda.synchronize()
    return Y


def cuda_attention(lib, feeds: dict, *, Hq: int, Hkv: int, D: int, dtype: str, in_place: bool = True):
    q = _dev(feeds["query"], dtype)
    B, S, _ = q.shape
    pk, pv = _dev(feeds["past_key"], dtype), _dev(feeds["past_value"], dtype)
    outk, outv = (pk, pv) if in_place else (torch.empty_like(pk), torch.empty_like(pv))
    seq = torch.from_numpy(feeds["seqlens_k"]).to("cuda")
    cos, sin = _dev(feeds["cos_cache"], dtype), _dev(feeds["sin_cache"], dtype)
    out = torch.empty((B, S, Hq * D), dtype=TORCH[dtype], device="cuda")
    p = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    _check(lib, lib.loopcast_cuda_attention(CODES[dtype], p(q), p(pk), p(pv), p(outk), p(outv), p(seq), p(cos), p(sin),
                                            p(out), B, S, Hq, Hkv, D, pk.shape[2], cos.shape[0],
                                            ctypes.c_float(1.0 / np.sqrt(D)), 1, stream))
    torch.cuda.synchronize()
    return _host(out), _host(outk), _host(outv)


TOL = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 6e-2}


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("K,N", [(384, 640), (2048, 2048), (5632, 200), (37, 100), (1000, 4)])
def test_matmul_matches_cpu_op_and_rows_are_invariant(cuda_library: Path, dtype: str, trans_b: bool, K: int,
                                                      N: int) -> None:
    lib = _lib(cuda_library)
    rng = np.random.default_rng(K + N)
    A = as_dtype(rng.standard_normal((40, K)), dtype)
    B = as_dtype(rng.standard_normal((N, K) if trans_b else (K, N)) / np.sqrt(K), dtype)
    dA, dB = _dev(A, dtype), _dev(B, dtype)
    full = _host(cuda_matmul(lib, dA, dB, dtype, trans_b))
    cpu = session(matmul_model(K, N, dtype, trans_b), cuda_library).run(None, {"A": A, "B": B})[0]
    np.testing.assert_allclose(full, cpu.astype(np.float32), rtol=TOL[dtype], atol=TOL[dtype])
    single = np.concatenate([_host(cuda_matmul(lib, dA[i:i + 1], dB, dtype, trans_b)) for i in range(40)])
    for m in [*range(1, 33), 40]:
        assert np.array_equal(_host(cuda_matmul(lib, dA[:m], dB, dtype, trans_b)), single[:m]), m


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("Hq,Hkv,D", [(4, 4, 16), (8, 2, 32), (6, 3, 64), (16, 16, 128), (4, 1, 128)])
def test_attention_matches_cpu_op_and_rows_are_invariant(cuda_library: Path, dtype: str, Hq: int, Hkv: int,
                                                         D: int) -> None:
    lib = _lib(cuda_library)
    rng = np.random.default_rng(D)
    T, n = 300, 211
    cpu = session(attention_model("BatchInvariantAttention", Hq=Hq, Hkv=Hkv, D=D, T=T, dtype=dtype), cuda_library)
    for W in (1, 2, 5, 8, 16, 32):
        feeds = attention_feeds(rng, B=2, S=W, n=n, Hq=Hq, Hkv=Hkv, D=D, T=T, dtype=dtype)
        got = cuda_attention(lib, feeds, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype)
        want = cpu.run(OUTPUTS, feeds)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w.astype(np.float32), rtol=TOL[dtype], atol=TOL[dtype])
        assert np.array_equal(got[2], want[2].astype(np.float32))
        assert all(np.array_equal(a, b) for a, b in
                   zip(got, cuda_attention(lib, feeds, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype, in_place=False)))
        pk, pv, rows = feeds["past_key"], feeds["past_value"], []
        for i in range(W):
            one = dict(feeds, query=feeds["query"][:, i:i + 1], past_key=pk, past_value=pv,
                       seqlens_k=np.full((2,), n + i, np.int32))
            out, pk, pv = cuda_attention(lib, one, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype)
            rows.append(out)
        assert np.array_equal(got[0], np.concatenate(rows, axis=1)), W
        assert np.array_equal(got[1], pk) and np.array_equal(got[2], pv), W
