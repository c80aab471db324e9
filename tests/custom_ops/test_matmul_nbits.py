"""BatchInvariantMatMulNBits on the CPU: int4/int8 weights in MatMulNBits' layout (the exporter's
packing, exporter/quantize.py) against a numpy dequantise-then-matmul reference, rows that do
not depend on the number of rows, the SwiGLU-fused form, and the shape checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from loopcast.exporter.quantize import dequantize, quantize

from tests.custom_ops.ops_models import as_dtype, matmul_nbits_model, session, swiglu_model

SCHEMES = [
    (4, 32, True),
    (4, 32, False),
    (4, 64, True),
    (4, 128, False),
    (8, 32, True),
    (8, 64, False),
    (8, 128, True),
]


def _case(rng, K: int, N: int, bits: int, block: int, symmetric: bool):
    qt = quantize(rng.standard_normal((N, K)).astype(np.float32) * 0.05, bits, block, symmetric)
    feeds = {"B": qt.packed, "scales": qt.scales}
    if not symmetric:
        feeds["zero_points"] = qt.zero_points
    return qt, feeds


@pytest.mark.parametrize("bits,block,symmetric", SCHEMES)
def test_matches_numpy_dequantize_then_matmul(library: Path, bits: int, block: int, symmetric: bool) -> None:
    rng = np.random.default_rng(bits * block + symmetric)
    for K, N in [(96, 40), (200, 24), (384, 72)]:  # 200: a partial last block, K % 16 != 0
        qt, feeds = _case(rng, K, N, bits, block, symmetric)
        sess = session(matmul_nbits_model(K, N, bits, block, "float32", zero_points=not symmetric), library)
        A = rng.standard_normal((9, K)).astype(np.float32)
        got = sess.run(None, {"A": A, **feeds})[0]
        expected = A.astype(np.float64) @ dequantize(qt).T.astype(np.float64)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [("float16", 2e-2), ("bfloat16", 5e-2)])
def test_16_bit_activations(library: Path, dtype: str, tol: float) -> None:
    rng = np.random.default_rng(7)
    K, N = 256, 48
    qt, feeds = _case(rng, K, N, 4, 32, False)
    A = as_dtype(rng.standard_normal((5, K)), dtype)
    sess = session(matmul_nbits_model(K, N, 4, 32, dtype, zero_points=True), library)
    got = sess.run(None, {"A": A, **feeds})[0].astype(np.float64)
    expected = A.astype(np.float64) @ dequantize(qt).T.astype(np.float64)
    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("bits,block,symmetric", [(4, 32, True), (4, 128, False), (8, 64, False)])
def test_rows_do_not_depend_on_the_number_of_rows(
    library: Path, bits: int, block: int, symmetric: bool
) -> None:
    """M = 1..40 (past the kernel's 16-row tile) against M = 1, bit for bit."""
    rng = np.random.default_rng(2)
    K, N = 328, 200  # K: a partial block and a K % 16 tail; N: a partial column group
    _, feeds = _case(rng, K, N, bits, block, symmetric)
    sess = session(matmul_nbits_model(K, N, bits, block, "float32", zero_points=not symmetric), library)
    A = rng.standard_normal((40, K)).astype(np.float32)
    single = np.concatenate([sess.run(None, {"A": A[i : i + 1], **feeds})[0] for i in range(40)])
    for m in [*range(2, 18), 31, 40]:
        assert np.array_equal(sess.run(None, {"A": A[:m], **feeds})[0], single[:m]), m


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_swiglu_attribute_is_the_swiglu_op_then_the_product(library: Path, dtype: str) -> None:
    rng = np.random.default_rng(4)
    K, N = 160, 48
    _, feeds = _case(rng, K, N, 4, 32, True)
    gate_up = as_dtype(2 * rng.standard_normal((6, 2 * K)), dtype)
    act = session(swiglu_model(2 * K, dtype), library).run(None, {"gate_up": gate_up[None]})[0][0]
    plain = session(matmul_nbits_model(K, N, 4, 32, dtype, zero_points=False), library)
    fused = session(matmul_nbits_model(K, N, 4, 32, dtype, zero_points=False, swiglu=True), library)
    got = fused.run(None, {"A": gate_up, **feeds})[0]
    assert np.array_equal(got, plain.run(None, {"A": act, **feeds})[0])
    one_by_one = np.concatenate([fused.run(None, {"A": gate_up[i : i + 1], **feeds})[0] for i in range(6)])
    assert np.array_equal(one_by_one, got)


def test_shape_errors_name_the_layout(library: Path) -> None:
    rng = np.random.default_rng(0)
    _, feeds = _case(rng, 64, 8, 4, 32, True)
    sess = session(matmul_nbits_model(64, 8, 4, 32, "float32", zero_points=False, symbolic=True), library)
    with pytest.raises(Exception, match=r"expects A\[\.\.\., K\] with K=64, got A\[2, 60\]"):
        sess.run(None, {"A": np.zeros((2, 60), np.float32), **feeds})
    wrong = session(matmul_nbits_model(64, 8, 4, 64, "float32", zero_points=False, symbolic=True), library)
    with pytest.raises(Exception, match=r"B must be uint8 \[8, 1, 32\] .* got \[8, 2, 16\]"):
        wrong.run(None, {"A": np.zeros((2, 64), np.float32), **feeds})
