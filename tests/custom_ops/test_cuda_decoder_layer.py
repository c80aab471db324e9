"""The fused decoder-layer CUDA kernel against the chain of the library's separate CUDA kernels
(each checked against torch in test_cuda_kernels.py), and its row invariance: an M-row call gives
every row, and every cache entry, bit for bit as M one-row calls at the same positions do.
Runs with LOOPCAST_OPS_LIB on a GPU machine; skipped without CUDA."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from tests.custom_ops.layer_cuda import (Shape, chain_layer_call, clone_io, fused_layer_call,  # noqa: E402
                                         new_io, random_layer, rotary_tables)

DEMO = Shape(hidden=384, heads=6, kv_heads=6, head_dim=64, inter=1024, capacity=256)
GQA = Shape(hidden=1024, heads=16, kv_heads=4, head_dim=128, inter=2752, capacity=640)
TOL = {torch.float16: 2e-2, torch.bfloat16: 8e-2}


@pytest.fixture(scope="module")
def lib(cuda_library: Path) -> ctypes.CDLL:
    library = ctypes.CDLL(str(cuda_library))
    library.loopcast_cuda_error_string.restype = ctypes.c_char_p
    if torch.cuda.get_device_properties(0).multi_processor_count < 128:
        pytest.skip("the fused layer needs 128 co-resident blocks")
    return library


def _run(call) -> None:
    call()
    torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,past,rows", [(DEMO, 100, 1), (DEMO, 63, 5), (GQA, 520, 8), (GQA, 0, 3)])
def test_fused_layer_matches_the_kernel_chain(lib, dtype, shape: Shape, past: int, rows: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(past + rows)
    w = random_layer(shape, dtype, gen)
    cos, sin = rotary_tables(shape.capacity, shape.head_dim, dtype)
    io = new_io(shape, rows, dtype, gen, past=past, cos=cos, sin=sin)
    ref = clone_io(io)
    _run(fused_layer_call(lib, shape, w, io))
    _run(chain_layer_call(lib, shape, w, ref))
    # The opening norms are ResidualRMSNorm's arithmetic: the same bits.
    assert torch.equal(io.sum_out, ref.sum_out)
    for got, want in ((io.mid_out, ref.mid_out), (io.mlp_out, ref.mlp_out),
                      (io.key_cache[:, :, past:past + rows], ref.key_cache[:, :, past:past + rows]),
                      (io.value_cache[:, :, past:past + rows], ref.value_cache[:, :, past:past + rows])):
        err = (got.float() - want.float()).abs().max().item()
        assert err <= TOL[dtype] * max(1.0, want.float().abs().max().item()), err
    assert torch.equal(io.key_cache[:, :, :past], ref.key_cache[:, :, :past])  # the past is not touched
    assert torch.equal(io.key_cache[:, :, past + rows:], ref.key_cache[:, :, past + rows:])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,past,rows", [(DEMO, 61, 5), (GQA, 127, 8)])
def test_fused_layer_rows_do_not_depend_on_the_row_count(lib, dtype, shape: Shape, past: int, rows: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(7 * past + rows)
    w = random_layer(shape, dtype, gen)
    cos, sin = rotary_tables(shape.capacity, shape.head_dim, dtype)
    wide = new_io(shape, rows, dtype, gen, past=past, cos=cos, sin=sin)
    base_k, base_v = wide.key_cache.clone(), wide.value_cache.clone()
    _run(fused_layer_call(lib, shape, w, wide))
    one_k, one_v = base_k.clone(), base_v.clone()
    for i in range(rows):
        io = new_io(shape, 1, dtype, gen, past=past + i, cos=cos, sin=sin)
        io.branch, io.residual, io.branch_norm = wide.branch[i:i + 1], wide.residual[i:i + 1], wide.branch_norm
        io.key_cache, io.value_cache = one_k, one_v
        _run(fused_layer_call(lib, shape, w, io))
        for got, want in ((io.sum_out, wide.sum_out), (io.mid_out, wide.mid_out), (io.mlp_out, wide.mlp_out)):
            assert torch.equal(got[0], want[i]), f"row {i}"
    assert torch.equal(one_k, wide.key_cache) and torch.equal(one_v, wide.value_cache)


def test_fused_layer_refuses_what_it_cannot_run(lib) -> None:
    dtype = torch.float16
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = random_layer(DEMO, dtype, gen)
    cos, sin = rotary_tables(DEMO.capacity, DEMO.head_dim, dtype)
    io = new_io(DEMO, 9, dtype, gen, past=10, cos=cos, sin=sin)  # more rows than the kernel takes
    with pytest.raises(RuntimeError, match="invalid argument"):
        fused_layer_call(lib, DEMO, w, io)()
    io = new_io(DEMO, 2, dtype, gen, past=10, cos=cos, sin=sin)
    _run(fused_layer_call(lib, DEMO, w, io))  # and still runs afterwards
    assert torch.isfinite(io.mlp_out.float()).all()
