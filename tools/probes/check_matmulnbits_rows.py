"""Is ONNX Runtime's MatMulNBits row-invariant on this CPU? (docs/architecture.md, "Quantized weights")

    python -m tools.probes.check_matmulnbits_rows [--rows 8] [--threads 0]

Builds one-node com.microsoft MatMulNBits graphs for bits 4 and 8, block sizes 32/64/128,
symmetric and asymmetric (zero points), accuracy_level 0/1/4, at the demo model's projection
shapes and a ~135M Llama's (K=576, N=1536 ...), runs M = 1..rows rows in one call and each row
alone (M=1), and prints per combination whether every row of every M equals its M=1 row bit for
bit, and the largest difference. Row-invariant combinations keep ``exact_verify`` true.
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np
import onnxruntime as ort
from loopcast.exporter.quantize import quantize
from onnx import TensorProto, helper, numpy_helper

# (label, K, N): demo (H 384, I 1024, 6+6+6 heads of 64) and SmolLM-135M (H 576, I 1536, 9+3+3 heads)
SHAPES = [
    ("demo qkv", 384, 1152),
    ("demo down", 1024, 384),
    ("demo head", 384, 4096),
    ("135M gate_up", 576, 3072),
    ("135M down", 1536, 576),
    ("135M qkv", 576, 960),
]


def session(k: int, n: int, bits: int, block: int, symmetric: bool, level: int, rng, threads: int):
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    qt = quantize(w, bits, block, symmetric)
    inits = [numpy_helper.from_array(qt.packed, "B"), numpy_helper.from_array(qt.scales, "scales")]
    inputs = ["A", "B", "scales"]
    if qt.zero_points is not None:
        inits.append(numpy_helper.from_array(qt.zero_points, "zp"))
        inputs.append("zp")
    node = helper.make_node(
        "MatMulNBits",
        inputs,
        ["Y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=bits,
        block_size=block,
        accuracy_level=level,
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
        inits,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
        ir_version=10,
    )
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def rows_invariant(sess, k: int, rows: int, rng) -> tuple[bool, float]:
    """Every row of every M-row call equals the M=1 call on it; the largest difference."""
    x = rng.standard_normal((rows, k)).astype(np.float32)
    alone = np.concatenate([sess.run(None, {"A": x[i : i + 1]})[0] for i in range(rows)])
    same, worst = True, 0.0
    for m in range(1, rows + 1):
        y = sess.run(None, {"A": x[:m]})[0]
        same &= bool(np.array_equal(y, alone[:m]))
        worst = max(worst, float(np.abs(y - alone[:m]).max()))
    return same, worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: ORT's default)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"onnxruntime {ort.__version__}, M = 1..{args.rows}")
    print(f"{'bits':>4} {'block':>5} {'zp':>5} {'level':>5}  invariant  max|diff|  shapes not invariant")
    for bits, block, symmetric, level in itertools.product((4, 8), (32, 64, 128), (True, False), (0, 1, 4)):
        bad, worst = [], 0.0
        for label, k, n in SHAPES:
            try:
                sess = session(k, n, bits, block, symmetric, level, rng, args.threads)
            except Exception as exc:  # an unsupported combination: say so, keep going
                bad.append(f"{label}: {type(exc).__name__}")
                continue
            same, diff = rows_invariant(sess, k, args.rows, rng)
            worst = max(worst, diff)
            if not same:
                bad.append(label)
        zp = "sym" if symmetric else "asym"
        verdict = "yes" if not bad else "NO"
        print(f"{bits:>4} {block:>5} {zp:>5} {level:>5}  {verdict:>9}  {worst:9.2e}  {', '.join(bad)}")


if __name__ == "__main__":
    main()
