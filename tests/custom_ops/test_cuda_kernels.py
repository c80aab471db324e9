"""CUDA kernels of the custom-op library, called through their C entry points with torch device
tensors (no onnxruntime-gpu needed): against a torch reference (float64 for matmul and attention;
the ops' own roundings for ResidualRMSNorm and SwiGLU) and the CPU op of the same library when
onnxruntime is importable, and row invariance: every row of an S-row call is bit-identical to the
same row computed by S one-row calls. The ORT-level CUDA checks are
tests/ort_runtime/test_cuda.py; tools/bench/bench_matmul_cuda.py and tools/bench/bench_attention_cuda.py time
the kernels.

Runs on a GPU machine without onnxruntime or the editable install: set LOOPCAST_OPS_LIB to a built
library (then nothing from loopcast is imported)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)


try:  # the CPU op as a second reference, when onnxruntime (and onnx, ml_dtypes) are there
    from tests.custom_ops.ops_models import (
        NORM_WEIGHTS,
        attention_model,
        matmul_model,
        session,
    )
except ImportError:  # pragma: no cover - GPU machine without onnxruntime
    session = None
    NORM_WEIGHTS = ("branch_weight", "loop_weight", "out_weight")

CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
OUTPUTS = ["output", "present_key", "present_value"]
CHUNK = 64  # kChunk of attention_split_cuda.cuh: positions per split-attention chunk


def _lib(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    assert lib.loopcast_ops_has_cuda()
    lib.loopcast_cuda_error_string.restype = ctypes.c_char_p
    return lib


def as_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round to the op dtype; returned as the array the ORT test models are fed (fp32 for bf16)."""
    y = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(TORCH[dtype]).float().numpy()
    return y.astype(np.float16) if dtype == "float16" else y


def _dev(x: np.ndarray, dtype: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to("cuda").to(TORCH[dtype])


def _host(x: torch.Tensor) -> np.ndarray:
    return x.float().cpu().numpy()


def _capture(call, repeats: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``repeats`` calls, after one warm-up call on a side stream (lazy setup
    stays out of the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            call()
    return graph


def _check(lib: ctypes.CDLL, code: int) -> None:
    assert code == 0, lib.loopcast_cuda_error_string(code).decode()


def cuda_matmul(lib, A, B, dtype: str, trans_b: bool, swiglu: bool = False) -> torch.Tensor:
    """A·B; with `swiglu` A is [M, 2K] = [gate | up] and the product is SwiGLU(A)·B."""
    M, K = A.shape[0], A.shape[1] // (2 if swiglu else 1)
    N = B.shape[0] if trans_b else B.shape[1]
    Y = torch.empty((M, N), dtype=TORCH[dtype], device="cuda")
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    entry = lib.loopcast_cuda_swiglu_matmul if swiglu else lib.loopcast_cuda_matmul
    _check(
        lib,
        entry(
            CODES[dtype],
            ctypes.c_void_p(A.data_ptr()),
            ctypes.c_void_p(B.data_ptr()),
            ctypes.c_void_p(Y.data_ptr()),
            ctypes.c_int64(M),
            ctypes.c_int64(K),
            ctypes.c_int64(N),
            trans_b,
            stream,
        ),
    )
    torch.cuda.synchronize()
    return Y


def rotary_tables(T: int, D: int, dtype: str, theta: float = 10000.0) -> tuple[np.ndarray, np.ndarray]:
    inv = 1.0 / theta ** (np.arange(0, D, 2, dtype=np.float64) / D)
    ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
    return as_dtype(np.cos(ang), dtype), as_dtype(np.sin(ang), dtype)


def attention_feeds(
    rng: np.random.Generator, *, B: int, S: int, n, Hq: int, Hkv: int, D: int, T: int, dtype: str
) -> dict[str, np.ndarray]:
    """Rows at positions n[b]..n[b]+S-1 (n: int or one per batch) over a random past cache."""
    cos, sin = rotary_tables(T, D, dtype)
    ns = np.broadcast_to(np.asarray(n, dtype=np.int64), (B,))
    return {
        "query": as_dtype(rng.standard_normal((B, S, (Hq + 2 * Hkv) * D)), dtype),
        "past_key": as_dtype(rng.standard_normal((B, Hkv, T, D)), dtype),
        "past_value": as_dtype(rng.standard_normal((B, Hkv, T, D)), dtype),
        "seqlens_k": (ns + S - 1).astype(np.int32),
        "total_sequence_length": np.array(int(ns.max()) + S, dtype=np.int32),
        "cos_cache": cos,
        "sin_cache": sin,
    }


def cuda_attention(lib, feeds: dict, *, Hq: int, Hkv: int, D: int, dtype: str, in_place: bool = True):
    q = _dev(feeds["query"], dtype)
    B, S, _ = q.shape
    pk, pv = _dev(feeds["past_key"], dtype), _dev(feeds["past_value"], dtype)
    outk, outv = (pk, pv) if in_place else (torch.empty_like(pk), torch.empty_like(pv))
    seq = torch.from_numpy(np.ascontiguousarray(feeds["seqlens_k"])).to("cuda")
    cos, sin = _dev(feeds["cos_cache"], dtype), _dev(feeds["sin_cache"], dtype)
    out = torch.empty((B, S, Hq * D), dtype=TORCH[dtype], device="cuda")
    p = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    _check(
        lib,
        lib.loopcast_cuda_attention(
            CODES[dtype],
            p(q),
            p(pk),
            p(pv),
            p(outk),
            p(outv),
            p(seq),
            p(cos),
            p(sin),
            p(out),
            B,
            S,
            Hq,
            Hkv,
            D,
            pk.shape[2],
            cos.shape[0],
            ctypes.c_float(1.0 / np.sqrt(D)),
            1,
            stream,
        ),
    )
    torch.cuda.synchronize()
    return _host(out), _host(outk), _host(outv)


def reference_attention(feeds: dict, *, Hq: int, Hkv: int, D: int, dtype: str) -> tuple[np.ndarray, ...]:
    """The op in float64 torch on the GPU (rotated k rounded to the dtype as stored)."""
    dt = TORCH[dtype]
    f64 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to("cuda").double()  # noqa: E731
    qkv, pk, pv = f64(feeds["query"]), f64(feeds["past_key"]), f64(feeds["past_value"])
    cos, sin = f64(feeds["cos_cache"]).float(), f64(feeds["sin_cache"]).float()
    B, S, _ = qkv.shape
    half, group = D // 2, Hq // Hkv

    def rot(x, p):  # fp32, as the kernels
        x = x.float()
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos[p] - x2 * sin[p], x2 * cos[p] + x1 * sin[p]], dim=-1).double()

    out = torch.zeros((B, S, Hq * D), dtype=torch.float64, device="cuda")
    for b in range(B):
        n = int(feeds["seqlens_k"][b]) + 1 - S
        for i in range(S):
            row = qkv[b, i].view(Hq + 2 * Hkv, D)
            pk[b, :, n + i] = rot(row[Hq : Hq + Hkv], n + i).to(dt).double()
            pv[b, :, n + i] = row[Hq + Hkv :]
        for i in range(S):
            p = n + i
            q = rot(qkv[b, i].view(Hq + 2 * Hkv, D)[:Hq], p)  # [Hq, D]
            k = pk[b, :, : p + 1].repeat_interleave(group, dim=0)  # [Hq, p+1, D]
            v = pv[b, :, : p + 1].repeat_interleave(group, dim=0)
            w = torch.softmax(torch.einsum("hd,hjd->hj", q, k) / np.sqrt(D), dim=-1)
            out[b, i] = torch.einsum("hj,hjd->hd", w, v).reshape(-1)
    return tuple(x.to(dt).float().cpu().numpy() for x in (out, pk, pv))


TOL = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 6e-2}


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("K,N", [(384, 640), (2048, 2048), (5632, 200), (37, 100), (1000, 4)])
def test_matmul_matches_reference_and_rows_are_invariant(
    cuda_library: Path, dtype: str, trans_b: bool, K: int, N: int
) -> None:
    lib = _lib(cuda_library)
    rng = np.random.default_rng(K + N)
    A = as_dtype(rng.standard_normal((40, K)), dtype)
    B = as_dtype(rng.standard_normal((N, K) if trans_b else (K, N)) / np.sqrt(K), dtype)
    dA, dB = _dev(A, dtype), _dev(B, dtype)
    full = _host(cuda_matmul(lib, dA, dB, dtype, trans_b))
    ref = (dA.double() @ (dB.double().t() if trans_b else dB.double())).to(TORCH[dtype]).float().cpu().numpy()
    np.testing.assert_allclose(full, ref, rtol=TOL[dtype], atol=TOL[dtype])
    if session is not None:
        cpu = session(matmul_model(K, N, dtype, trans_b), cuda_library).run(None, {"A": A, "B": B})[0]
        np.testing.assert_allclose(full, cpu.astype(np.float32), rtol=TOL[dtype], atol=TOL[dtype])
    single = np.concatenate([_host(cuda_matmul(lib, dA[i : i + 1], dB, dtype, trans_b)) for i in range(40)])
    for m in [*range(1, 33), 40]:
        assert np.array_equal(_host(cuda_matmul(lib, dA[:m], dB, dtype, trans_b)), single[:m]), m


def _rows_one_by_one(lib, feeds: dict, S: int, **kw):
    """The S rows of `feeds` as S one-row calls, each after the previous rows were committed."""
    pk, pv, rows = feeds["past_key"], feeds["past_value"], []
    n = feeds["seqlens_k"].astype(np.int64) + 1 - S
    for i in range(S):
        one = dict(
            feeds,
            query=feeds["query"][:, i : i + 1],
            past_key=pk,
            past_value=pv,
            seqlens_k=(n + i).astype(np.int32),
        )
        out, pk, pv = cuda_attention(lib, one, **kw)
        rows.append(out)
    return np.concatenate(rows, axis=1), pk, pv


def _close(got, want, dtype: str) -> None:
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w.astype(np.float32), rtol=TOL[dtype], atol=TOL[dtype])


# T = 300 is not a multiple of the chunk; rows 240..271 cross the chunk boundary at 256.
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(
    "Hq,Hkv,D", [(4, 4, 16), (8, 2, 32), (6, 3, 64), (16, 16, 128), (4, 1, 128), (32, 2, 64)]
)
def test_attention_matches_reference_and_rows_are_invariant(
    cuda_library: Path, dtype: str, Hq: int, Hkv: int, D: int
) -> None:
    lib = _lib(cuda_library)
    rng = np.random.default_rng(D + Hq)
    T, kw = 300, dict(Hq=Hq, Hkv=Hkv, D=D, dtype=dtype)
    cpu = None
    if session is not None:
        cpu = session(
            attention_model("BatchInvariantAttention", Hq=Hq, Hkv=Hkv, D=D, T=T, dtype=dtype), cuda_library
        )
    for W, n in ((1, 240), (2, 255), (5, 252), (8, 250), (16, 240), (32, 240), (32, 0), (3, 61)):
        feeds = attention_feeds(rng, B=2, S=W, n=n, Hq=Hq, Hkv=Hkv, D=D, T=T, dtype=dtype)
        got = cuda_attention(lib, feeds, **kw)
        want = reference_attention(feeds, **kw)
        _close(got, want, dtype)
        assert np.array_equal(got[2], want[2]) and np.array_equal(got[1], want[1])
        if cpu is not None:
            _close(got, cpu.run(OUTPUTS, feeds), dtype)
        assert all(
            np.array_equal(a, b) for a, b in zip(got, cuda_attention(lib, feeds, **kw, in_place=False))
        )
        rows, pk, pv = _rows_one_by_one(lib, feeds, W, **kw)
        assert np.array_equal(got[0], rows), (W, n)
        assert np.array_equal(got[1], pk) and np.array_equal(got[2], pv), (W, n)


class DeviceAttention:
    """The feeds on the device; calls update the cache there (no host round trips)."""

    def __init__(self, lib, feeds: dict, *, Hq: int, Hkv: int, D: int, dtype: str) -> None:
        self.lib, self.Hq, self.Hkv, self.D, self.dtype = lib, Hq, Hkv, D, dtype
        self.q = _dev(feeds["query"], dtype)
        self.pk, self.pv = _dev(feeds["past_key"], dtype), _dev(feeds["past_value"], dtype)
        self.cos, self.sin = _dev(feeds["cos_cache"], dtype), _dev(feeds["sin_cache"], dtype)
        self.n = torch.from_numpy(feeds["seqlens_k"].astype(np.int64) + 1 - self.q.shape[1]).to("cuda")

    def __call__(self, rows: slice, pk=None, pv=None) -> torch.Tensor:
        """Rows `rows` of the query in one call, against cache (pk, pv) (default: the feeds')."""
        pk = self.pk if pk is None else pk
        pv = self.pv if pv is None else pv
        q = self.q[:, rows].contiguous()
        B, S, _ = q.shape
        seq = (self.n + rows.start + S - 1).to(torch.int32)
        out = torch.empty((B, S, self.Hq * self.D), dtype=q.dtype, device="cuda")
        p = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        _check(
            self.lib,
            self.lib.loopcast_cuda_attention(
                CODES[self.dtype],
                p(q),
                p(pk),
                p(pv),
                p(pk),
                p(pv),
                p(seq),
                p(self.cos),
                p(self.sin),
                p(out),
                B,
                S,
                self.Hq,
                self.Hkv,
                self.D,
                pk.shape[2],
                self.cos.shape[0],
                ctypes.c_float(1.0 / np.sqrt(self.D)),
                1,
                stream,
            ),
        )
        torch.cuda.synchronize()
        return out

    def invariance(self, S: int, widths) -> None:
        """S one-row calls vs one call of each width in `widths` (prefixes): identical bits."""
        pk, pv = self.pk.clone(), self.pv.clone()
        single = torch.cat([self(slice(i, i + 1), pk, pv) for i in range(S)], dim=1)
        for W in widths:
            got = self(slice(0, W), self.pk.clone(), self.pv.clone())
            assert torch.equal(got, single[:, :W]), W
        return single


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_attention_long_cache_rows_invariant(cuda_library: Path, dtype: str) -> None:
    """Ouro-1.4B heads over a long cache (many chunks, capacity not a multiple of the chunk), batch
    rows at different positions; S in {2, 5, 8, 13, 32} gives the one-row bits."""
    lib = _lib(cuda_library)
    rng = np.random.default_rng(7)
    Hq, Hkv, D, T = 16, 16, 128, 4160
    kw = dict(Hq=Hq, Hkv=Hkv, D=D, dtype=dtype)
    n = np.array([4096 - 3, 1000], dtype=np.int64)  # rows cross the chunk boundaries at 4096 and 1024
    feeds = attention_feeds(rng, B=2, S=32, n=n, Hq=Hq, Hkv=Hkv, D=D, T=T, dtype=dtype)
    dev = DeviceAttention(lib, feeds, **kw)
    single = dev.invariance(32, (2, 5, 8, 13, 32))
    want = reference_attention(feeds, **kw)[0]
    np.testing.assert_allclose(_host(single), want, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize(
    "Hq,Hkv,D,T,S,n",
    [
        (16, 16, 128, 4160, 8, [4096 - 3, 1000]),  # Ouro-1.4B heads, many chunks a rank
        (16, 4, 128, 300, 5, [250, 61]),
        (8, 1, 64, 300, 3, [0, 130]),  # one group of 8 q heads a block; a row alone in chunk 0
        (32, 2, 64, 1000, 16, [0, 937]),
        (4, 4, 32, 128, 1, [0, 127]),  # two chunks: one rank idle at position 0
    ],
)
def test_attention_cluster_merge_is_the_scratch_merge(
    cuda_library: Path, monkeypatch, dtype: str, Hq: int, Hkv: int, D: int, T: int, S: int, n: list[int]
) -> None:
    """The split kernel's cluster merge (partials in the ranks' shared memory; the launch knob
    LOOPCAST_ATTN_CLUSTER=N caps the cluster) gives the bits of the default scratch-and-counter merge,
    output and cache, whatever the cluster."""
    lib = _lib(cuda_library)
    kw = dict(Hq=Hq, Hkv=Hkv, D=D, dtype=dtype)
    feeds = attention_feeds(
        np.random.default_rng(D + S), B=2, S=S, n=np.array(n), Hq=Hq, Hkv=Hkv, D=D, T=T, dtype=dtype
    )
    monkeypatch.delenv("LOOPCAST_ATTN_CLUSTER", raising=False)
    scratch = cuda_attention(lib, feeds, **kw)
    _close(scratch, reference_attention(feeds, **kw), dtype)
    for cluster in ("2", "5", "8", "16"):
        monkeypatch.setenv("LOOPCAST_ATTN_CLUSTER", cluster)
        got = cuda_attention(lib, feeds, **kw)
        assert all(np.array_equal(a, b) for a, b in zip(got, scratch, strict=True)), cluster


def test_attention_serial_fallback_rows_invariant(cuda_library: Path) -> None:
    """A capacity whose partials do not fit the static scratch: the serial kernel, still invariant."""
    lib = _lib(cuda_library)
    rng = np.random.default_rng(3)
    Hq, Hkv, D, T, dtype = 16, 16, 128, 16384, "float16"
    kw = dict(Hq=Hq, Hkv=Hkv, D=D, dtype=dtype)
    feeds = attention_feeds(rng, B=1, S=5, n=9000, Hq=Hq, Hkv=Hkv, D=D, T=T, dtype=dtype)
    single = DeviceAttention(lib, feeds, **kw).invariance(5, (2, 5))
    np.testing.assert_allclose(
        _host(single), reference_attention(feeds, **kw)[0], rtol=TOL[dtype], atol=TOL[dtype]
    )


def test_attention_in_cuda_graph_replays(cuda_library: Path) -> None:
    """Captured and replayed many times (the split kernel's counters must come back to zero):
    the same bits as the eager call."""
    lib = _lib(cuda_library)
    rng = np.random.default_rng(11)
    Hq, Hkv, D, T, S, n = 16, 4, 128, 2048, 5, 1500
    feeds = attention_feeds(rng, B=1, S=S, n=n, Hq=Hq, Hkv=Hkv, D=D, T=T, dtype="float16")
    eager = cuda_attention(lib, feeds, Hq=Hq, Hkv=Hkv, D=D, dtype="float16")[0]
    q, pk, pv = (_dev(feeds[k], "float16") for k in ("query", "past_key", "past_value"))
    seq = torch.from_numpy(feeds["seqlens_k"]).to("cuda")
    cos, sin = _dev(feeds["cos_cache"], "float16"), _dev(feeds["sin_cache"], "float16")
    out = torch.empty((1, S, Hq * D), dtype=torch.float16, device="cuda")
    p = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731

    def call() -> None:
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        _check(
            lib,
            lib.loopcast_cuda_attention(
                1,
                p(q),
                p(pk),
                p(pv),
                p(pk),
                p(pv),
                p(seq),
                p(cos),
                p(sin),
                p(out),
                1,
                S,
                Hq,
                Hkv,
                D,
                T,
                T,
                ctypes.c_float(1.0 / np.sqrt(D)),
                1,
                stream,
            ),
        )

    g = _capture(call, repeats=3)
    for _ in range(20):
        out.zero_()
        g.replay()
    torch.cuda.synchronize()
    assert np.array_equal(_host(out), eager)
