"""Which stock ORT ops give a row the same bits whether it runs alone or among M rows? (CPU)

    python -m tools.probes.check_op_row_invariance [--rows 5]

Builds one-op graphs with the demo model's shapes (hidden 384, intermediate 1024, the
projection shapes), runs M rows in one call and each row alone, and reports bit identity and
the largest difference. GroupQueryAttention is measured on the demo artifact by
tools/probes/check_row_invariance.py (whole graphs) — this script isolates the other ops.
"""

from __future__ import annotations

import argparse

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

H, I = 384, 1024
OPSETS = [helper.make_opsetid("", 23), helper.make_opsetid("com.microsoft", 1)]


def _session(nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=OPSETS, ir_version=10)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _vi(name, width):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, "M", width])


def cases(rng):
    gamma = numpy_helper.from_array(rng.standard_normal(H).astype(np.float32), "g")
    yield (
        "RMSNormalization",
        _session(
            [helper.make_node("RMSNormalization", ["x", "g"], ["y"], axis=-1, epsilon=1e-6, stash_type=1)],
            [_vi("x", H)],
            [_vi("y", H)],
            [gamma],
        ),
    )
    yield (
        "SkipSimplifiedLayerNormalization",
        _session(
            [
                helper.make_node(
                    "SkipSimplifiedLayerNormalization",
                    ["x", "s", "g"],
                    ["y", "", "", "sum"],
                    domain="com.microsoft",
                    epsilon=1e-6,
                )
            ],
            [_vi("x", H), _vi("s", H)],
            [_vi("y", H), _vi("sum", H)],
            [gamma],
        ),
    )
    yield (
        "Sigmoid·Mul·Mul (SwiGLU)",
        _session(
            [
                helper.make_node("Sigmoid", ["x"], ["sg"]),
                helper.make_node("Mul", ["x", "sg"], ["si"]),
                helper.make_node("Mul", ["si", "s"], ["y"]),
            ],
            [_vi("x", I), _vi("s", I)],
            [_vi("y", I)],
        ),
    )
    for k, n in [(H, 3 * H), (H, H), (H, 2 * I), (I, H), (H, 4096)]:
        w = numpy_helper.from_array((rng.standard_normal((k, n)) / 20).astype(np.float32), "W")
        yield (
            f"MatMul {k}x{n}",
            _session([helper.make_node("MatMul", ["x", "W"], ["y"])], [_vi("x", k)], [_vi("y", n)], [w]),
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"| op (CPU EP, fp32, M={args.rows} vs 1) | rows bit-identical | max abs diff |")
    print("|---|:-:|---:|")
    for name, session in cases(rng):
        feeds = {
            i.name: rng.standard_normal((1, args.rows, i.shape[-1])).astype(np.float32)
            for i in session.get_inputs()
        }
        together = session.run(None, feeds)[0]
        alone = np.concatenate(
            [session.run(None, {k: v[:, r : r + 1] for k, v in feeds.items()})[0] for r in range(args.rows)],
            axis=1,
        )
        print(
            f"| {name} | {'yes' if np.array_equal(together, alone) else 'no'} | "
            f"{float(np.abs(together - alone).max()):.3g} |"
        )


if __name__ == "__main__":
    main()
