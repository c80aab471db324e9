"""graphs/norm_prologue.py: a ResidualRMSNorm whose normed output feeds only input A of one
projection is folded into it (the outputs' bits unchanged on the CPU op set), and every other use
of the normed output (two consumers, a graph output, the SwiGLU form, input B) is left alone."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from loopcast.exporter.quantize import quantize
from loopcast.graphs.norm_prologue import fuse_norm_prologues

from tests.custom_ops.conftest import require_c_toolchain

F32 = ir.DataType.FLOAT
K, N = 64, 24


@pytest.fixture(scope="module")
def library():
    require_c_toolchain()
    from loopcast.exporter.export import custom_op_library

    return custom_op_library()


def _value(name: str, shape: list) -> ir.Value:
    return ir.Value(name=name, type=ir.TensorType(F32), shape=ir.Shape(shape))


def _graph(consumers: list[str], *, residual: bool = True, normed_out: bool = False, nbits: bool = False):
    """x, r -> ResidualRMSNorm(x, r, bw, -, g) -> sum, h; then the consumers of h:
    "A" (projection input A), "swiglu" (the SwiGLU form), "B" (as a weight)."""
    x, r = _value("x", ["M", K]), _value("r", ["M", K])
    ins = [x] + ([r] if residual else [])
    bw, g = _value("bw", [K]), _value("g", [K])
    norm = ir.Node(
        "loopcast",
        "ResidualRMSNorm",
        [x, r if residual else None, bw, None, g],
        attributes=[ir.AttrFloat32("epsilon", 1e-5)],
        num_outputs=2,
        name="/norm",
    )
    s, h = norm.outputs
    s.name, h.name = "s", "h"
    nodes, outs = [norm], [s]
    weights = []
    for i, use in enumerate(consumers):
        if use == "B":
            sq = _value(f"sq{i}", [K, K])
            weights.append(sq)
            node = ir.Node("loopcast", "BatchInvariantMatMul", [sq, h], num_outputs=1, name=f"/p{i}")
        elif nbits:
            names = [_value(f"{n}{i}", []) for n in ("B", "scales", "zp")]
            for v, (dt, shape) in zip(
                names, [(ir.DataType.UINT8, [N, 2, 16]), (F32, [N * 2]), (ir.DataType.UINT8, [N])]
            ):
                v.type, v.shape = ir.TensorType(dt), ir.Shape(shape)
            weights += names
            attrs = [
                ir.AttrInt64("K", K),
                ir.AttrInt64("N", N),
                ir.AttrInt64("bits", 4),
                ir.AttrInt64("block_size", 32),
            ]
            node = ir.Node(
                "loopcast",
                "BatchInvariantMatMulNBits",
                [h, *names],
                attributes=attrs,
                num_outputs=1,
                name=f"/p{i}",
            )
        else:
            w = _value(f"w{i}", [K // 2 if use == "swiglu" else K, N])
            weights.append(w)
            attrs = [ir.AttrInt64("swiglu", 1)] if use == "swiglu" else []
            node = ir.Node(
                "loopcast", "BatchInvariantMatMul", [h, w], attributes=attrs, num_outputs=1, name=f"/p{i}"
            )
        node.outputs[0].name = f"y{i}"
        node.outputs[0].type = ir.TensorType(F32)
        nodes.append(node)
        outs.append(node.outputs[0])
    if normed_out:
        outs.append(h)
    for v in outs:
        v.type = ir.TensorType(F32)
    graph = ir.Graph(
        [*ins, bw, g, *weights],
        outs,
        nodes=nodes,
        opset_imports={"": 23, "loopcast": 1},
        name="g",
    )
    return ir.Model(graph, ir_version=10)


def _run(model: ir.Model, library, feeds: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.register_custom_ops_library(str(library))
    sess = ort.InferenceSession(
        ir.to_proto(model).SerializeToString(), so, providers=["CPUExecutionProvider"]
    )
    return sess.run(None, {k: v for k, v in feeds.items() if k in {i.name for i in sess.get_inputs()}})


def _feeds(rng, nbits: bool) -> dict:
    feeds = {
        "x": rng.standard_normal((3, K)).astype(np.float32),
        "r": rng.standard_normal((3, K)).astype(np.float32),
        "bw": (1 + 0.3 * rng.standard_normal(K)).astype(np.float32),
        "g": (1 + 0.3 * rng.standard_normal(K)).astype(np.float32),
        "w0": rng.standard_normal((K, N)).astype(np.float32),
    }
    if nbits:
        qt = quantize(rng.standard_normal((N, K)).astype(np.float32), 4, 32, False)
        feeds.update(B0=qt.packed, scales0=qt.scales, zp0=qt.zero_points)
    return feeds


@pytest.mark.parametrize("nbits", [False, True])
@pytest.mark.parametrize("residual", [True, False])
def test_a_single_projection_takes_the_norm_and_the_bits_stay(library, nbits: bool, residual: bool) -> None:
    rng = np.random.default_rng(int(nbits) * 2 + residual)
    feeds = _feeds(rng, nbits)
    want = _run(_graph(["A"], residual=residual, nbits=nbits), library, feeds)
    model = _graph(["A"], residual=residual, nbits=nbits)
    assert fuse_norm_prologues(model.graph) == 1
    nodes = list(model.graph)
    assert [n.op_type for n in nodes] == ["BatchInvariantMatMulNBits" if nbits else "BatchInvariantMatMul"]
    fused = nodes[0]
    first = 4 if nbits else 2
    assert fused.inputs[0].name == "x" and fused.inputs[first + 3].name == "g"
    assert (fused.inputs[first].name if fused.inputs[first] else None) == ("r" if residual else None)
    assert [v.name for v in fused.outputs] == ["y0", "s"]
    assert fused.attributes["epsilon"].as_float() == pytest.approx(1e-5)
    got = _run(model, library, feeds)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize(
    "consumers,normed_out", [(["A", "A"], False), (["A"], True), (["swiglu"], False), (["B"], False)]
)
def test_other_uses_of_the_normed_rows_are_left_alone(consumers, normed_out: bool) -> None:
    model = _graph(consumers, normed_out=normed_out)
    before = [n.op_type for n in model.graph]
    assert fuse_norm_prologues(model.graph) == 0
    assert [n.op_type for n in model.graph] == before
