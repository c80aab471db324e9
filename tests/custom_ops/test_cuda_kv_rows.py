"""CUDA kernels that address KV positions row by row (tree verify's masked rows, the KV moves of
an alternate suffix), called through their C entry points with torch device tensors: each masked
row equals the decode row of its logical position, bit for bit. Shares the helpers of
tests/custom_ops/test_cuda_kernels.py (runs with LOOPCAST_OPS_LIB alone, as that file does)."""

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
    TORCH,
    _check,
    _dev,
    _host,
    _lib,
    _rows_one_by_one,
    as_dtype,
    attention_feeds,
)


def _masked_rows(
    lib,
    feeds: dict,
    positions: list[int],
    masked: list[tuple[int, int]],
    *,
    Hq: int,
    Hkv: int,
    D: int,
    dtype: str,
    table: bool = False,
    rows: list[int] | None = None,
):
    """RowAttention's tree-verify rows: query row rows[i] (default i) at cache position
    positions[i] with keys [masked[i]) out of its sequence. Per row (one launch each, one shared
    cache: the layout of a tree_tail layer), or ``table``: one launch, each row on its own copy
    of the cache."""
    p = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    S, T = len(positions), feeds["past_key"].shape[2]
    q = _dev(feeds["query"], dtype)[0][list(range(S)) if rows is None else rows].contiguous()
    cos, sin = _dev(feeds["cos_cache"], dtype), _dev(feeds["sin_cache"], dtype)
    out = torch.empty((S, Hq * D), dtype=TORCH[dtype], device="cuda")
    pos = torch.tensor(positions, dtype=torch.int32, device="cuda")
    mk = torch.tensor(masked, dtype=torch.int32, device="cuda")
    scale = ctypes.c_float(1.0 / np.sqrt(D))
    if table:
        ks = [_dev(feeds["past_key"], dtype) for _ in range(S)]
        vs = [_dev(feeds["past_value"], dtype) for _ in range(S)]
        keys = (ctypes.c_void_p * S)(*[t.data_ptr() for t in ks])
        values = (ctypes.c_void_p * S)(*[t.data_ptr() for t in vs])
        _check(
            lib,
            lib.loopcast_cuda_row_attention(
                CODES[dtype],
                p(q),
                keys,
                values,
                p(pos),
                p(mk),
                None,  # no sequence index: one entry per pair
                1,
                p(cos),
                p(sin),
                p(out),
                S,
                Hq,
                Hkv,
                D,
                T,
                cos.shape[0],
                scale,
                1,
                stream,
            ),
        )
        torch.cuda.synchronize()
        return _host(out), [_host(k) for k in ks], [_host(v) for v in vs]
    pk, pv = _dev(feeds["past_key"], dtype), _dev(feeds["past_value"], dtype)
    for i in range(S):
        _check(
            lib,
            lib.loopcast_cuda_masked_attention(
                CODES[dtype],
                p(q[i]),
                p(pk),
                p(pv),
                p(pk),
                p(pv),
                p(pos[i : i + 1]),
                p(mk[i]),
                p(cos),
                p(sin),
                p(out[i]),
                1,
                Hq,
                Hkv,
                D,
                T,
                cos.shape[0],
                scale,
                1,
                stream,
            ),
        )
    torch.cuda.synchronize()
    return _host(out), _host(pk), _host(pv)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("Hq,Hkv,D", [(4, 4, 16), (6, 3, 64), (16, 16, 128)])
def test_masked_rows_are_the_decode_rows_of_their_logical_positions(
    cuda_library: Path, dtype: str, Hq: int, Hkv: int, D: int
) -> None:
    """Tree verify on CUDA: branch rows written past another branch ([lo, hi) masked) equal, bit
    for bit, one-row decode calls on the compacted cache at their logical positions — outputs and
    stored K/V — across a chunk boundary of the logical positions (60..67 crosses 64) while their
    cache positions (75..82) do not; the single-launch path (distinct pairs) gives the same bits."""
    lib = _lib(cuda_library)
    rng = np.random.default_rng(D + 5)
    T, lo, hi, m = 300, 60, 75, 8
    kw = dict(Hq=Hq, Hkv=Hkv, D=D, dtype=dtype)
    feeds = attention_feeds(rng, B=1, S=m, n=hi, Hq=Hq, Hkv=Hkv, D=D, T=T, dtype=dtype)
    got, pk, pv = _masked_rows(lib, feeds, list(range(hi, hi + m)), [(lo, hi)] * m, **kw)
    compact = {
        k: np.concatenate([feeds[k][:, :, :lo], feeds[k][:, :, hi:], feeds[k][:, :, : hi - lo]], 2)
        for k in ("past_key", "past_value")
    }
    want, wk, wv = _rows_one_by_one(
        lib, dict(feeds, **compact, seqlens_k=np.array([lo + m - 1], np.int32)), m, **kw
    )
    assert np.array_equal(got, want[0])
    assert np.array_equal(pk[:, :, hi : hi + m], wk[:, :, lo : lo + m]) and np.array_equal(
        pv[:, :, hi : hi + m], wv[:, :, lo : lo + m]
    )
    assert np.array_equal(pk[:, :, :hi], as_dtype(feeds["past_key"], dtype)[:, :, :hi].astype(np.float32))
    # One launch, each row on its own copy of the cache: row i then sees only the stem and its own K/V.
    first = _masked_rows(lib, feeds, [hi], [(lo, hi)], **kw)[0]
    table, _, _ = _masked_rows(
        lib, feeds, [hi, hi + 3, 30], [(lo, hi), (lo, hi + 3), (0, 0)], table=True, **kw
    )
    assert np.array_equal(table[0], first[0])
    single = _masked_rows(lib, feeds, [30], [(0, 0)], rows=[2], **kw)[0]
    assert np.array_equal(table[2], single[0]), "an empty masked range leaves the plain row"


def test_a_row_inside_its_masked_range_writes_nothing(cuda_library: Path) -> None:
    lib = _lib(cuda_library)
    feeds = attention_feeds(
        np.random.default_rng(3), B=1, S=1, n=70, Hq=4, Hkv=4, D=16, T=128, dtype="float32"
    )
    got, pk, _ = _masked_rows(lib, feeds, [70], [(64, 80)], Hq=4, Hkv=4, D=16, dtype="float32")
    assert not got.any() and np.array_equal(pk, feeds["past_key"])


def test_move_positions_copies_the_branch_into_place(cuda_library: Path) -> None:
    """loopcast_cuda_move_positions (the alternate suffix's commit on the device): positions
    src..src+count-1 of every head land at dst.., nothing else changes; overlapping or
    out-of-range copies are refused."""
    lib = _lib(cuda_library)
    lib.loopcast_cuda_move_positions.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 6 + [ctypes.c_void_p]
    buf = torch.randn((1, 3, 40, 16), device="cuda").to(torch.float16)
    want = buf.clone()
    want[:, :, 21:24] = buf[:, :, 30:33]
    _check(lib, lib.loopcast_cuda_move_positions(buf.data_ptr(), 3, 40, 16 * 2, 30, 21, 3, None))
    assert torch.equal(buf, want)
    for src, dst, count in ((30, 29, 3), (38, 10, 3), (-1, 5, 1)):
        assert lib.loopcast_cuda_move_positions(buf.data_ptr(), 3, 40, 32, src, dst, count, None) != 0
    assert torch.equal(buf, want)


def test_copy_positions_fills_another_buffer_at_the_same_positions(cuda_library: Path) -> None:
    """loopcast_cuda_copy_positions (the last-exited KV policy on the device): positions
    p..p+count-1 of every head of src land at the same positions of dst, nothing else changes;
    out-of-range copies and a buffer copied onto itself are refused."""
    lib = _lib(cuda_library)
    fn = lib.loopcast_cuda_copy_positions
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_void_p]
    src = torch.randn((1, 3, 40, 16), device="cuda").to(torch.bfloat16)
    dst = torch.randn((1, 3, 40, 16), device="cuda").to(torch.bfloat16)
    want, before = dst.clone(), src.clone()
    want[:, :, 17:19] = src[:, :, 17:19]
    _check(lib, fn(dst.data_ptr(), src.data_ptr(), 3, 40, 16 * 2, 17, 2, None))
    assert torch.equal(dst, want) and torch.equal(src, before)
    for position, count in ((39, 2), (-1, 1)):
        assert fn(dst.data_ptr(), src.data_ptr(), 3, 40, 32, position, count, None) != 0
    assert fn(dst.data_ptr(), dst.data_ptr(), 3, 40, 32, 0, 1, None) != 0
    assert torch.equal(dst, want)


# ---------------------------------------------------------------------------------------------
# ResidualRMSNorm and SwiGLU
