"""The norm prologue of BatchInvariantMatMul and BatchInvariantMatMulNBits (CPU): with a
norm_weight input the projection reads ResidualRMSNorm's normed rows in A's place and can return
the norm's sum, bit for bit the ResidualRMSNorm node followed by the plain projection; rows that do
not depend on the number of rows; and errors that name the misuse."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from loopcast.exporter.quantize import quantize
from onnx import TensorProto, helper

from tests.custom_ops.ops_models import _io, _wrap, as_dtype, session

DTYPES = ["float32", "float16", "bfloat16"]
PARTS = ("residual", "branch_weight", "loop_weight")
# (residual, branch_weight, loop_weight): the fused stack's three forms (Ouro's sandwich with and
# without the loop-norm, Llama's pre-norm) and the stack's first norm (no residual)
FORMS = [(1, 1, 0), (1, 1, 1), (1, 0, 0), (0, 0, 0), (0, 1, 1)]


def _projection(kind: str, K: int, N: int, a: str, y: str, extra: list[str], outs: list[str], **attrs):
    """The projection node: kind "mm" (BatchInvariantMatMul, B [K, N]) or "nb4" / "nb8"
    (BatchInvariantMatMulNBits, asymmetric block 32)."""
    if kind == "mm":
        return helper.make_node(
            "BatchInvariantMatMul", [a, "B", *extra], [y, *outs], domain="loopcast", **attrs
        )
    bits = int(kind[2:])
    return helper.make_node(
        "BatchInvariantMatMulNBits",
        [a, "B", "scales", "zero_points", *extra],
        [y, *outs],
        domain="loopcast",
        K=K,
        N=N,
        bits=bits,
        block_size=32,
        **attrs,
    )


def _weight_inputs(kind: str, K: int, N: int, t: int) -> list:
    if kind == "mm":
        return [("B", t, [K, N])]
    bits, nb = int(kind[2:]), -(-K // 32)
    return [
        ("B", TensorProto.UINT8, [N, nb, 32 * bits // 8]),
        ("scales", TensorProto.FLOAT, [N * nb]),
        ("zero_points", TensorProto.UINT8, [N * (-(-nb * bits // 8))]),
    ]


def _model(
    kind: str, K: int, N: int, dtype: str, form: tuple[int, ...], *, fused: bool, sum_out: bool = True
):
    """fused: one projection with the prologue; else ResidualRMSNorm -> the plain projection."""
    t = _io(dtype)
    present = [name if on else "" for name, on in zip(PARTS, form)]
    if fused:
        nodes = [_projection(kind, K, N, "A", "Y", [*present, "g"], ["sum"] if sum_out else [], epsilon=1e-5)]
    else:
        norm = helper.make_node(
            "ResidualRMSNorm", ["A", *present, "g"], ["sum", "h"], domain="loopcast", epsilon=1e-5
        )
        nodes = [norm, _projection(kind, K, N, "h", "Y", [], [])]
    inputs = [("A", t, ["M", K])]
    inputs += [(name, t, ["M", K] if name == "residual" else [K]) for name, on in zip(PARTS, form) if on]
    inputs += [("g", t, [K]), *_weight_inputs(kind, K, N, t)]
    outputs = [("Y", t, ["M", N])] + ([("sum", t, ["M", K])] if sum_out else [])
    cast = {"A", "residual", "branch_weight", "loop_weight", "g", "Y", "sum"} | (
        {"B"} if kind == "mm" else set()
    )
    return _wrap(nodes, inputs, outputs, dtype, cast)


def _feeds(rng, kind: str, M: int, K: int, N: int, dtype: str, form) -> dict:
    feeds = {
        "A": as_dtype(rng.standard_normal((M, K)), dtype),
        "g": as_dtype(1 + 0.5 * rng.standard_normal(K), dtype),
    }
    if form[0]:
        feeds["residual"] = as_dtype(2 * rng.standard_normal((M, K)), dtype)
    for name, on in zip(PARTS[1:], form[1:]):
        if on:
            feeds[name] = as_dtype(1 + 0.5 * rng.standard_normal(K), dtype)
    if kind == "mm":
        feeds["B"] = as_dtype(rng.standard_normal((K, N)) * 0.05, dtype)
    else:
        qt = quantize(rng.standard_normal((N, K)).astype(np.float32) * 0.05, int(kind[2:]), 32, False)
        feeds.update(B=qt.packed, scales=qt.scales, zero_points=qt.zero_points)
    return feeds


@pytest.mark.parametrize("kind", ["mm", "nb4", "nb8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_projection_is_the_norm_then_the_projection_bit_for_bit(
    library: Path, kind: str, dtype: str
) -> None:
    rng = np.random.default_rng(DTYPES.index(dtype) * 3 + len(kind))
    K, N, M = 200, 72, 5  # K not a multiple of 16 or of the 32-block: partial lanes and blocks
    for form in FORMS:
        fused = session(_model(kind, K, N, dtype, form, fused=True), library)
        chain = session(_model(kind, K, N, dtype, form, fused=False), library)
        feeds = _feeds(rng, kind, M, K, N, dtype, form)
        (y, s), (y_ref, s_ref) = fused.run(None, feeds), chain.run(None, feeds)
        np.testing.assert_array_equal(y, y_ref, err_msg=f"{form}: Y")
        np.testing.assert_array_equal(s, s_ref, err_msg=f"{form}: sum")
        assert np.abs(y).max() > 0


@pytest.mark.parametrize("kind", ["mm", "nb4"])
def test_rows_do_not_depend_on_the_number_of_rows(library: Path, kind: str) -> None:
    rng = np.random.default_rng(11)
    K, N = 256, 48
    sess = session(_model(kind, K, N, "float16", (1, 1, 1), fused=True), library)
    feeds = _feeds(rng, kind, 7, K, N, "float16", (1, 1, 1))
    y_all, s_all = sess.run(None, feeds)
    for m in range(7):
        one = {k: (v[m : m + 1] if k in ("A", "residual") else v) for k, v in feeds.items()}
        y, s = sess.run(None, one)
        np.testing.assert_array_equal(y[0], y_all[m])
        np.testing.assert_array_equal(s[0], s_all[m])


def test_the_sum_output_may_be_left_off(library: Path) -> None:
    rng = np.random.default_rng(3)
    K, N = 64, 16
    with_sum = session(_model("mm", K, N, "float32", (1, 1, 0), fused=True), library)
    without = session(_model("mm", K, N, "float32", (1, 1, 0), fused=True, sum_out=False), library)
    feeds = _feeds(rng, "mm", 3, K, N, "float32", (1, 1, 0))
    np.testing.assert_array_equal(with_sum.run(None, feeds)[0], without.run(None, feeds)[0])


def _misuse(kind: str, inputs: list[str], outs: list[str], **attrs) -> bytes:
    K, N, t = 64, 16, TensorProto.FLOAT
    node = _projection(kind, K, N, "A", "Y", inputs, outs, **attrs)
    a_width = 2 * K if attrs.get("swiglu") else K
    ins = [("A", t, ["M", a_width]), *_weight_inputs(kind, K, N, t)]
    ins += [
        (n, t, ["M", K] if n == "residual" else [n == "bad" and 3 or K]) for n in dict.fromkeys(inputs) if n
    ]
    return _wrap([node], ins, [("Y", t, ["M", N])] + [("sum", t, ["M", K]) for _ in outs], "float32", set())


@pytest.mark.parametrize(
    "kind,inputs,outs,attrs,message",
    [
        ("mm", ["residual"], [], {}, "input 2 (residual) is given without input 5 (norm_weight)"),
        (
            "nb4",
            ["", "branch_weight"],
            [],
            {},
            "input 5 (branch_weight) is given without input 7 (norm_weight)",
        ),
        ("mm", [], ["sum"], {}, "output 1 (sum) is requested without input 5 (norm_weight)"),
        ("mm", ["", "", "", "bad"], [], {}, "norm_weight must be [K] = [64], got [3]"),
        (
            "nb8",
            ["", "", "", "g"],
            [],
            {"swiglu": 1},
            "swiglu=1 and the norm prologue (norm_weight) do not combine",
        ),
    ],
)
def test_misuse_is_refused_by_name(library: Path, kind, inputs, outs, attrs, message) -> None:
    rng = np.random.default_rng(0)
    model = _misuse(kind, inputs, outs, **attrs)
    feeds = _feeds(rng, kind, 2, 64, 16, "float32", (0, 0, 0))
    del feeds["g"]
    if attrs.get("swiglu"):
        feeds["A"] = rng.standard_normal((2, 128)).astype(np.float32)
    for name in inputs:
        if name == "bad":
            feeds["bad"] = np.ones(3, np.float32)
        elif name == "residual":
            feeds["residual"] = rng.standard_normal((2, 64)).astype(np.float32)
        elif name:
            feeds[name] = np.ones(64, np.float32)
    with pytest.raises(
        Exception,
        match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)"),
    ):
        session(model, library).run(None, feeds)
