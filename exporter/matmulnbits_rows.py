"""Whether ONNX Runtime's MatMulNBits keeps a row's result independent of the row count on this CPU.

It depends on the CPU (MLAS picks its int4/int8 kernels by instruction set: on AVX-512 VNNI
machines `accuracy_level` 4 at block 32 is row-invariant, on AVX2-only ones it is not), on
(bits, block size, accuracy level, zero points) and on the shape. The fp32 "auto" export of a
quantized checkpoint asks this before it builds anything: where the stock op's rows differ, it
builds the loopcast op set instead (BatchInvariantMatMulNBits, invariant on every CPU), so that
speculation stays exact. The artifact's own ``exact_verify`` is still measured afterwards on the
shallow twin (exporter/exactness_probe.py); this is the cheap question asked first, one-node
graphs at the artifact's distinct shapes on random codes (invariance is the kernel's, not the
values'). ``python -m tools.probes.check_matmulnbits_rows`` prints the whole table.
"""

from __future__ import annotations

import numpy as np

from loopcast.quant import QuantLinear

PROBE_ROWS = 8  # a verify round of up to 7 drafts runs 8 rows


def matmulnbits_session(linear: QuantLinear, packed, scales, zero_points, threads: int = 0):
    """A one-node com.microsoft MatMulNBits session of ``linear``'s attributes on these tensors."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "scales")]
    inputs = ["A", "B", "scales"]
    if zero_points is not None:
        inits.append(numpy_helper.from_array(zero_points, "zp"))
        inputs.append("zp")
    node = helper.make_node(
        "MatMulNBits",
        inputs,
        ["Y"],
        domain="com.microsoft",
        K=linear.k,
        N=linear.n,
        bits=linear.bits,
        block_size=linear.block_size,
        accuracy_level=linear.accuracy_level,
    )
    graph = helper.make_graph(
        [node],
        "rows",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", linear.k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", linear.n])],
        inits,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
        ir_version=10,
    )
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def random_tensors(linear: QuantLinear, rng: np.random.Generator):
    """Random codes, scales and (asymmetric) zero points in MatMulNBits' layout for ``linear``."""
    blocks = -(-linear.k // linear.block_size)
    blob = linear.block_size * linear.bits // 8
    packed = rng.integers(0, 256, (linear.n, blocks, blob), dtype=np.uint8)
    scales = rng.uniform(0.002, 0.02, linear.n * blocks).astype(np.float32)
    zero_points = None
    if linear.float_zero_points:
        zero_points = rng.uniform(-8, 8, linear.n * blocks).astype(np.float32) * scales
    elif not linear.symmetric:
        per_byte = 8 // linear.bits
        zero_points = rng.integers(0, 256, linear.n * -(-blocks // per_byte), dtype=np.uint8)
    return packed, scales, zero_points


def rows_differ(sess, k: int, rows: int, rng: np.random.Generator) -> float:
    """The largest difference between a row of an M-row call (M = 2..rows) and that row alone;
    0.0 when every row is bit for bit its one-row result."""
    x_MK = rng.standard_normal((rows, k)).astype(np.float32)
    alone_MN = np.concatenate([sess.run(None, {"A": x_MK[i : i + 1]})[0] for i in range(rows)])
    worst = 0.0
    for m in range(2, rows + 1):
        y_MN = sess.run(None, {"A": x_MK[:m]})[0]
        if not np.array_equal(y_MN, alone_MN[:m]):
            worst = max(worst, float(np.abs(y_MN - alone_MN[:m]).max()), np.finfo(np.float32).tiny)
    return worst


def stock_rows_invariant(linears: dict[str, QuantLinear], rows: int = PROBE_ROWS) -> bool:
    """Whether MatMulNBits is row-invariant on this CPU at every distinct shape and scheme of
    ``linears`` (quantized_linears' map; the gathered embedding is not a MatMulNBits)."""
    rng = np.random.default_rng(0)
    distinct = {
        (q.k, q.n, q.bits, q.block_size, q.symmetric, q.accuracy_level, q.float_zero_points): q
        for q in linears.values()
        if not q.gathered
    }
    for linear in distinct.values():
        sess = matmulnbits_session(linear, *random_tensors(linear, rng))
        if rows_differ(sess, linear.k, rows, rng):
            return False
    return True
