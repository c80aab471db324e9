"""BatchInvariantMatMulNBits with accuracy_level 4 on the CPU (int8 activations per block,
custom_ops/src/matmul_nbits_q8_cpu.h): against a numpy reference of the same quantization, rows
that do not depend on the number of rows, the AVX-512 VNNI and AVX2 paths' bits equal to the
portable path's, the thread count changing nothing, fp32 zero points (a GGUF Q4_1's), and the
refusals."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from loopcast.exporter.quantize import Quantized, dequantize, n_blocks, quantize

from tests.custom_ops.ops_models import matmul_nbits_model, session, swiglu_model

# The vector paths (LOOPCAST_CPU_ISA caps the kernel at one) and the CPU flags each needs.
ISA_FLAGS = {"avx2": {"avx2", "fma"}, "avx512": {"avx512f", "avx512bw", "avx512_vnni", "avx512vbmi"}}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def _pin(monkeypatch: pytest.MonkeyPatch, isa: str) -> None:
    """The kernel on `isa` from here on (skips where this CPU lacks it)."""
    if isa != "portable" and not ISA_FLAGS[isa] <= _cpu_flags():
        pytest.skip(f"this CPU has no {isa}")
    monkeypatch.setenv("LOOPCAST_CPU_ISA", isa)


VECTOR_ISAS = pytest.mark.parametrize("isa", ["avx2", "avx512"])

# (bits, block, zero points: "none" | "u8" | "f32")
SCHEMES = [
    (4, 32, "none"),
    (4, 32, "u8"),
    (4, 32, "f32"),
    (4, 16, "none"),
    (4, 64, "f32"),
    (4, 128, "u8"),
    (4, 256, "none"),
    (8, 32, "none"),
    (8, 16, "u8"),
    (8, 128, "none"),
]


def _case(rng, K: int, N: int, bits: int, block: int, zp: str) -> tuple[Quantized, dict]:
    qt = quantize(rng.standard_normal((N, K)).astype(np.float32) * 0.05, bits, block, zp == "none")
    if zp == "f32":  # fractional zero points, as -m/d of a Q4_1 block
        nb = n_blocks(K, block)
        qt = dataclasses.replace(qt, zero_points=rng.uniform(0.0, 15.0, N * nb).astype(np.float32))
    feeds = {"B": qt.packed, "scales": qt.scales}
    if zp != "none":
        feeds["zero_points"] = qt.zero_points
    return qt, feeds


def _model(K: int, N: int, bits: int, block: int, zp: str, **kw) -> bytes:
    zero_points, float_zero_points = zp != "none", zp == "f32"
    return matmul_nbits_model(
        K,
        N,
        bits,
        block,
        "float32",
        zero_points=zero_points,
        float_zero_points=float_zero_points,
        accuracy_level=4,
        **kw,
    )


def _q8_reference(A: np.ndarray, K: int, block: int) -> np.ndarray:
    """The activations the kernel multiplies: per row and block, q = rint(a · 127/max|a|) (fp32
    arithmetic), times max|a|/127."""
    out = np.zeros_like(A, dtype=np.float64)
    for b0 in range(0, K, block):
        a = A[:, b0 : b0 + block].astype(np.float32)
        amax = np.abs(a).max(axis=1, keepdims=True)
        inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
        q = np.clip(np.rint(a * inv), -127, 127)
        out[:, b0 : b0 + block] = q * (amax / np.float32(127)).astype(np.float32)
    return out


@pytest.mark.parametrize("bits,block,zp", SCHEMES)
def test_matches_the_int8_activation_reference(library: Path, bits: int, block: int, zp: str) -> None:
    rng = np.random.default_rng(bits * block + len(zp))
    for K, N in [(96, 40), (200, 24), (576, 72)]:  # 200: a partial block and chunk
        qt, feeds = _case(rng, K, N, bits, block, zp)
        sess = session(_model(K, N, bits, block, zp), library)
        A = rng.standard_normal((9, K)).astype(np.float32)
        got = sess.run(None, {"A": A, **feeds})[0]
        w = dequantize(qt).T.astype(np.float64)
        expected = _q8_reference(A, K, block) @ w
        scale = np.abs(_q8_reference(A, K, block)) @ np.abs(w)
        assert np.all(np.abs(got - expected) <= 1e-5 * scale + 1e-7), (K, N)
        # and near the fp32 product: int8 activations cost about 1 % here
        plain = A.astype(np.float64) @ w
        assert np.abs(got - plain).max() <= 0.03 * np.abs(plain).max()


@pytest.mark.parametrize("bits,block,zp", [(4, 32, "none"), (4, 32, "f32"), (4, 128, "u8"), (8, 64, "none")])
def test_rows_do_not_depend_on_the_number_of_rows(library: Path, bits: int, block: int, zp: str) -> None:
    """M = 1..40 against M = 1, bit for bit (the kernel tiles 8 rows, then the rows left in one
    tile of their count, 1 to 7, each over 1, 2 or 4 columns; the lanes of 16 columns combine
    at once, and N = 203 leaves a group of 11)."""
    rng = np.random.default_rng(3)
    K, N = 600, 203  # (4-bit) a wide chunk, then a partial block and chunk; N: partial column tiles and tasks
    _, feeds = _case(rng, K, N, bits, block, zp)
    sess = session(_model(K, N, bits, block, zp), library)
    A = rng.standard_normal((40, K)).astype(np.float32)
    single = np.concatenate([sess.run(None, {"A": A[i : i + 1], **feeds})[0] for i in range(40)])
    for m in [*range(2, 10), 13, 31, 40]:
        assert np.array_equal(sess.run(None, {"A": A[:m], **feeds})[0], single[:m]), m


@VECTOR_ISAS
@pytest.mark.parametrize(
    "bits,block,zp", [(4, 32, "f32"), (4, 16, "u8"), (8, 32, "none"), (8, 64, "u8"), (4, 256, "none")]
)
def test_vector_and_portable_paths_give_the_same_bits(
    library: Path, monkeypatch: pytest.MonkeyPatch, isa: str, bits: int, block: int, zp: str
) -> None:
    rng = np.random.default_rng(5)
    K, N = 1100, 37  # 4-bit blocks of 32 and more: two wide chunks, then narrow ones
    _, feeds = _case(rng, K, N, bits, block, zp)
    sess = session(_model(K, N, bits, block, zp), library)
    # 1..8 rows: each tile's own row count; 13: an 8-row tile and a 5-row one
    A = (rng.standard_normal((13, K)) * rng.uniform(0.1, 10, (13, 1))).astype(np.float32)
    counts = [*range(1, 9), 13]
    _pin(monkeypatch, isa)
    vector = [sess.run(None, {"A": A[:m], **feeds})[0] for m in counts]
    _pin(monkeypatch, "portable")
    portable = [sess.run(None, {"A": A[:m], **feeds})[0] for m in counts]
    for m, v, p in zip(counts, vector, portable, strict=True):
        assert np.array_equal(v, p), m


@VECTOR_ISAS
@pytest.mark.parametrize("bits,block,zp", [(4, 32, "none"), (8, 32, "none"), (4, 16, "u8"), (8, 16, "f32")])
@pytest.mark.parametrize("K", [16, 48, 200])
def test_short_columns_read_no_further_than_the_tensor(
    library: Path, monkeypatch: pytest.MonkeyPatch, isa: str, bits: int, block: int, zp: str, K: int
) -> None:
    """A partial last chunk longer than the rest of the tensor's columns (K = 16 at 8 bits: a
    column of 16 bytes, a chunk of 128): the vector path reads on into the next columns except
    near the tensor's end, and gives the portable path's bits for every column and row count."""
    rng = np.random.default_rng(K + bits)
    N = 11  # 1-row tiles of four columns, then two, then one
    _, feeds = _case(rng, K, N, bits, block, zp)
    sess = session(_model(K, N, bits, block, zp), library)
    A = rng.standard_normal((6, K)).astype(np.float32)
    _pin(monkeypatch, isa)
    vector = [sess.run(None, {"A": A[:m], **feeds})[0] for m in (1, 2, 3, 6)]
    _pin(monkeypatch, "portable")
    for m, v in zip((1, 2, 3, 6), vector, strict=True):
        assert np.array_equal(v, sess.run(None, {"A": A[:m], **feeds})[0]), m


@VECTOR_ISAS
@pytest.mark.parametrize("bits,block,zp", [(4, 32, "none"), (4, 16, "f32"), (8, 32, "u8")])
def test_non_finite_activations_quantize_alike_on_both_paths(
    library: Path, monkeypatch: pytest.MonkeyPatch, isa: str, bits: int, block: int, zp: str
) -> None:
    """A NaN, an inf and a block of zeros in a row: the vector quantizer's blocks (a NaN skipped
    by max|a|, an inf block's codes NaN and so 0) are the portable one's, row by row."""
    rng = np.random.default_rng(7)
    K, N = 600, 29
    _, feeds = _case(rng, K, N, bits, block, zp)
    sess = session(_model(K, N, bits, block, zp), library)
    A = rng.standard_normal((9, K)).astype(np.float32)
    A[0, 3], A[1, 40], A[2, 77], A[3, 100 : 100 + block] = np.nan, np.inf, -np.inf, 0.0
    A[4, ::7] = np.nan
    _pin(monkeypatch, isa)
    vector = sess.run(None, {"A": A, **feeds})[0]
    _pin(monkeypatch, "portable")
    portable = sess.run(None, {"A": A, **feeds})[0]
    assert np.array_equal(vector, portable, equal_nan=True)
    assert np.isfinite(vector[5:]).all()  # the rows without a non-finite value


@VECTOR_ISAS
@pytest.mark.parametrize("bits,block", [(4, 32), (4, 64), (4, 128), (4, 256), (8, 16), (8, 128)])
@pytest.mark.parametrize("K", [700, 1300])
def test_packed_zero_points_on_both_paths(
    library: Path, monkeypatch: pytest.MonkeyPatch, isa: str, bits: int, block: int, K: int
) -> None:
    """uint8 zero points unpacked in registers (two blocks a byte at 4 bits; a chunk's first
    block odd for blocks of 128 and 256 past the wide chunks) against the portable path and the
    reference."""
    rng = np.random.default_rng(K + block)
    N = 45
    qt, feeds = _case(rng, K, N, bits, block, "u8")
    sess = session(_model(K, N, bits, block, "u8"), library)
    A = rng.standard_normal((9, K)).astype(np.float32)  # an 8-row tile and a row
    _pin(monkeypatch, isa)
    vector = sess.run(None, {"A": A, **feeds})[0]
    w = dequantize(qt).T.astype(np.float64)
    expected = _q8_reference(A, K, block) @ w
    scale = np.abs(_q8_reference(A, K, block)) @ np.abs(w)
    assert np.all(np.abs(vector - expected) <= 1e-5 * scale + 1e-7)
    _pin(monkeypatch, "portable")
    assert np.array_equal(vector, sess.run(None, {"A": A, **feeds})[0])


def test_threads_change_nothing(library: Path) -> None:
    rng = np.random.default_rng(6)
    K, N = 576, 960
    _, feeds = _case(rng, K, N, 4, 32, "f32")
    A = rng.standard_normal((5, K)).astype(np.float32)
    outs = []
    for threads in (1, 2):
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.register_custom_ops_library(str(library))
        sess = ort.InferenceSession(_model(K, N, 4, 32, "f32"), so, providers=["CPUExecutionProvider"])
        outs.append(sess.run(None, {"A": A, **feeds})[0])
    assert np.array_equal(outs[0], outs[1])


def test_swiglu_then_the_int8_product(library: Path) -> None:
    rng = np.random.default_rng(4)
    K, N = 160, 48
    _, feeds = _case(rng, K, N, 4, 32, "none")
    gate_up = (2 * rng.standard_normal((6, 2 * K))).astype(np.float32)
    act = session(swiglu_model(2 * K, "float32"), library).run(None, {"gate_up": gate_up[None]})[0][0]
    plain = session(_model(K, N, 4, 32, "none"), library)
    fused = session(_model(K, N, 4, 32, "none", swiglu=True), library)
    got = fused.run(None, {"A": gate_up, **feeds})[0]
    assert np.array_equal(got, plain.run(None, {"A": act, **feeds})[0])


def test_zero_rows_and_zero_activations(library: Path) -> None:
    rng = np.random.default_rng(8)
    _, feeds = _case(rng, 64, 16, 4, 32, "u8")
    sess = session(_model(64, 16, 4, 32, "u8"), library)
    assert sess.run(None, {"A": np.zeros((0, 64), np.float32), **feeds})[0].shape == (0, 16)
    assert not sess.run(None, {"A": np.zeros((3, 64), np.float32), **feeds})[0].any()


def test_bad_accuracy_level_and_zero_point_sizes_are_named(library: Path) -> None:
    bad = matmul_nbits_model(64, 8, 4, 32, "float32", zero_points=False, accuracy_level=2)
    message = r"accuracy_level must be 0 \(fp32 activations\) or 4 \(int8\), got 2"
    with pytest.raises(Exception, match=message):
        session(bad, library)
    rng = np.random.default_rng(0)
    _, feeds = _case(rng, 64, 8, 4, 32, "f32")
    sess = session(_model(64, 8, 4, 32, "f32", symbolic=True), library)
    feeds["zero_points"] = feeds["zero_points"][:-1]
    with pytest.raises(Exception, match=r"float zero_points must hold N·n_blocks = 16 values, got \[15\]"):
        sess.run(None, {"A": np.zeros((2, 64), np.float32), **feeds})
