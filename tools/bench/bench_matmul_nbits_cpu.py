"""CPU time of loopcast's BatchInvariantMatMulNBits against ONNX Runtime's MatMulNBits on the same
quantized tensors (docs/architecture.md, "Quantized weights").

    python -m tools.bench.bench_matmul_nbits_cpu [--rows 1,5] [--bits 4] [--block 32] [--threads 0]
        [--cpu-time]

One-node graphs per projection shape (a ~135M Llama's and Ouro-1.4B's), weights as initializers,
M rows of fp32 activations; the contenders are timed interleaved (median of --repeats rounds of
--iters calls each). Prints µs per call of ours at accuracy_level 0 (fp32 compute) and 4 (int8
activations), each over MatMulNBits' at the same level, and ours at level 4 over its own one-row
call (what a verify row costs). Wall time needs a quiet machine; ``--cpu-time``
times the process's CPU time instead (with ``--threads 1``: one core's work, what a shared VM can
still measure).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from loopcast.custom_ops.library import custom_op_library
from loopcast.exporter.quantize import quantize
from onnx import TensorProto, helper, numpy_helper

# (label, K, N)
SHAPES = [
    ("135M gate_up", 576, 3072),
    ("135M down", 1536, 576),
    ("1.4B gate_up", 2048, 11264),
    ("1.4B down", 5632, 2048),
    ("1.4B o", 2048, 2048),
]


def _session(node, k: int, n: int, inits: list, library, threads: int) -> ort.InferenceSession:
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
        inits,
    )
    model = helper.make_model(
        graph,
        opset_imports=[
            helper.make_opsetid("", 21),
            helper.make_opsetid("com.microsoft", 1),
            helper.make_opsetid("loopcast", 1),
        ],
        ir_version=10,
    )
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    if library is not None:
        so.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def sessions(k: int, n: int, bits: int, block: int, symmetric: bool, library, threads: int) -> dict:
    """name -> session over one RTN-quantized random [n, k] weight."""
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32) * 0.05
    qt = quantize(w, bits, block, symmetric)
    inits = [numpy_helper.from_array(qt.packed, "B"), numpy_helper.from_array(qt.scales, "scales")]
    inputs = ["A", "B", "scales"]
    if qt.zero_points is not None:
        inits.append(numpy_helper.from_array(qt.zero_points, "zp"))
        inputs.append("zp")
    attrs = {"K": k, "N": n, "bits": bits, "block_size": block}
    out = {}
    for name, level in (("ours", 0), ("ours4", 4)):
        node = helper.make_node(
            "BatchInvariantMatMulNBits", inputs, ["Y"], domain="loopcast", accuracy_level=level, **attrs
        )
        out[name] = _session(node, k, n, inits, library, threads)
    for level in (0, 4):
        node = helper.make_node(
            "MatMulNBits", inputs, ["Y"], domain="com.microsoft", accuracy_level=level, **attrs
        )
        out[f"nbits{level}"] = _session(node, k, n, inits, None, threads)
    return out


def time_calls(sess: ort.InferenceSession, feeds: dict, iters: int, clock=time.perf_counter) -> float:
    t0 = clock()
    for _ in range(iters):
        sess.run(None, feeds)
    return (clock() - t0) / iters * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,5")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--asymmetric", action="store_true")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: ORT's default)")
    parser.add_argument("--cpu-time", action="store_true", help="process CPU time instead of wall time")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    library = custom_op_library()
    zp = "asym" if args.asymmetric else "sym"
    clock = time.process_time if args.cpu_time else time.perf_counter
    what = "CPU" if args.cpu_time else "wall"
    print(
        f"onnxruntime {ort.__version__}; int{args.bits} block {args.block} {zp}; {what} µs per call (median)"
    )
    print(
        f"{'shape':<14} {'M':>3} {'ours 0':>9} {'ours 4':>9} {'level 0':>9} {'level 4':>9} {'ours0/l0':>8} "
        f"{'ours4/l4':>8} {'ours4 xM1':>9}"
    )
    ours4_m1: dict[str, float] = {}
    for label, k, n in SHAPES:
        sess = sessions(k, n, args.bits, args.block, not args.asymmetric, library, args.threads)
        for m in (int(r) for r in args.rows.split(",")):
            feeds = {"A": np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)}
            for s in sess.values():
                time_calls(s, feeds, 2)  # warm-up
            rounds: dict[str, list[float]] = {name: [] for name in sess}
            for _ in range(args.repeats):  # interleaved
                for name, s in sess.items():
                    rounds[name].append(time_calls(s, feeds, args.iters, clock))
            med = {name: float(np.median(v)) for name, v in rounds.items()}
            ours4_m1.setdefault(label, med["ours4"])
            ratios = (
                med["ours"] / med["nbits0"],
                med["ours4"] / med["nbits4"],
                med["ours4"] / ours4_m1[label],
            )
            print(
                f"{label:<14} {m:>3} {med['ours']:>9.1f} {med['ours4']:>9.1f} {med['nbits0']:>9.1f} "
                f"{med['nbits4']:>9.1f} {ratios[0]:>8.2f} {ratios[1]:>8.2f} {ratios[2]:>9.2f}"
            )


if __name__ == "__main__":
    main()
